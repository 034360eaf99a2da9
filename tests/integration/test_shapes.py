"""Token buckets and costs through send(), the claim, the start, the commands and the admin."""
from __future__ import annotations

from datetime import timedelta
from io import StringIO

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from dispatcher import CostNeverFits, InvalidCost
from dispatcher.clock import from_us, to_us
from dispatcher.limits import edit
from dispatcher.limits.catalog import Policies
from dispatcher.models import Attempt, CallQueue, KeyBucket, KeyState, RateLimit, StartLog
from dispatcher.status import key_statuses
from dispatcher.worker import execute
from tests.claims import claim

pytestmark = pytest.mark.django_db(transaction=True)


def claim_all(key_set_text: str, limit: int = 100):
    return claim(key_set_text, limit)


def run_all(claimed) -> list[str]:
    return [execute(c.id, c.dispatch_no) for c in claimed]


# --- policies by command -----------------------------------------------------------------------------


def test_ratelimit_set_with_a_burst_makes_a_token_bucket_and_list_shows_it():
    out = StringIO()
    call_command("ratelimit", "set", "shop", "--limit", "2", "--per", "1s", "--burst", "40", stdout=out)
    assert "2 per 1s, burst 40 (token bucket)" in out.getvalue()
    call_command("ratelimit", "set", "nginx", "--limit", "5", "--per", "1s", "--burst", "1", stdout=out)
    assert "smooth rate: one every 200ms" in out.getvalue()
    listed = StringIO()
    call_command("ratelimit", "list", stdout=listed)
    shop = next(line for line in listed.getvalue().splitlines() if line.startswith("shop "))
    assert shop.split() == ["shop", "2", "1s", "bucket", "40", "-"]
    listed = StringIO()
    call_command("ratelimit", "list", "--json", stdout=listed)
    assert '"shape": "bucket"' in listed.getvalue() and '"burst": 40' in listed.getvalue()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--limit", "5", "--per", "1s", "--burst", "0"], "--burst must be between 1"),
        (["--limit", "5", "--per", "1s", "--burst", "-2"], "--burst must be between 1"),
        (["--limit", "5", "--per", "1s", "--burst", "many"], "--burst must be a whole number"),
        # One unit every 0.5 microseconds cannot be kept on the database clock.
        (["--limit", "2000000", "--per", "1s", "--burst", "5"], "microsecond"),
        (["--limit", "5", "--per", "0s", "--burst", "5"], "--per"),
    ],
)
def test_bad_bucket_policies_are_refused_and_nothing_is_stored(args, message):
    with pytest.raises(CommandError, match=message):
        call_command("ratelimit", "set", "api", *args)
    assert not RateLimit.objects.exists()


def test_rate_limits_setting_seeds_a_bucket(settings):
    settings.DISPATCHER_RATE_LIMITS = [{"key": "shop", "limit": 2, "period": "1s", "burst": 40}]
    assert edit.seed_from_settings() == 1
    assert RateLimit.objects.get(key="shop").burst == 40


# --- the bucket through claim and start -----------------------------------------------------------


def test_a_bucket_admits_its_burst_then_waits_one_interval_per_call(settings):
    settings.DISPATCHER_ARRIVAL_GUARD = "0"
    edit.set_policy("greeter", 1, timedelta(minutes=1), burst=3)
    for _ in range(5):
        CallQueue.objects.send("greet", {"name": "ada"})
    first = claim_all(CallQueue.objects.first().key_set)
    assert len(first.calls) == 3
    assert run_all(first.calls) == ["done"] * 3
    again = claim_all(CallQueue.objects.first().key_set)
    # The bucket is empty: the next token comes one interval (a minute) after the burst.
    assert again.calls == [] and again.verdict.blocked
    assert timedelta(seconds=59) < again.verdict.until - StartLog.objects.order_by("-cum").first().started_at
    (bucket,) = KeyBucket.objects.filter(key="greeter")
    assert bucket.period == timedelta(minutes=1)
    (status,) = key_statuses(["greeter"])
    assert (status.policies[0].used, status.policies[0].policy.capacity()) == (3, 3)


