"""Dispense: claim due calls under their keys' room in one short transaction, and put back unpublished ones."""
from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from django.db import connections, transaction
from django.db.models import F

from dispatcher.calls import shares
from dispatcher.calls.rows import fail_unreadable, json_value, unreadable_cost
from dispatcher.clock import db_now
from dispatcher.conf import dispatcher_settings
from dispatcher.exceptions import InvalidKey
from dispatcher.keys import parse_key_set, read_key_set
from dispatcher.limits import catalog, gate, ledger, locks
from dispatcher.states import CallStatus as Status
from dispatcher.store import call_sql, functions, prepared, schema
from dispatcher.store.folded import folding, start_transaction

if TYPE_CHECKING:
    from dispatcher.managers import CallQueueManager

log = logging.getLogger("dispatcher")

# How early a pass may claim a call for a slot about to free: about a broker's and a worker's
# pick-up time, so the call reaches its worker as the slot frees (the worker waits for it).
DISPATCH_AHEAD = timedelta(milliseconds=100)


@dataclass(frozen=True)
class Claimed:
    """A call a dispenser has claimed and must now publish."""

    id: int
    dispatch_no: int
    queue: str
    key_set: str
    priority: int = 0
    # Units per key when any differs from 1 (the call's ``cost``).
    cost: dict[str, int] | None = None
    # When it became due: equal priorities are taken earliest first.
    run_at: datetime | None = None

    def units(self, key: str) -> int:
        return (self.cost or {}).get(key, 1)


@dataclass
class BatchClaim:
    """The calls a pass claimed, and each key set's room as the pass found it."""

    calls: list[Claimed]
    verdicts: dict[str, gate.Verdict]


def waiting_key_sets(manager: CallQueueManager, after: str | None = None, limit: int = 10_000) -> list[str]:
    """Return the distinct key sets of waiting calls, in order, one index probe each."""
    # A loose index scan: each step asks the partial index for the next key set.
    with prepared.cursor(manager.db) as cursor:
        cursor.execute(call_sql.waiting_key_sets(), {"after": after if after is not None else "", "limit": limit})
        return [row[0] for row in cursor.fetchall()]


def waiting_key_sets_and_policies(manager: CallQueueManager, limit: int = 10_000) -> tuple[list[str], catalog.Policies]:
    """Return the waiting key sets (``waiting_key_sets``) and the policies a pass judges them by.

    On PostgreSQL the key sets come with the clock and the policies' version in one round trip,
    and the policies this process keeps serve while their version stands and no kept learnt limit
    has expired (as a start's, ``gate.policies_for_start``); else they are read and kept. Read
    before the pass's lock as ever, so an edit committed before the pass binds it.
    """
    db = manager.db
    if not schema.postgresql_path(db):
        return waiting_key_sets(manager, limit=limit), catalog.Policies.load(db)
    kept = catalog.kept_policies(db)
    with prepared.cursor(db) as cursor:
        cursor.execute(functions.key_sets_statement(db), {"after": "", "limit": limit})
        now, version, key_sets = cursor.fetchone()
    reread = catalog.reread_unless_kept(db, kept, version, now)
    if reread is None:
        assert kept is not None  # with nothing kept, the policies are reread
        return list(key_sets), kept[1].fresh()
    return list(key_sets), reread


def _scan_order(call: Claimed) -> tuple[int, datetime | None, int]:
    """The order a key set's scan takes its due calls in: priority, then earliest due, then oldest."""
    return (-call.priority, call.run_at, call.id)


