"""A call's cost in units per key: checked at send(), reported by a handler after it ran."""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from dispatcher.exceptions import InvalidCost
from dispatcher.running import here

MAX_UNITS = 2**31 - 1


def _units(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidCost(f"{what} must be a whole number of units, not {value!r}")
    if not 1 <= value <= MAX_UNITS:
        raise InvalidCost(f"{what} must be between 1 and {MAX_UNITS} units, not {value}")
    return int(value)


def clean_cost(
    cost: Any, keys: Sequence[str], params: Mapping[str, Any], computed: Callable[[dict[str, Any]], Any] | None
) -> dict[str, int] | None:
    """Return the units per key of a call ({key: units}, None when every key costs 1); raise InvalidCost if bad.

    ``cost`` is an int charged to every key or a dict naming some of the call's keys (the
    others cost 1); without it, the handler's ``cost`` callable decides from the params.
    """
    if cost is None and computed is not None:
        try:
            cost = computed(dict(params))
        except InvalidCost:
            raise
        except Exception as exc:  # the handler's cost function must not store a bad call either
            raise InvalidCost(f"the handler's cost function failed: {type(exc).__name__}: {exc}") from exc
    if cost is None:
        return None
    if isinstance(cost, Mapping):
        unknown = sorted(str(k) for k in cost if k not in keys)
        if unknown:
            raise InvalidCost(f"cost names key(s) the call does not have: {', '.join(unknown)}; its keys: {list(keys)}")
        units = {key: _units(cost[key], f"cost of key {key!r}") if key in cost else 1 for key in keys}
    else:
        units = {key: _units(cost, "cost") for key in keys}
        if not keys:
            _units(cost, "cost")
    return units if any(u != 1 for u in units.values()) else None


def report_cost(units: int | Mapping[str, int]) -> None:
    """Tell the dispatcher what the running call really cost (an int for every key, or {key: units}).

    Called from a handler while it runs (for example with the tokens an API says it used);
    once the call is recorded, its keys' usage is corrected to this figure. Zero is allowed.
    """
    if isinstance(units, Mapping):
        for key, value in units.items():
            _reported_units(value, f"reported cost of {key!r}")
        here().reported = dict(units)
    else:
        _reported_units(units, "reported cost")
        here().reported = units


def _reported_units(value: Any, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_UNITS:
        raise InvalidCost(f"{what} must be a whole number between 0 and {MAX_UNITS}, not {value!r}")


def bounded_charge(delta: int, capacity: int) -> int:
    """Return the units a cost correction may charge a token bucket: a refund whole, an extra charge at most its capacity.

    A reported cost can be anything up to MAX_UNITS; charged whole, ``report_cost(2**31-1)`` on a
    2-per-second bucket owed tokens until 2062 (and a 3650-day period overflowed the datetime).
    No call of more than the bucket's capacity could ever have started, so no correction charges
    more: the bucket owes at most one full refill.
    """
    return delta if delta <= 0 else min(delta, max(capacity, 1))


class Reported(NamedTuple):
    """The cost a handler reported, and whether its request went out later than its start was
    counted under (its windows count it from its send too: ``finish.correct_cost``)."""

    units: int | Mapping[str, int]
    late: bool


def take_reported() -> Reported | None:
    """Return the cost the handler reported for the call that just ran (None if none), and forget
    it; before its send is forgotten (``arrivals.sent_after``), which says whether it was late."""
    run = here()
    value, run.reported = run.reported, None
    return None if value is None else Reported(value, run.counted_again or run.kept_late)
