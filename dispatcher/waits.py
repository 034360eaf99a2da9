"""Why a waiting call waits and when it will start: the one answer every view shows.

A call starts once its ``run_at`` has come, no key of it is paused, and every policy of every key
has room for it after the calls queued before it on that key: the calls of its own key set that
come first (priority, then ``run_at``, then age) and, of each key set it shares the key with, as
many as fair turns give that key set before this call's turn (``calls.shares``: as many as this
call has ahead in its own key set, plus one). Each policy answers for its own shape
(``queue_frees_at``: a window one span per full window of units before the call, a bucket one
interval per unit). The moment is exact while the queue ahead starts as fast as the policies
allow; it is a lower bound ("not before") where that depends on how long calls run (a
concurrency cap), on a pause ending, or on what the readings cannot say.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db.models import Count, Q

from dispatcher import liveness
from dispatcher.calls import shares
from dispatcher.clock import db_now
from dispatcher.durations import format_moment
from dispatcher.keys import parse_key_set
from dispatcher.limits import catalog, gate
from dispatcher.models import Attempt, CallQueue, KeyState
from dispatcher.states import WaitKind


@dataclass(frozen=True)
class WaitReason:
    """One thing that holds a call back."""

    kind: WaitKind
    text: str
    until: datetime | None = None
    key: str = ""


@dataclass
class WaitExplanation:
    """Why a call waits and until when (``until`` None: until something else finishes).

    ``stalled`` says what keeps it from moving when a dispenser or worker is missing
    ("no dispenser has run since …", "dispatched 4 min ago, no worker has picked it up").
    """

    waiting: bool
    reasons: list[WaitReason]
    until: datetime | None
    now: datetime
    stalled: str = ""
    # When it will start (``expected_start``): the moment every view shows.
    expected: Expected | None = None

    def summary(self) -> str:
        if not self.waiting:
            text = "not waiting"
        elif not self.reasons:
            text = "due now, but nothing will send it" if self.stalled else "due now: the next dispense pass will send it"
        else:
            text = "; ".join(r.text for r in self.reasons)
            if self.expected is not None:
                text = f"{text}; {self.expected.text(format_moment, self.now)}"
        return f"{text}; {self.stalled}" if self.stalled else text


@dataclass(frozen=True)
class Expected:
    """When a waiting call will start: ``at`` exactly, or not before it when ``exact`` is False."""

    at: datetime
    exact: bool
    # The key whose queue or policy decides the moment ("" when the call's own run_at does).
    key: str = ""
    # Calls queued before this one on that key.
    ahead: int = 0

    def text(self, format_moment: Any, now: datetime) -> str:
        """Say it: "will start at 12:00:05 (in 5 s)", or "not before ..." for a lower bound."""
        if self.at <= now and self.exact:
            return "due now"
        when = format_moment(self.at, now)
        return f"will start at {when}" if self.exact else f"not before {when}"


def ahead_on_key(call: CallQueue, key: str, moment: datetime, now: datetime) -> int:
    """Count the waiting calls that start before ``call`` on ``key``: its own key set's earlier
    ones, and each other key set's calls whose fair turn comes before this call's (see the
    module's docstring and ``calls.shares``: a key set's n-th call goes at its turn plus n over
    its weight; a key set already served further has fewer calls before this one)."""
    db = call._state.db or "default"
    # The call itself is left out by id: SQLite compares stored moments as text, where the column's
    # own default (milliseconds) sorts before the same moment given as a parameter (microseconds).
    waiting = CallQueue.objects.using(db).pending().filter(run_at__lte=moment).exclude(id=call.id)
    earlier = (
        Q(priority__gt=call.priority)
        | Q(priority=call.priority, run_at__lt=call.run_at)
        | Q(priority=call.priority, run_at=call.run_at, id__lt=call.id)
    )
    own = waiting.filter(earlier, key_set=call.key_set).count()
    others = {
        row["key_set"]: row["n"]
        for row in waiting.carrying(key).exclude(key_set=call.key_set).values("key_set").annotate(n=Count("id")).order_by()
    }
    if not others:
        return own
    competing = [call.key_set, *others]
    turns, _ = shares.load(competing, now, db)
    weight = shares.weights(competing, {ks: parse_key_set(ks) for ks in competing}, db)
    mine = turns[call.key_set] + own / weight[call.key_set]
    ahead = own
    for key_set, n in others.items():
        # Its j-th call (from 0) goes at turns[key_set] + j / weight: before this call while that is
        # below this call's turn (or equal, and the key set's name sorts first, as the heap breaks ties).
        room = (mine - turns[key_set]) * weight[key_set]
        before = math.ceil(room) + (1 if key_set < call.key_set and room == math.ceil(room) else 0) if room > 0 else (
            1 if room == 0 and key_set < call.key_set else 0
        )
        ahead += min(n, max(before, 0))
    return ahead


def expected_start(
    call: CallQueue, now: datetime, policies: catalog.Policies, states: dict[str, Any] | None = None
) -> Expected:
    """Return when a waiting call will start (see the module's docstring)."""
    keys = parse_key_set(call.key_set)
    if states is None:
        states = {s.key: s for s in KeyState.objects.filter(key__in=keys)}
    best = Expected(at=max(call.run_at, now), exact=True)
    exact = True
    for key in keys:
        state = states.get(key) or KeyState(key=key)
        pause = max(
            (t for t in (state.paused_until, policies.pattern_pause(key)) if t is not None and t > now), default=None
        )
        governing = policies.for_key(key)
        if not governing:
            if pause is not None and pause > best.at:
                best = Expected(pause, exact, key)
            continue
        ahead = ahead_on_key(call, key, max(call.run_at, now), now)
        found, running = gate.read_keys({key: governing}, {key: state}, now)
        readings = found[key]
        queued = ahead + max(state.reserved_units or 0, 0)
        caps = [p.concurrency for p in governing if p.concurrency]
        if caps and running.get(key, 0) + max(state.reserved or 0, 0) + ahead >= min(caps):
            # Its slot frees when a call in flight (or ahead) finishes: how long that runs is not known.
            exact = False
        at = max(now, pause or now)
        for policy, reading in zip(governing, readings, strict=True):
            need = call.cost_of(key)
            if any(policy is learnt for learnt in policies.learnt.get(key, ())):
                need = min(need, policy.capacity())  # the API's own limit: a costlier call goes alone (gate)
            frees = policy.queue_frees_at(reading, now, queued, need)
            if frees is None:
                exact = False
                continue
            at = max(at, frees)
        if pause is not None and queued:
            # The queue starts when the pause ends; the policies' room then is not known now.
            exact = False
        if at > best.at:
            best = Expected(at, exact, key, ahead)
    return Expected(best.at, exact and best.exact, best.key, best.ahead)


def pause_text(reason: str) -> str:
    """Say how a key is paused: "paused by operator", "paused (429 from call #3)"."""
    if not reason:
        return "paused"
    return reason if reason.startswith("paused") else f"paused ({reason})"


def pause_source(reason: str) -> str:
    """Say who paused a key: "operator", "429 from the API", "the API's rate-limit headers", "pattern"."""
    if reason.startswith("429"):
        return "429 from the API"
    if reason.startswith("API said"):
        return "the API's rate-limit headers"
    if reason == "pattern paused":
        return "pattern pause"
    return "operator" if reason.startswith("paused by operator") or not reason else reason


def explain_call(call: CallQueue, *, now: datetime | None = None, policies: catalog.Policies | None = None) -> WaitExplanation:
    """Say why a call waits and until when: run_at, backoff, 429 deferral, pause, full window, concurrency."""
    now = now or db_now()
    if call.status not in (call.Status.PENDING, call.Status.DISPATCHED, call.Status.RUNNING):
        return WaitExplanation(waiting=False, reasons=[], until=None, now=now)
    stalled = liveness.stall(call, liveness.read(now))
    if call.status != call.Status.PENDING:
        return WaitExplanation(waiting=False, reasons=[], until=None, now=now, stalled=stalled)
    policies = policies or catalog.Policies.load()
    reasons: list[WaitReason] = []
    if call.run_at and call.run_at > now:
        when = format_moment(call.run_at, now)
        last = call.attempt_set.order_by("-id").values_list("outcome", flat=True).first()
        if last == Attempt.Outcome.RATE_LIMITED:
            reasons.append(WaitReason(WaitKind.DEFERRED, f"deferred by a 429 (rate limited downstream); next try at {when}", call.run_at))
        elif last is not None:
            reasons.append(WaitReason(
                WaitKind.BACKOFF,
                f"retry backoff after attempt {call.attempts} of {call.max_attempts} ({last}); next try at {when}",
                call.run_at,
            ))
        else:
            reasons.append(WaitReason(WaitKind.RUN_AT, f"scheduled: run_at is {when}", call.run_at))
    keys = parse_key_set(call.key_set)
    states = {s.key: s for s in KeyState.objects.filter(key__in=keys)}
    for key in keys:
        verdict = gate.check_key(
            key, (states.get(key) or KeyState(key=key)), now, policies, for_start=False, cost=call.cost_of(key)
        )
        if not verdict.blocked:
            continue
        if verdict.kind == WaitKind.PAUSED:
            state = states.get(key)
            reasons.append(WaitReason(
                WaitKind.PAUSED,
                f"key {key} is {pause_text(state.pause_reason if state else '')} until {format_moment(verdict.until, now)}",
                verdict.until, key,
            ))
        elif verdict.kind == WaitKind.CONCURRENCY:
            reasons.append(WaitReason(
                WaitKind.CONCURRENCY,
                f"key {key} is at its concurrency limit ({verdict.reason}); a slot frees when a call in flight finishes",
                None,
                key,
            ))
        else:
            source = " (a limit the API announced)" if verdict.kind == WaitKind.LEARNT else ""
            kind = WaitKind.LEARNT if verdict.kind == WaitKind.LEARNT else WaitKind.RATE
            reasons.append(WaitReason(kind, f"key {key}: {verdict.reason}{source}", verdict.until, key))
    expected = expected_start(call, now, policies, states)
    if expected.ahead and expected.at > now:
        reasons.append(WaitReason(
            WaitKind.QUEUED, f"{expected.ahead} call{'s' if expected.ahead != 1 else ''} ahead of it on key {expected.key}",
            expected.at, expected.key,
        ))
    # A concurrency slot frees when a call in flight finishes: no moment can be promised.
    until = None if any(r.kind == WaitKind.CONCURRENCY for r in reasons) else expected.at
    return WaitExplanation(waiting=True, reasons=reasons, until=until, now=now, stalled=stalled, expected=expected)


# The calls of a bulk retry checked for being held, first in queue order: each is a few columns in
# memory and a step of arithmetic; past them the count of held calls is a lower bound.
HELD_CHECKED = 1000


@dataclass(frozen=True)
class Held:
    """A call just made due that something holds back, why, and how many more of the others are held."""

    call: CallQueue
    explanation: WaitExplanation
    more: int


def first_held(ids: Sequence[int], using: str | None = None) -> Held | None:
    """Return the first of these waiting calls (in queue order) that something holds back, explained, and
    how many others are held; one call is explained, two at most, whatever the number of calls.

    The others are only checked, all at once, against their keys' room now: a call is held when a key
    of it is paused or has less room than the calls before it among these leave. That misses the waiting
    calls outside these and fair turns on shared keys, so when it finds none held, the last of the
    calls in queue order is explained (it waits longest, if any waits).
    """
    manager = CallQueue.objects if using is None else CallQueue.objects.db_manager(using)
    db = manager.db
    waiting = manager.pending().filter(id__in=list(ids))
    rows = list(waiting.order_by("-priority", "run_at", "id").values_list("id", "key_set", "cost")[:HELD_CHECKED])
    if not rows:
        return None
    now = db_now(db)
    policies = catalog.Policies.load(db)
    held = _held_by_room(rows, now, policies, db)
    for call_id in dict.fromkeys([*held[:1], rows[-1][0]]):
        call = waiting.filter(id=call_id).first()
        if call is None:
            continue
        explanation = explain_call(call, now=now, policies=policies)
        if explanation.reasons:
            # The first one checked held is either this call or was not held after all.
            return Held(call, explanation, max(len(held) - 1, 0))
    return None


def _held_by_room(
    rows: list[tuple[int, str, dict[str, int] | None]], now: datetime, policies: catalog.Policies, using: str
) -> list[int]:
    """Return the ids of the calls (in queue order) that their keys' room now cannot take, in order."""
    key_sets = {key_set: parse_key_set(key_set) for _, key_set, _ in rows}
    keys = sorted({key for keys in key_sets.values() for key in keys})
    found = {s.key: s for s in KeyState.objects.using(using).filter(key__in=keys)}
    states = {key: found.get(key) or KeyState(key=key) for key in keys}
    # A copy: judging applies the keys' arrival guards to the policies it is given.
    verdicts = gate.check_each_key(keys, states, now, policies.fresh(), for_start=False, using=using)
    room = {key: max(verdict.room, 0) for key, verdict in verdicts.items()}
    held = []
    for call_id, key_set, cost in rows:
        need = {key: int((cost or {}).get(key, 1)) for key in key_sets[key_set]}
        if any(room[key] < units for key, units in need.items()):
            held.append(call_id)
            continue
        for key, units in need.items():
            room[key] -= units
    return held
