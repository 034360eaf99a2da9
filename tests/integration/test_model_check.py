"""A model check of the limiter: random sends (with costs), dispenses, starts, finishes, 429s,
cost corrections, pauses and edits of window and bucket policies on a controlled clock, with the
invariants checked after every step."""
from __future__ import annotations

from datetime import UTC, datetime, timedelta
from fractions import Fraction

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

import dispatcher.limits.catalog
import dispatcher.limits.gate
import dispatcher.retry
from dispatcher import CostNeverFits
from dispatcher.limits import catalog, edit, gate
from dispatcher.limits.shapes import SlidingWindow, TokenBucket
from dispatcher.models import Attempt, CallQueue, KeyBucket, KeyState, RateLimit, StartLog
from tests.claims import claim
from tests.clocks import fake_db_clock

KEY_SETS = [["a"], ["b"], ["a", "b"], ["p:1"], ["p:2", "a"]]
KEYS = sorted({k for ks in KEY_SETS for k in ks})
PERIODS = [1, 2, 5]


class Clock:
    """The one clock every module reads, moved only by the model."""

    def __init__(self) -> None:
        self.now = datetime(2030, 1, 1, tzinfo=UTC)

    def __call__(self, using: str | None = None) -> datetime:
        return self.now


@pytest.fixture
def clock(monkeypatch, settings) -> Clock:

    settings.DISPATCHER_DISPATCH_TIMEOUT = "5s"
    settings.DISPATCHER_RUN_TIMEOUT = "10s"
    settings.DISPATCHER_RETRY_BASE = "500ms"
    monkeypatch.setattr(dispatcher.retry, "JITTER", 0)
    settings.DISPATCHER_MAX_DEFERRALS = ""
    fake = Clock()
    fake_db_clock(monkeypatch, fake)
    # A start reads the policies and the clock in one statement on PostgreSQL; keep its clock fake too.
    monkeypatch.setattr(
        dispatcher.limits.catalog.Policies, "load_with_clock", classmethod(lambda cls, using=None: (cls.load(using), fake()))
    )
    # And the kept policies' statement reads the database's clock: read them afresh at each start.
    monkeypatch.setattr(dispatcher.limits.catalog, "_kept", {})
    monkeypatch.setattr(
        dispatcher.limits.gate, "policies_for_start",
        lambda keys, states, using=None: (*dispatcher.limits.catalog.Policies.load_with_clock(using), None),
    )
    return fake