def test_a_dispenser_claims_a_smooth_rates_next_calls_as_far_ahead_as_it_looks(settings):
    """15 per second, no burst, a claim looking DISPATCH_AHEAD (100 ms) ahead: the next call is
    claimed while the one before still waits for its worker, as its turn (67 ms on) comes within
    the look ahead; not a third, whose turn (133 ms on) does not. The starts still take one turn
    each."""
    settings.DISPATCHER_ARRIVAL_GUARD = "0"
    edit.set_policy("nginx", 15, timedelta(seconds=1), burst=1)  # one every 66.7 ms
    for _ in range(4):
        CallQueue.objects.send("greet", {"name": "ada"}, keys=["nginx"])
    key_set = CallQueue.objects.first().key_set
    first, second, third = claim_all(key_set, 1), claim_all(key_set), claim_all(key_set)
    assert (len(first.calls), len(second.calls), len(third.calls)) == (1, 1, 0)
    assert third.verdict.blocked and third.verdict.until is not None
    # The starts still take one turn each: the second waits for its slot (early), then starts.
    assert run_all(first.calls) == ["done"]
    assert run_all(second.calls) == ["done"]
    starts = list(StartLog.objects.filter(key="nginx").order_by("started_at").values_list("started_at", flat=True))
    assert starts[1] - starts[0] >= timedelta(microseconds=66_667)


def test_a_start_woken_late_for_its_slot_is_judged_at_its_slot(settings, monkeypatch):
    """A held start that waits for its slot holding the key's lock and wakes a few ms late is
    judged at the slot: its bucket is charged from the moment the slot gave it, so a smooth
    rate's turns stay one interval apart whatever the sleep's overshoot (SLOT_GIVE).

    Each try measures how late the read after the wait came after the slot, on the database's
    clock. On a loaded machine one try in three or four was charged from its read all the same
    (2026-11-29, the code before that day's changes too: noted on issue 28); so up to three
    tries, and at least one must follow the rule. Judged at its read every time (SLOT_GIVE 0),
    none does. A try whose start came after its slot (set 25 ms ahead; CI once took longer to
    get there) waits for nothing and does not count; three such and the test fails."""
    import time as real_time

    from dispatcher.calls import start as start_module
    from dispatcher.clock import db_now

    edit.set_policy("paced", 10, timedelta(seconds=1), burst=1)  # one every 100 ms
    asked: list[float] = []
    judged_on: list = []
    read_after_sleep: list = []
    policies_for_start = start_module.gate.policies_for_start

    def first_reading(*args, **kwargs):
        found = policies_for_start(*args, **kwargs)
        judged_on.append(found[1])  # the start's clock, which its slot is counted from
        return found

    def oversleep(seconds: float) -> None:
        asked.append(seconds)
        real_time.sleep(seconds + 0.003)  # every wait for a slot oversleeps by 3 ms

    def clock(*args):
        moment = db_now(*args)
        if len(asked) > len(read_after_sleep):
            read_after_sleep.append(moment)
        return moment

    monkeypatch.setattr(start_module, "time", type("Late", (), {"sleep": staticmethod(oversleep)}))
    monkeypatch.setattr(start_module, "db_now", clock)
    monkeypatch.setattr(start_module.gate, "policies_for_start", first_reading)
    tries = []
    came_after = 0
    followed = False
    while len(tries) < 3 and came_after < 3 and not followed:
        for seen in (asked, judged_on, read_after_sleep):
            seen.clear()
        KeyState.objects.update_or_create(key="paced", defaults={"send_delay_us": 20_000, "send_delay_since": db_now()})
        KeyBucket.objects.filter(key="paced").delete()  # full again after the try before's charge
        call = CallQueue.objects.send("greet", {"name": "ada"}, keys=["paced"])
        (claimed,) = claim_all(call.key_set).calls
        # Its slot frees 25 ms from now (its moment 45 ms, after the 20 ms hold): the start waits for it.
        KeyBucket.objects.update_or_create(
            key="paced", period=timedelta(seconds=1),
            defaults={"tat_us": to_us(db_now() + timedelta(milliseconds=45)), "since": db_now()},
        )
        before = from_us(KeyBucket.objects.get(key="paced").tat_us)
        assert run_all([claimed]) == ["done"]
        if not asked and len(judged_on) == 1 and judged_on[0] >= before - timedelta(milliseconds=30):
            # Its start came after its slot had freed (more than 25 ms after it was set, a
            # loaded machine: CI once): nothing to wait for, so not this test's case; again.
            came_after += 1
            continue
        assert len(asked) == 1 and len(read_after_sleep) == 1
        # Charged one interval (100 ms, the guard's 5 ms floor and 1 ms slack) from the slot (the
        # start's clock and the wait it asked for), not 3 ms and the clock's read after it; or,
        # had the read come more than SLOT_GIVE (5 ms) after the slot, from SLOT_GIVE before it.
        charged = from_us(KeyBucket.objects.get(key="paced").tat_us) - before
        late = read_after_sleep[0] - (judged_on[-1] + timedelta(seconds=asked[0]))
        assert charged >= timedelta(milliseconds=106)
        tries.append((charged, late))
        followed = charged < timedelta(milliseconds=106 + 1.5) + max(late - timedelta(milliseconds=5), timedelta(0))
    assert followed, (
        f"every try was charged from later than its slot (charged, read after the slot): {tries};"
        f" {came_after} tries started after their slot"
    )
    # The process keeps the reading as it was made, not the slot: its bounds still hold the
    # database's clock between them (a spread of at least the query's round trip), where the
    # slot's 3 ms would have put the lower bound above the upper one, hiding any lateness.
    from dispatcher import arrivals

    _, spread = arrivals._offsets.at(db_now(), fallback=0.0)
    assert spread > 0


