"""Fair turns of key sets that compete for a shared key's room (dispatcher.calls.shares), pure."""
from __future__ import annotations

from datetime import UTC, datetime, timedelta

from hypothesis import given, settings
from hypothesis import strategies as st

from dispatcher.calls.shares import STALE_AFTER, interleave, level

NOW = datetime(2030, 1, 1, tzinfo=UTC)


def _admit_within(room: dict[str, int]):
    def admit(call: tuple[str, int]) -> list[str]:
        tenant, units = call
        short = [key for key in ("shared", tenant) if units > room[key]]
        if not short:
            room["shared"] -= units
            room[tenant] -= units
        return short

    return admit


def _interleave(candidates, served, units, room):
    """interleave() over tenants that each have a key of their own and all share ``shared``."""
    keys = {tenant: ("shared", tenant) for tenant in candidates}
    return interleave(candidates, served, units, _admit_within(room), keys)


def test_tenants_that_sent_first_do_not_take_the_shared_room_of_the_others():
    # Eight tenants, each with room for 2 on its own key, sharing a key with room for 8.
    candidates = {f"t{i}": [(f"t{i}", 1), (f"t{i}", 1)] for i in range(8)}
    room = {"shared": 8, **{t: 2 for t in candidates}}
    served = dict.fromkeys(candidates, 0.0)
    kept, returned = _interleave(candidates, served, lambda call: call[1], room)
    assert sorted(tenant for tenant, _ in kept) == sorted(candidates)
    assert len(returned) == 8


def test_the_least_served_key_set_goes_first_whatever_its_name():
    candidates = {"a": [("a", 1)] * 3, "b": [("b", 1)] * 3}
    room = {"shared": 3, "a": 3, "b": 3}
    served = {"a": 10.0, "b": 8.0}
    kept, _ = _interleave(candidates, served, lambda call: call[1], room)
    assert [tenant for tenant, _ in kept] == ["b", "b", "a"]
    assert served == {"a": 11.0, "b": 10.0}


def test_calls_of_different_costs_share_by_units():
    candidates = {"big": [("big", 4)] * 5, "small": [("small", 1)] * 20}
    room = {"shared": 20, "big": 20, "small": 20}
    served = {"big": 0.0, "small": 0.0}
    kept, _ = _interleave(candidates, served, lambda call: call[1], room)
    units = {t: sum(u for tenant, u in kept if tenant == t) for t in candidates}
    assert abs(units["big"] - units["small"]) <= 4


def test_a_call_that_does_not_fit_ends_its_key_sets_turns_and_no_cheaper_call_jumps_it():
    candidates = {"a": [("a", 5), ("a", 1)], "b": [("b", 1)]}
    room = {"shared": 3, "a": 10, "b": 10}
    kept, returned = _interleave(candidates, {"a": 0.0, "b": 0.0}, lambda call: call[1], room)
    assert kept == [("b", 1)]
    assert returned == [("a", 5), ("a", 1)]