def make_machine(clock: Clock) -> type[RuleBasedStateMachine]:
    class LimiterModel(RuleBasedStateMachine):
        """The model: what was sent, which messages exist, which handlers run, every start."""

        def __init__(self) -> None:
            super().__init__()
            for model in (Attempt, CallQueue, StartLog, KeyState, RateLimit, KeyBucket):
                model.objects.all().delete()
            clock.now = datetime(2030, 1, 1, tzinfo=UTC)
            self.sent: set[int] = set()
            self.messages: list[tuple[int, int]] = []
            self.running: dict[int, tuple[CallQueue, Attempt]] = {}
            # Per key: [start time, units, call id] of every start, as the model saw it.
            self.starts: dict[str, list[list]] = {k: [] for k in KEYS}
            self.finished: dict[int, str] = {}
            # How many starts each key had when the policies were last edited: a bucket's promise
            # runs from there (by position: starts at one instant may come before and after an edit).
            self.edited_at = dict.fromkeys(KEYS, 0)

        @initialize()
        def some_policies(self) -> None:
            edit.set_policy("a", 3, timedelta(seconds=2), concurrency=2)
            edit.set_policy("p:*", 2, timedelta(seconds=1))
            edit.set_policy("b", 2, timedelta(seconds=2), burst=3)

        # --- actions -------------------------------------------------------------------

        @rule(which=st.integers(0, len(KEY_SETS) - 1), n=st.integers(1, 4), priority=st.integers(-1, 1),
              cost=st.sampled_from([None, None, 1, 2, 3]))
        def send(self, which: int, n: int, priority: int, cost: int | None) -> None:
            for _ in range(n):
                try:
                    call = CallQueue.objects.send(
                        "noop", {}, keys=KEY_SETS[which], priority=priority, max_attempts=2, cost=cost
                    )
                except CostNeverFits:
                    continue  # nothing stored
                self.sent.add(call.id)

        @rule(ms=st.sampled_from([0, 1, 100, 400, 999, 1000, 1001, 2500, 6000, 11000]))
        def tick(self, ms: int) -> None:
            clock.now += timedelta(milliseconds=ms)

        @rule(batch=st.integers(1, 6))
        def dispense(self, batch: int) -> None:
            policies = catalog.Policies.load()
            for text in CallQueue.objects.waiting_key_sets():
                for claimed in claim(text, batch, policies).calls:
                    # The publish, recorded instead of sent to a broker.
                    self.messages.append((claimed.id, claimed.dispatch_no))

        @precondition(lambda self: self.messages)
        @rule(index=st.integers(0, 50), duplicate=st.booleans())
        def deliver(self, index: int, duplicate: bool) -> None:
            message = self.messages[index % len(self.messages)]
            if not duplicate:
                self.messages.remove(message)
            call_id, dispatch_no = message
            started = CallQueue.objects.start(call_id, dispatch_no, worker="model")
            if started.state != "started":
                return
            assert call_id not in self.running, f"call {call_id} started while its handler still runs"
            call = started.call
            assert call is not None and started.attempt is not None
            self.running[call_id] = (call, started.attempt)
            now = clock.now
            policies = catalog.Policies.load()
            for key in call.keys:
                self.starts[key].append([now, call.cost_of(key), call.id])
                for policy in policies.for_key(key):
                    if isinstance(policy, TokenBucket):
                        self.check_bucket(key, policy)
                        continue
                    in_window = sum(u for t, u, _ in self.starts[key] if now - policy.period <= t <= now)
                    assert in_window <= policy.limit, f"{key}: {in_window} units in {policy.period}, limit {policy.limit}"
                caps = [p.concurrency for p in policies.for_key(key) if p.concurrency]
                if caps:
                    busy = sum(1 for c, _ in self.running.values() if key in c.keys)
                    assert busy <= min(caps), f"{key}: {busy} running, concurrency {min(caps)}"

        def check_bucket(self, key: str, policy: TokenBucket) -> None:
            """Every run of starts since the last edit fits the burst plus what refilled meanwhile."""
            starts = [(t, u) for t, u, _ in self.starts[key][self.edited_at[key]:]]
            rate = Fraction(policy.limit, policy.period // timedelta(microseconds=1))
            for i in range(len(starts)):
                units = 0
                for j in range(i, len(starts)):
                    units += starts[j][1]
                    refilled = rate * ((starts[j][0] - starts[i][0]) // timedelta(microseconds=1))
                    assert units <= policy.burst + refilled, f"{key}: {units} units beyond {policy.explain()}"

        @rule(which=st.integers(0, len(KEY_SETS) - 1), cost=st.sampled_from([None, 2]))
        def rush(self, which: int, cost: int | None) -> None:
            """Calls sent, claimed and all started at one instant, twice: a greedy client."""
            self.send(which, 4, 0, cost)
            for _ in range(2):
                self.dispense(6)
                while self.messages:
                    self.deliver(0, False)

        @precondition(lambda self: self.messages)
        @rule(index=st.integers(0, 50))
        def lose_message(self, index: int) -> None:
            self.messages.pop(index % len(self.messages))

        @precondition(lambda self: self.running)
        @rule(index=st.integers(0, 50),
              outcome=st.sampled_from(["done", "done-refund", "error", "permanent", "429", "429-key"]))
        def finish(self, index: int, outcome: str) -> None:
            call_id = sorted(self.running)[index % len(self.running)]
            call, attempt = self.running.pop(call_id)
            if outcome == "done":
                CallQueue.objects.finish_done(call, attempt, {"ok": True})
            elif outcome == "done-refund":
                # The handler reports it used nothing: every key's usage gives the units back.
                CallQueue.objects.finish_done(call, attempt, {"ok": True})
                CallQueue.objects.correct_cost(call, 0)
                for key in call.keys:
                    for entry in self.starts[key]:
                        if entry[2] == call.id and entry[0] == call.started_at:
                            entry[1] = 0
            elif outcome in ("error", "permanent"):
                CallQueue.objects.finish_error(call, attempt, "boom", "", permanent=outcome == "permanent")
            else:
                key = call.keys[0] if outcome == "429-key" else None
                CallQueue.objects.finish_rate_limited(call, attempt, 1.5, key, "429")

        @rule()
        def rescue(self) -> None:
            report = CallQueue.objects.rescue()
            for call_id in report.ids:
                # Its handler is deemed lost; a late finish must not count.
                self.running.pop(call_id, None)

        @rule(key=st.sampled_from(["a", "b", "p:*", "p:1"]), limit=st.integers(1, 4),
              period=st.sampled_from(PERIODS), concurrency=st.sampled_from([None, 1, 2, 3]),
              burst=st.sampled_from([None, None, 1, 2, 4]))
        def set_policy(self, key: str, limit: int, period: int, concurrency: int | None, burst: int | None) -> None:
            edit.set_policy(key, limit, timedelta(seconds=period), concurrency, burst=burst)
            self.edited_at = {k: len(starts) for k, starts in self.starts.items()}

        @rule(key=st.sampled_from(["a", "b", "p:*", "p:1"]))
        def delete_policy(self, key: str) -> None:
            RateLimit.objects.filter(key=key).delete()
            self.edited_at = {k: len(starts) for k, starts in self.starts.items()}

        @rule(key=st.sampled_from(["a", "b", "p:*", "p:2"]), seconds=st.sampled_from([1, 3]))
        def pause(self, key: str, seconds: int) -> None:
            edit.pause_key(key, timedelta(seconds=seconds))

        @rule(key=st.sampled_from(["a", "b", "p:*"]))
        def resume(self, key: str) -> None:
            edit.resume_key(key)

        @rule(index=st.integers(0, 50))
        def cancel(self, index: int) -> None:
            waiting = list(CallQueue.objects.pending().order_by("id").values_list("id", flat=True))
            if waiting:
                CallQueue.objects.cancel([waiting[index % len(waiting)]])

        # --- invariants ------------------------------------------------------------------

        @invariant()
        def every_call_is_accounted_for(self) -> None:
            rows = dict(CallQueue.objects.values_list("id", "status"))
            assert set(rows) == self.sent
            for call_id, status in rows.items():
                before = self.finished.get(call_id)
                assert before is None or before == status, f"call {call_id} left {before} for {status}"
                if status in CallQueue.FINISHED:
                    self.finished[call_id] = status
                if call_id in self.running:
                    assert status == "running"

        @invariant()
        def key_state_counters_equal_the_truth(self) -> None:
            truth = {k: [0, 0, 0, 0] for k in KEYS}
            for call in CallQueue.objects.in_flight():
                for key in call.keys:
                    if call.status == "dispatched":
                        truth[key][0] += 1
                        truth[key][2] += call.cost_of(key)
                    else:
                        truth[key][1] += 1
            for key, starts in self.starts.items():
                truth[key][3] = sum(u for _, u, _ in starts)
            for state in KeyState.objects.exclude(key__endswith="*"):
                running = gate.running_by_key([state.key]).get(state.key, 0)
                counters = [state.reserved, running, state.reserved_units, state.total]
                assert counters == truth.get(state.key, [0, 0, 0, 0]), state.key

        @invariant()
        def attempts_are_honest(self) -> None:
            counted = {}
            for call_id, outcome in Attempt.objects.values_list("call_id", "outcome"):
                if outcome != "rate_limited":
                    counted[call_id] = counted.get(call_id, 0) + 1
            for call in CallQueue.objects.all():
                assert call.attempts == counted.get(call.id, 0), f"call {call.id}"
                assert call.attempts <= call.max_attempts
                done = call.attempt_set.filter(outcome="done").count()
                assert done == (1 if call.status == "done" else 0)

        @invariant()
        def no_window_holds_more_starts_than_the_log_allows(self) -> None:
            # The limiter's own log agrees with the starts the model saw.
            for key in KEYS:
                # A start refunded to 0 units shares its running total with the start before it: id breaks the tie.
                logged = list(StartLog.objects.filter(key=key).order_by("cum", "id").values_list("started_at", "units"))
                assert logged == [(t, u) for t, u, _ in self.starts[key]], key

    return LimiterModel


@pytest.mark.django_db
def test_the_limiter_holds_its_invariants_under_random_operations(clock) -> None:
    run_state_machine_as_test(
        make_machine(clock),
        settings=settings(
            max_examples=30, stateful_step_count=35, deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )


# --- counterexamples the search found, replayed step by step ---------------------------------------
# A replay calls the rules itself: the bucket and window checks run inside ``deliver``, the
# invariants at the end.


def check_invariants(state: RuleBasedStateMachine) -> None:
    state.every_call_is_accounted_for()
    state.key_state_counters_equal_the_truth()
    state.attempts_are_honest()
    state.no_window_holds_more_starts_than_the_log_allows()


@pytest.mark.django_db
def test_a_refund_of_a_start_at_the_instant_a_bucket_began_gives_back_nothing_it_did_not_charge(clock) -> None:
    """Call 12 starts on 'a' before any bucket; at the same instant call 13 starts under the new
    buckets and creates them (their ``since`` is that instant). Refunding call 12 must leave the
    buckets as call 13 left them: a refund older than ``since`` by position, not by time, was
    once given back and let 2 more units start 1001ms later under "4 per 5s, burst 2"."""
    state = make_machine(clock)()
    state.some_policies()
    state.cancel(index=0)
    state.rescue()
    state.rush(cost=2, which=3)
    state.send(cost=None, n=3, priority=1, which=4)
    state.rush(cost=None, which=4)
    state.dispense(batch=2)
    state.finish(index=33, outcome="error")
    state.finish(index=0, outcome="error")
    state.delete_policy(key="a")
    state.finish(index=0, outcome="permanent")
    state.rush(cost=2, which=2)
    state.set_policy(burst=None, concurrency=1, key="p:*", limit=3, period=2)
    state.set_policy(burst=2, concurrency=3, key="a", limit=4, period=5)
    state.set_policy(burst=4, concurrency=None, key="b", limit=4, period=1)
    state.delete_policy(key="b")
    state.set_policy(burst=4, concurrency=None, key="a", limit=1, period=2)
    state.send(cost=2, n=1, priority=0, which=4)
    state.send(cost=2, n=3, priority=1, which=4)
    state.rush(cost=2, which=2)
    state.resume(key="b")
    state.finish(index=2, outcome="done-refund")
    state.send(cost=1, n=2, priority=1, which=4)
    state.cancel(index=36)
    state.tick(ms=1001)
    state.rescue()
    state.cancel(index=29)
    state.resume(key="a")
    state.dispense(batch=4)
    state.send(cost=2, n=1, priority=0, which=3)
    state.rescue()
    state.rescue()
    # The search delivered one message here: the call the wrong refund let through.
    while state.messages:
        state.deliver(duplicate=False, index=47)
    check_invariants(state)


@pytest.mark.django_db
def test_a_refund_gives_back_only_what_the_bucket_still_holds_of_the_start(clock) -> None:
    """2 per 2s, burst 2: 2 units at 0, 1 unit at 1.5s (half a unit of the first still owed, so
    one fits), then the first call is refunded to 0. Without it the bucket would hold the 1.5s
    start alone; moving the state back by the whole 2 units also gave back the 1.5 units that had
    already refilled, and 2 more units fitted at 1.5s: 3 in one instant under burst 2."""
    state = make_machine(clock)()
    state.some_policies()
    state.set_policy(key="a", limit=2, period=2, concurrency=None, burst=2)
    state.send(which=0, n=1, priority=0, cost=2)
    state.dispense(batch=1)
    state.deliver(index=0, duplicate=False)
    state.tick(ms=1000)
    state.tick(ms=400)
    state.tick(ms=100)
    state.send(which=0, n=1, priority=0, cost=1)
    state.dispense(batch=1)
    state.deliver(index=0, duplicate=False)
    assert len(state.starts["a"]) == 2
    state.finish(index=0, outcome="done-refund")
    state.send(which=0, n=1, priority=0, cost=2)
    state.dispense(batch=1)
    while state.messages:
        state.deliver(index=0, duplicate=False)
    check_invariants(state)


@pytest.mark.django_db
def test_a_refund_moves_a_start_of_zero_units_right_after_it_with_the_later_totals(clock) -> None:
    """Calls 30 and 31 start on 'p:1' at one instant, then both are refunded to 0 units, 31 first.
    Call 31's row, now of 0 units, shared call 30's running total; the refund of call 30 moved
    only the totals above its own, so call 31's row kept a total 2 above the starts after it,
    and the log's order (and a window's count from its first start) no longer matched the
    starts. Every start after it in the log's order moves now: a larger total, or the same one
    and a later row."""
    state = make_machine(clock)()
    state.some_policies()
    state.delete_policy(key="p:*")
    state.send(cost=3, n=3, priority=0, which=2)
    state.delete_policy(key="p:1")
    state.rush(cost=2, which=1)
    state.rush(cost=None, which=1)
    state.delete_policy(key="p:1")
    state.finish(index=41, outcome="429-key")
    state.send(cost=None, n=2, priority=-1, which=3)
    state.delete_policy(key="p:*")
    state.delete_policy(key="b")
    state.send(cost=None, n=4, priority=-1, which=1)
    state.rush(cost=2, which=0)
    state.delete_policy(key="p:1")
    state.delete_policy(key="b")
    state.rush(cost=2, which=0)
    state.send(cost=None, n=2, priority=-1, which=3)
    state.rush(cost=2, which=3)
    state.finish(index=22, outcome="429")
    state.finish(index=47, outcome="done-refund")
    state.finish(index=41, outcome="done-refund")
    check_invariants(state)


@pytest.mark.django_db
def test_a_window_counts_a_start_tied_with_a_refunded_one_by_the_logs_order() -> None:
    """Two starts at one instant, the later refunded to 0 units: its row shares the earlier one's
    running total. The window's probe reads the total before its first start; taking the
    refunded row for the first (a plan may return either: here it is the older row on disk)
    counted the earlier start's unit out of the window: 0 used on PostgreSQL before the probe
    broke ties by row (SQLite's index returned the rows by id already)."""
    at = datetime(2030, 1, 1, tzinfo=UTC)
    StartLog.objects.create(id=20, key="w", started_at=at, units=0, cum=1, call_id=2)
    StartLog.objects.create(id=10, key="w", started_at=at, units=1, cum=1, call_id=1)
    state = KeyState.objects.create(key="w", total=1)
    window = SlidingWindow("w", 5, timedelta(seconds=2))
    (reading,) = gate.read_policies({"w": [window]}, {"w": state}, at + timedelta(seconds=1))["w"]
    assert reading.used == 1