def test_under_a_learnt_guard_a_call_above_the_buckets_depth_is_claimed_and_started_alone(settings):
    """A learnt guard of 2.5 s takes 3 tokens of a 10-deep bucket (one per second): depth 7, no
    rate lost. A call of 10 units, which send() accepted, still starts, alone, on a full bucket."""
    from dispatcher.clock import db_now

    settings.DISPATCHER_ARRIVAL_GUARD = "0"
    settings.DISPATCHER_ARRIVAL_GUARD_MAX = "5s"
    edit.set_policy("greeter", 10, timedelta(seconds=10), burst=10)
    # A window beside the bucket: the key's requests are not held (send-time pacing is for keys
    # whose policies are all buckets), so its guard takes the learnt delay.
    edit.set_policy("greeter", 1000, timedelta(hours=1))
    KeyState.objects.update_or_create(key="greeter", defaults={"send_delay_us": 2_500_000, "send_delay_since": db_now()})
    big = CallQueue.objects.send("greet", {"name": "ada"}, cost={"greeter": 10})
    small = CallQueue.objects.send("greet", {"name": "ada"})
    claimed = claim_all(big.key_set)
    # Alone: the small call waits behind it (nothing else is claimed with a call beyond the depth).
    assert [c.id for c in claimed.calls] == [big.id]
    assert CallQueue.objects.get(pk=small.pk).status == "pending"
    assert run_all(claimed.calls) == ["done"]
    (bucket,) = KeyBucket.objects.filter(key="greeter")
    started = CallQueue.objects.get(pk=big.pk).started_at
    assert bucket.tat_us - to_us(started) == 10_000_000
    # On a bucket full for 1 s, 10 units fit 2.5 s after it was full (10 s - (10 s - 2.5 s)); a
    # call within the depth (7) fits as soon as the bucket has 7 tokens.
    KeyBucket.objects.filter(key="greeter").update(tat_us=to_us(db_now() - timedelta(seconds=1)))
    tat = from_us(KeyBucket.objects.get(key="greeter").tat_us)
    CallQueue.objects.filter(pk=small.pk).update(cost={"greeter": 10})
    again = claim_all(small.key_set)
    assert again.calls == [] and again.verdict.blocked
    assert again.verdict.until == tat + timedelta(seconds=2.5)