def claim_batch(
    manager: CallQueueManager, key_sets: Sequence[str], budget: int, policies: catalog.Policies
) -> BatchClaim:
    """Claim up to ``budget`` due calls across key sets, sharing it in rounds, in one transaction.

    Each round asks every key set still in play, the least served first, for an equal share of
    what is left (no more than its keys have room for) in one statement, then admits the calls it
    found one at a time in fair turns (``shares``): key sets that compete for a key's room take
    it in turn, whatever order they sent in. A key set that fills its share may take more in the
    next round, so one backlog cannot crowd out a key that has room.
    """
    result = BatchClaim([], {})
    parsed: dict[str, list[str]] = {}
    for text in key_sets:
        try:
            parsed[text] = read_key_set(text)
        except InvalidKey as exc:
            # A row written by hand: its keys cannot be limited, so its calls cannot run.
            fail_unreadable(manager, manager.filter(status=Status.PENDING, key_set=text), str(exc))
            result.verdicts[text] = gate.Verdict(room=0, reason=str(exc))
    all_keys = sorted({key for keys in parsed.values() for key in keys})
    # A claim lost to a database crash leaves nothing wrong: its calls stay pending, their dispatch
    # numbers and their keys' reservations as before (one transaction), and a message it published
    # finds its call not dispatched for it (a stale delivery: nothing runs), or, once the call is
    # claimed again with the same number, one of its two messages starts it. So its COMMIT need not
    # wait for the disk (the start that runs a call commits durably); unless a caller's own
    # transaction holds it, whose commit must stay as durable as the caller chose.
    own = not connections[manager.db].in_atomic_block
    # Fair turns are written through the ORM, which opens a transaction of its own: a pass whose
    # key sets share a key claims in Django's transaction; the others fold BEGIN and COMMIT into
    # their first and last statements (``store.folded``), two round trips fewer.
    shared = any(n > 1 for n in Counter(key for keys in parsed.values() for key in keys).values())
    claimed = folding(lambda fold: _claim_locked(manager, parsed, all_keys, budget, policies, own, fold=fold and not shared))
    result.calls.extend(claimed.calls)
    result.verdicts.update(claimed.verdicts)
    # Publish the most urgent first, as each key set's scan chose them.
    result.calls.sort(key=lambda call: (-call.priority, call.id))
    return result


