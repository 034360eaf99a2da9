"""Fair shares of a shared key: key sets that compete for its room take it in turn, the least served first.

Start-time fair queueing over key sets. Each key set carries ``served``: the units claimed for it
while it competed, over its weight (``ratelimit weight KEY W``: the largest weight of its keys, 1
by default; a key set of weight 2 gets twice the units of one of weight 1) (``FairShare``, one row per key set, kept across passes, dispensers and
restarts). A pass admits candidate calls one at a time, each from the competing key set served
least so far (ties by key set), and adds the call's units to it. A key set that starts competing,
or comes back after ``STALE_AFTER`` without a claim, starts level with the least served key set
that kept competing: it gets its share from then on, never a catch-up burst, and owes nothing
for the time it did not compete.

A call that does not fit the room left on a key holds that key for its key set: no key set whose
turn is past its own is admitted on that key for the rest of the pass. Cheaper calls of key sets
served more would otherwise take the room as it frees, and a costlier call would never find
enough: three units of a shared key's three per window, one of them taken each window by a key
set served less, left a key set of 3-unit calls 8 units behind one of 2-unit calls in 9 windows.

The bound: a key set with a due call whose own keys have room is admitted within (N - 1) * (c + 1)
admissions of the shared key, N the key sets competing for it and c the largest cost of their
calls (with calls of one unit, within 2(N - 1)): every other competitor is admitted only while
its turn is not past the waiting one's, and each admission moves its turn on by its units.
"""
from __future__ import annotations

import heapq
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from datetime import datetime, timedelta
from typing import TypeVar

from dispatcher import tables
from dispatcher.keys import is_pattern, pattern_matches

# A key set that has not been given a call for this long starts again level with the others.
STALE_AFTER = timedelta(minutes=5)

Candidate = TypeVar("Candidate")


def level(stored: Mapping[str, tuple[float, datetime]], key_sets: Iterable[str], now: datetime) -> dict[str, float]:
    """Return each key set's turn: its stored ``served`` if recent, else the least of the recent ones."""
    fresh = {ks: served for ks, (served, at) in stored.items() if now - at <= STALE_AFTER}
    floor = min(fresh.values(), default=0.0)
    return {ks: fresh.get(ks, floor) for ks in key_sets}


def interleave(
    candidates: Mapping[str, Sequence[Candidate]],
    served: dict[str, float],
    units: Callable[[Candidate], float],
    admit: Callable[[Candidate], Collection[str]],
    keys: Mapping[str, Collection[str]],
    held: dict[str, float] | None = None,
) -> tuple[list[Candidate], list[Candidate]]:
    """Admit candidates one at a time, each from the key set served least so far; return (kept, returned).

    Each key set's candidates are taken in their own order; ``admit`` counts one if it fits and
    returns no key, else returns the keys whose room it does not fit. One that does not fit ends
    its key set's turns, so no cheaper call of it jumps it, and holds those keys (``held``: per
    key, the least turn waiting for its room, kept by the caller across its calls of one pass):
    a key set of ``keys`` on a held key is not admitted while its turn is past the holder's.
    ``served`` moves by each admitted call's units.
    """
    held = {} if held is None else held
    turns = [(served[ks], ks) for ks, rows in candidates.items() if rows]
    heapq.heapify(turns)
    taken = dict.fromkeys(candidates, 0)
    kept: list[Candidate] = []
    returned: list[Candidate] = []
    while turns:
        turn, ks = heapq.heappop(turns)
        rows, index = candidates[ks], taken[ks]
        if any(held.get(key, turn) < turn for key in keys[ks]):
            returned.extend(rows[index:])  # a key set served less waits for room on a key of it
            continue
        short = admit(rows[index])
        if short:
            for key in short:
                held[key] = min(held.get(key, turn), turn)
            returned.extend(rows[index:])
            continue
        kept.append(rows[index])
        served[ks] = turn + units(rows[index])
        taken[ks] = index + 1
        if index + 1 < len(rows):
            heapq.heappush(turns, (served[ks], ks))
    return kept, returned


def load(key_sets: Sequence[str], now: datetime, using: str) -> tuple[dict[str, float], set[str]]:
    """Return the turn of each key set (see ``level``), and the key sets whose row a pass need not
    write unless it gives them a call (stored less than half of ``STALE_AFTER`` ago).

    No key sets (a pass whose key sets share no key): nothing to read, and no query compiled
    (the ORM spent half a millisecond of the claim's transaction building an empty one).
    """
    if not key_sets:
        return {}, set()
    rows = tables.FairShare.objects.using(using).filter(key_set__in=list(key_sets))
    stored = {ks: (served, at) for ks, served, at in rows.values_list("key_set", "served", "updated_at")}
    recent = {ks for ks, (_, at) in stored.items() if now - at < STALE_AFTER / 2}
    return level(stored, key_sets, now), recent


def weights(key_sets: Sequence[str], keys: Mapping[str, Sequence[str]], using: str) -> dict[str, int]:
    """Return each key set's weight: the largest weight among its keys (an exact key's own, else the
    most specific pattern's that matches it; 1 where none is set)."""
    set_weights: dict[str, int] = {
        key: weight
        for key, weight in tables.KeyState.objects.using(using).filter(weight__isnull=False).values_list("key", "weight")
        if weight is not None
    }
    if not set_weights:
        return dict.fromkeys(key_sets, 1)
    patterns = sorted((k for k in set_weights if is_pattern(k)), key=len, reverse=True)

    def weight_of(key: str) -> int:
        if key in set_weights and not is_pattern(key):
            return set_weights[key]
        found = next((p for p in patterns if pattern_matches(p, key)), None)
        return set_weights[found] if found is not None else 1

    return {ks: max((weight_of(key) for key in keys[ks]), default=1) for ks in key_sets}


def save(served: Mapping[str, float], now: datetime, using: str) -> None:
    """Store the turns of the key sets that competed in a pass, in one statement.

    A key set that competed without a call keeps its turn on record, so that it stays ahead of
    those that were given calls however long it waits.
    """
    if not served:
        return
    tables.FairShare.objects.using(using).bulk_create(
        [tables.FairShare(key_set=ks, served=value, updated_at=now) for ks, value in served.items()],
        update_conflicts=True, unique_fields=["key_set"], update_fields=["served", "updated_at"],
    )


def forget_stale(before: datetime, using: str) -> int:
    """Delete the turns not moved since ``before`` (a key set then starts level again anyway)."""
    deleted, _ = tables.FairShare.objects.using(using).filter(updated_at__lt=before).delete()
    return deleted