def test_a_pattern_bucket_gives_every_key_its_own_bucket(settings):
    settings.DISPATCHER_ARRIVAL_GUARD = "0"
    edit.set_policy("greeter:*", 1, timedelta(minutes=1), burst=2)
    for name in ("ada", "ada", "ada", "bob", "bob"):
        CallQueue.objects.send("greet", {"name": name})
    ada = claim_all(CallQueue.objects.filter(params__name="ada").first().key_set)
    bob = claim_all(CallQueue.objects.filter(params__name="bob").first().key_set)
    assert (len(ada.calls), len(bob.calls)) == (2, 2)
    run_all(ada.calls + bob.calls)
    assert sorted(KeyBucket.objects.values_list("key", flat=True)) == ["greeter:ada", "greeter:bob"]


# --- cost --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cost", "message"),
    [
        (0, "between 1"),
        (-3, "between 1"),
        (2**31, "between 1"),
        (2.5, "whole number"),
        ("3", "whole number"),
        (True, "whole number"),
        ({"greeter": 0}, "between 1"),
        ({"nope": 2}, "does not have: nope"),
        ([2], "whole number"),
    ],
)
def test_bad_costs_are_refused_and_nothing_is_stored(cost, message):
    with pytest.raises(InvalidCost, match=message):
        CallQueue.objects.send("greet", {"name": "ada"}, cost=cost)
    with pytest.raises(InvalidCost, match=message):
        CallQueue.objects.send_many([{"method": "greet", "params": {"name": "ada"}, "cost": cost}])
    assert not CallQueue.objects.exists()


def test_a_cost_that_can_never_fit_a_policy_is_refused_at_send():
    edit.set_policy("greeter", 10, timedelta(seconds=1))
    edit.set_policy("greeter:*", 1, timedelta(seconds=1), burst=4)
    with pytest.raises(CostNeverFits, match="cost 11 on key 'greeter'"):
        CallQueue.objects.send("greet", {"name": "ada"}, cost={"greeter": 11})
    with pytest.raises(CostNeverFits, match="greeter:ada"):
        CallQueue.objects.send("greet", {"name": "ada"}, cost=5)
    assert isinstance(CostNeverFits("x"), ValueError)
    assert not CallQueue.objects.exists()
    call = CallQueue.objects.send("greet", {"name": "ada"}, cost={"greeter": 10, "greeter:ada": 4})
    assert call.cost == {"greeter": 10, "greeter:ada": 4}
    assert CallQueue.objects.get(pk=call.pk).cost_of("greeter") == 10


def test_policies_count_units_and_a_costly_call_waits_its_turn():
    edit.set_policy("greeter", 5, timedelta(minutes=1))
    costly = CallQueue.objects.send("greet", {"name": "ada"}, cost={"greeter": 3})
    second = CallQueue.objects.send("greet", {"name": "ada"}, cost={"greeter": 3})
    cheap = CallQueue.objects.send("greet", {"name": "ada"})
    claimed = claim_all(costly.key_set)
    # 3 units fit; the second call's 3 do not (2 left), and the cheap one may not jump it.
    assert [c.id for c in claimed.calls] == [costly.id]
    assert claimed.verdict.blocked
    assert CallQueue.objects.get(pk=second.pk).status == "pending"
    assert CallQueue.objects.get(pk=cheap.pk).status == "pending"
    assert KeyState.objects.get(key="greeter").reserved_units == 3
    assert run_all(claimed.calls) == ["done"]
    assert KeyState.objects.get(key="greeter").total == 3
    (status,) = key_statuses(["greeter"])
    assert status.policies[0].used == 3


def test_a_handler_computes_the_cost_and_reports_what_it_really_used():
    edit.set_policy("llm", 1000, timedelta(minutes=1))
    edit.set_policy("llm", 1000, timedelta(hours=1), burst=1000)
    call = CallQueue.objects.send("complete", {"max_tokens": 800, "used": 120})
    assert call.cost == {"llm": 800}
    with pytest.raises(CostNeverFits):
        CallQueue.objects.send("complete", {"max_tokens": 1001})
    claimed = claim_all(call.key_set)
    assert run_all(claimed.calls) == ["done"]
    # Charged 800 at the start, corrected to the 120 the handler reported.
    assert StartLog.objects.get(key="llm").units == 120
    (status,) = key_statuses(["llm"])
    assert [p.used for p in status.policies] == [120, 120]
    nxt = CallQueue.objects.send("complete", {"max_tokens": 880})
    assert [c.id for c in claim_all(nxt.key_set).calls] == [nxt.id]