def test_a_costly_call_that_does_not_fit_holds_the_shared_room_from_key_sets_served_more():
    # Hypothesis found it: a shared key of 3 per window; t0 sends 1-unit calls (room 1 of its own),
    # t1 3-unit calls, t2 2-unit calls. Each window t0, served least, took one unit; t1's call did
    # not fit the two left, and t2, served more than t1, took them: after 9 windows t1 had 6
    # units and t2 14. Now t2 waits while t1, served less, waits for the room.
    cost = {"t0": 1, "t1": 3, "t2": 2}
    backlog = {"t0": 7, "t1": 3, "t2": 8}
    served = dict.fromkeys(cost, 0.0)
    given = dict.fromkeys(cost, 0)
    for _ in range(9):
        room = {"shared": 3, "t0": 1, "t1": 3, "t2": 3}
        candidates = {t: [(t, cost[t])] * min(backlog[t], room[t] // cost[t]) for t in cost if backlog[t]}
        kept, _ = _interleave(candidates, served, lambda call: call[1], room)
        for tenant, units in kept:
            backlog[tenant] -= 1
            given[tenant] += units
    assert backlog["t1"] and backlog["t2"]  # both still waiting
    assert abs(given["t1"] - given["t2"]) <= 3, given


def test_a_call_that_does_not_fit_its_own_key_holds_no_other_key_set():
    candidates = {"a": [("a", 3)], "b": [("b", 2)]}
    room = {"shared": 5, "a": 2, "b": 5}  # a's own key has 2 left: its 3-unit call waits for it
    kept, returned = _interleave(candidates, {"a": 0.0, "b": 1.0}, lambda call: call[1], room)
    assert kept == [("b", 2)] and returned == [("a", 3)]


def test_a_key_set_that_comes_back_starts_level_with_the_least_served_one_that_kept_competing():
    stored = {
        "busy": (500.0, NOW - timedelta(seconds=10)),
        "steady": (480.0, NOW - timedelta(seconds=5)),
        "back": (3.0, NOW - STALE_AFTER - timedelta(seconds=1)),
    }
    turns = level(stored, ["busy", "steady", "back", "new"], NOW)
    assert turns == {"busy": 500.0, "steady": 480.0, "back": 480.0, "new": 480.0}


@settings(max_examples=200, deadline=None)
@given(
    tenants=st.lists(
        st.tuples(st.integers(1, 4), st.integers(0, 40), st.integers(1, 3)), min_size=2, max_size=12
    ),
    shared_room=st.integers(1, 12),
    windows=st.integers(5, 30),
)
def test_shared_room_is_split_fairly_window_after_window(tenants, shared_room, windows):
    """Every window the shared key refills to ``shared_room`` and each tenant's own key to its room;
    each tenant has a backlog of calls of one cost. No window admits more than any room; a tenant
    with backlog and room of its own is never passed over for longer than the bound; and the units
    given to tenants that stay backlogged differ by at most one call."""
    own_room = {f"t{i}": room for i, (room, _, _) in enumerate(tenants)}
    backlog = {f"t{i}": n for i, (_, n, _) in enumerate(tenants)}
    # A cost that can never fit a room is refused at send(): every call here fits both rooms.
    cost = {f"t{i}": min(c, room, shared_room) for i, (room, _, c) in enumerate(tenants)}
    served = dict.fromkeys(own_room, 0.0)
    given = dict.fromkeys(own_room, 0)
    passed_over = dict.fromkeys(own_room, 0)
    for _ in range(windows):
        room = {"shared": shared_room, **own_room}
        candidates = {
            t: [(t, cost[t])] * min(backlog[t], own_room[t] // cost[t])
            for t in own_room if backlog[t] and own_room[t] >= cost[t]
        }
        kept, _ = _interleave(candidates, served, lambda call: call[1], room)
        assert room["shared"] >= 0 and all(room[t] >= 0 for t in own_room)
        for tenant, units in kept:
            backlog[tenant] -= 1
            given[tenant] += units
        for t in candidates:
            passed_over[t] = 0 if any(tenant == t for tenant, _ in kept) else passed_over[t] + 1
            # The bound of dispatcher.calls.shares: every window admits at least one call, and a
            # waiting tenant is admitted within (N - 1) * (c + 1) admissions of the shared key.
            assert passed_over[t] <= (len(own_room) - 1) * (max(cost.values()) + 1), (t, passed_over)
    still_waiting = [t for t in own_room if backlog[t] > 0 and own_room[t] >= cost[t]]
    if len(still_waiting) >= 2 and all(own_room[t] >= shared_room for t in still_waiting):
        spread = max(given[t] for t in still_waiting) - min(given[t] for t in still_waiting)
        assert spread <= max(cost[t] for t in still_waiting)


@settings(max_examples=100, deadline=None)
@given(weights=st.lists(st.integers(1, 4), min_size=2, max_size=6), shared_room=st.integers(1, 10))
def test_backlogged_key_sets_share_by_weight(weights, shared_room):
    """Over many windows, each always-backlogged key set's units converge to its weight's share."""
    tenants = {f"t{i}": w for i, w in enumerate(weights)}
    served = dict.fromkeys(tenants, 0.0)
    given = dict.fromkeys(tenants, 0)
    windows = 40 * sum(weights)
    for _ in range(windows):
        room = {"shared": shared_room, **dict.fromkeys(tenants, shared_room)}
        candidates = {t: [(t, 1)] * shared_room for t in tenants}
        kept, _ = _interleave(candidates, served, lambda call: call[1] / tenants[call[0]], room)
        for tenant, units in kept:
            given[tenant] += units
    total, weight_sum = sum(given.values()), sum(weights)
    for tenant, weight in tenants.items():
        # Within one call per key set of the exact share.
        assert abs(given[tenant] - total * weight / weight_sum) <= len(tenants), (given, tenants)