def _claim_locked(
    manager: CallQueueManager, parsed: dict[str, list[str]], all_keys: list[str], budget: int,
    policies: catalog.Policies, own: bool, *, fold: bool,
) -> BatchClaim:
    """``claim_batch``'s transaction: lock the keys, judge them, claim in fair rounds."""
    result = BatchClaim([], {})
    # Kept short: it holds the key locks every dispenser and worker of these keys waits on.
    with start_transaction(manager.db, fold) as folded:
        states = locks.lock_keys(all_keys, using=manager.db, folded=folded)
        # Judge the windows a little ahead, so a call claimed for a slot about to free
        # reaches its worker as the slot frees; the start re-checks on the clock of then.
        ahead = dispatcher_settings.tuned("DISPATCH_AHEAD", DISPATCH_AHEAD)
        if schema.postgresql_path(manager.db):
            # The clock and the keys' readings in one round trip under the keys' locks.
            now, _, read = gate.clock_and_read(all_keys, states, policies, manager.db, ahead=ahead, unflushed=own)
        else:
            now, read = db_now(manager.db), None
        at = now + ahead
        by_key = gate.assess(all_keys, states, at, policies, for_start=False, using=manager.db, since=now, read=read).verdicts
        room = {key: verdict.room for key, verdict in by_key.items()}
        # A key's first call of the pass may cost more than its room when its bucket admits
        # one call beyond its depth (TokenBucket.alone): nothing else is promised then.
        alone = {key: verdict.largest for key, verdict in by_key.items()}
        active = []
        for text, keys in parsed.items():
            verdict = gate.combine([by_key[key] for key in keys])
            result.verdicts[text] = verdict
            if not verdict.blocked:
                active.append(text)
        # Turns matter only among key sets that share a key; the others are read and written never.
        sharing = Counter(key for text in active for key in parsed[text])
        competing = [text for text in active if any(sharing[key] > 1 for key in parsed[text])]
        turns, recent = shares.load(competing, now, manager.db)
        weight = shares.weights(competing, parsed, manager.db) if competing else {}
        weight.update(dict.fromkeys((text for text in active if text not in weight), 1))
        turns.update(dict.fromkeys((text for text in active if text not in turns), 0.0))
        active.sort(key=lambda text: (turns[text], text))
        given: set[str] = set()
        reserved: dict[str, int] = {}
        reserved_units: dict[str, int] = {}
        # Key sets whose next call costs more than their keys have room for; its cost per key.
        walled: dict[str, dict[str, int]] = {}
        # Per key, the least turn of a key set waiting for its room this pass (shares.interleave).
        held: dict[str, float] = {}
        while active and budget > 0:
            share = max(1, budget // len(active))
            asks: dict[str, int] = {}
            left = budget
            for text in active:
                # Room is in units and every call costs at least one: never more calls than units.
                wanted = min([share, left, *(room[key] for key in parsed[text])])
                if wanted > 0:
                    asks[text] = wanted
                    left -= wanted
            if not asks:
                break
            rows = _claim_rows(manager, asks, now)
            got: dict[str, int] = {}
            # Each key set's calls in the order its scan chose them.
            candidates: dict[str, list[Claimed]] = {text: [] for text in asks}
            for row in sorted(rows, key=_scan_order):
                problem = unreadable_cost(row.cost, parsed[row.key_set])
                if problem:
                    fail_unreadable(manager, manager.filter(id=row.id), problem)
                    continue
                candidates[row.key_set].append(row)

            def admit(row: Claimed, got: dict[str, int] = got) -> list[str]:
                """Count the call on its keys if it fits their room and return no key; else return
                the keys it does not fit (its cost): it ends its key set's turns, so no cheaper call
                of it jumps it, and holds their room for it (``shares.interleave``)."""
                keys = parsed[row.key_set]
                short = [
                    key for key in keys
                    if row.units(key) > room[key] and (key in reserved or row.units(key) > alone[key])
                ]
                if short or row.key_set in walled:
                    walled.setdefault(row.key_set, {key: row.units(key) for key in keys})
                    return short or list(walled[row.key_set])
                got[row.key_set] = got.get(row.key_set, 0) + 1
                for key in keys:
                    room[key] -= row.units(key)
                    reserved[key] = reserved.get(key, 0) + 1
                    reserved_units[key] = reserved_units.get(key, 0) + row.units(key)
                return []

            kept, unfit = shares.interleave(
                candidates, turns,
                lambda row: max((row.units(key) for key in parsed[row.key_set]), default=1) / weight[row.key_set],
                admit, parsed, held,
            )
            given.update(row.key_set for row in kept)
            if unfit:
                manager.filter(id__in=[row.id for row in unfit]).update(status=Status.PENDING, dispatched_at=None)
            result.calls.extend(kept)
            budget -= len(kept)
            # Only a key set that filled its share may have more waiting.
            active = [text for text, wanted in asks.items() if got.get(text, 0) == wanted and text not in walled]
        shares.save({text: turns[text] for text in competing if text in given or text not in recent}, now, manager.db)
        # A key set whose keys this pass filled (or whose next call's cost does not fit)
        # waits for room like one found blocked.
        filled = sorted({key for key in reserved if room[key] <= 0} | {k for c in walled.values() for k in c})
        # The counters are the last write: a folded claim's COMMIT goes with them unless the
        # filled keys are judged again after.
        ledger.adjust_reserved(reserved, reserved_units, using=manager.db, folded=None if filled else folded)
        if filled:
            for key in reserved:
                states[key].reserved += reserved[key]
                states[key].reserved_units += reserved_units[key]
            need: dict[str, int] = {}
            for costs in walled.values():
                for key, units in costs.items():
                    need[key] = max(need.get(key, 1), units)
            after = gate.assess(filled, states, at, policies, for_start=False, costs=need, using=manager.db, since=now).verdicts
            for text, keys in parsed.items():
                if not result.verdicts[text].blocked and any(key in after for key in keys):
                    result.verdicts[text] = gate.combine([after.get(key, by_key[key]) for key in keys])
    return result


def _claim_rows(manager: CallQueueManager, asks: dict[str, int], now: datetime) -> list[Claimed]:
    """Mark up to ``asks[key_set]`` due calls of each key set dispatched; skip rows locked elsewhere."""
    if schema.postgresql_path(manager.db):
        return _claim_rows_postgresql(manager, asks, now)
    return _claim_rows_portable(manager, asks, now)


def _claim_rows_portable(manager: CallQueueManager, asks: dict[str, int], now: datetime) -> list[Claimed]:
    """Per key set: select the due rows (skipping locked ones), then mark them, through the ORM."""
    claimed = []
    for text, wanted in asks.items():
        rows = list(
            manager.filter(status=Status.PENDING, key_set=text, run_at__lte=now)
            .order_by("-priority", "run_at", "id")
            .select_for_update(skip_locked=True)
            .values_list("id", "dispatch_no", "queue", "priority", "cost", "run_at")[:wanted]
        )
        if rows:
            manager.filter(id__in=[r[0] for r in rows]).update(
                status=Status.DISPATCHED, dispatched_at=now, dispatch_no=F("dispatch_no") + 1
            )
        claimed += [
            Claimed(id=i, dispatch_no=n + 1, queue=q, key_set=text, priority=p, cost=c, run_at=r)
            for i, n, q, p, c, r in rows
        ]
    return claimed


def _claim_rows_postgresql(manager: CallQueueManager, asks: dict[str, int], now: datetime) -> list[Claimed]:
    """Select and mark the due calls of every asking key set in one statement (``call_sql.claim_due``)."""
    params: dict[str, Any] = {
        "dispatched": Status.DISPATCHED, "pending": Status.PENDING, "now": now,
        "key_sets": list(asks), "wanted": list(asks.values()),
    }
    with prepared.cursor(manager.db) as cursor:
        cursor.execute(functions.claim_statement(manager.db), functions.bind(manager.db, params))
        return [
            Claimed(id=i, dispatch_no=n, queue=q, key_set=k, priority=p, cost=json_value(c), run_at=r)
            for i, n, q, k, p, c, r in cursor.fetchall()
        ]


def put_back(manager: CallQueueManager, calls: Iterable[Claimed]) -> int:
    """Return claimed calls whose publish failed to waiting at once."""
    by_set: dict[str, list[Claimed]] = {}
    for call in calls:
        by_set.setdefault(call.key_set, []).append(call)
    returned = 0
    for text, group in by_set.items():
        keys = parse_key_set(text)
        with transaction.atomic(using=manager.db):
            locks.lock_keys(keys, using=manager.db)
            won = 0
            units = dict.fromkeys(keys, 0)
            for call in group:
                if manager.filter(id=call.id, status=Status.DISPATCHED, dispatch_no=call.dispatch_no).update(
                    status=Status.PENDING, dispatched_at=None
                ):
                    won += 1
                    for key in keys:
                        units[key] += call.units(key)
            ledger.adjust(keys, reserved=-won, units=units, using=manager.db)
            returned += won
    return returned


def next_due_at(manager: CallQueueManager, now: datetime | None = None) -> datetime | None:
    """Return when the earliest call not yet due at ``now`` (the database's clock if None) becomes due.

    Hand-written on PostgreSQL, with the clock in the same round trip: it follows every partial
    pass, where the ORM's compiling of it was 0.4 ms of the dispenser's CPU while the worker
    took the call just published (both on a two-core machine).
    """
    if schema.postgresql_path(manager.db):
        with prepared.cursor(manager.db) as cursor:
            cursor.execute(functions.next_due_statement(manager.db), {"now": now})
            due: datetime | None = cursor.fetchone()[0]
            return due
    waiting = manager.filter(status=Status.PENDING, run_at__gt=now if now is not None else db_now(manager.db))
    return waiting.order_by("run_at").values_list("run_at", flat=True).first()


def at_workers(manager: CallQueueManager, bound: int) -> int:
    """Count the calls dispatched and not yet started (in the broker or a worker's prefetch),
    up to ``bound``: the backlog the workers have not caught up with."""
    return manager.filter(status=Status.DISPATCHED).values("id")[:bound].count()