def test_send_many_takes_a_cost_per_call():
    calls = CallQueue.objects.send_many([
        {"method": "greet", "params": {"name": "a"}, "cost": 2},
        {"method": "greet", "params": {"name": "b"}},
    ])
    assert [c.cost for c in calls] == [{"greeter": 2, "greeter:a": 2}, None]
    assert [c.cost for c in CallQueue.objects.order_by("id")] == [{"greeter": 2, "greeter:a": 2}, None]


def test_a_refund_never_gives_a_new_bucket_units_it_did_not_charge(settings):
    settings.DISPATCHER_ARRIVAL_GUARD = "0"
    edit.set_policy("llm", 10, timedelta(minutes=1))
    first = CallQueue.objects.send("complete", {"max_tokens": 5})
    run_all(claim_all(first.key_set).calls)
    # The operator learns the API is a bucket: the new shape starts afresh and is then emptied.
    edit.set_policy("llm", 10, timedelta(minutes=1), burst=10)
    second = CallQueue.objects.send("complete", {"max_tokens": 10})
    assert run_all(claim_all(second.key_set).calls) == ["done"]
    CallQueue.objects.correct_cost(CallQueue.objects.get(pk=first.pk), 0)
    # The first call's 5 units were never taken from this bucket: none come back.
    third = CallQueue.objects.send("complete", {"max_tokens": 1})
    assert claim_all(third.key_set).calls == []
    assert StartLog.objects.get(call_id=first.id).units == 0


@pytest.mark.postgres
def test_a_start_is_recorded_at_its_own_statement_clock_and_its_bucket_charge_moves_with_it(settings, monkeypatch):
    """PostgreSQL records a start at the start statement's clock (later than the one it was judged
    on): the call, its attempt and its log row carry that one time, and a bucket is charged from it."""
    from django.db import connection

    from dispatcher.clock import to_us

    settings.DISPATCHER_ARRIVAL_GUARD = "0"
    # One every 100 ms, with a burst: a smooth rate's request (burst 1) would be settled as it goes
    # out, and moved on by the 50 ms its start was judged early (test_send_time_pacing.py).
    edit.set_policy("greeter", 10, timedelta(seconds=1), burst=2)
    call = CallQueue.objects.send("greet", {"name": "ada"})
    (claimed,) = claim_all(call.key_set).calls
    with connection.cursor() as cursor:
        cursor.execute("SELECT clock_timestamp()")
        (before,) = cursor.fetchone()
    # The start is judged on a clock read 50 ms before (as a slow judgement would have).
    load = Policies.load_with_clock.__func__
    monkeypatch.setattr(Policies, "load_with_clock", classmethod(
        lambda cls, using=None: (lambda loaded: (loaded[0], loaded[1] - timedelta(milliseconds=50)))(load(cls, using))
    ))
    # Read the policies (and that clock) afresh at the start, not the ones this process kept.
    monkeypatch.setattr("dispatcher.limits.catalog._kept", {})
    # What the start charges is the point here: keep out the push a send later than the learnt
    # guard gives the bucket afterwards (tests/integration/test_learnt_guard.py covers that push).
    monkeypatch.setattr("dispatcher.limits.ledger.push_buckets", lambda overdue, using=None: None)
    assert run_all([claimed]) == ["done"]
    call.refresh_from_db()
    (attempt,) = Attempt.objects.filter(call=call)
    (logged,) = StartLog.objects.filter(key="greeter")
    assert call.started_at == attempt.started_at == logged.started_at
    assert call.started_at > before
    (bucket,) = KeyBucket.objects.filter(key="greeter")
    # An empty bucket is charged one interval from the start as recorded, not from an earlier clock.
    assert bucket.tat_us == to_us(call.started_at) + 100_000
    assert bucket.since == call.started_at
