"""The bounds of dispatcher.validation and dispatcher.durations, without a database."""
from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest

from dispatcher.durations import parse_duration, parse_positive_duration
from dispatcher.validation import MAX_JSON_DEPTH, OutOfBounds, check_json, check_moment, json_text_depth


def nested(depth: int) -> list:
    value: list = []
    for _ in range(depth - 1):
        value = [value]
    return value


def test_json_as_deep_as_the_limit_passes_and_one_deeper_is_refused():
    check_json({"a": nested(MAX_JSON_DEPTH - 1)})
    with pytest.raises(OutOfBounds, match=r"nested too deeply \(more than 32 levels\)"):
        check_json({"a": nested(MAX_JSON_DEPTH)})


@pytest.mark.parametrize("depth", [950, 5_000, 100_000])
def test_very_deep_json_is_refused_without_recursing(depth):
    with pytest.raises(OutOfBounds, match="nested too deeply"):
        check_json(nested(depth))


def test_a_cycle_is_refused_as_too_deep():
    loop: list = []
    loop.append(loop)
    with pytest.raises(OutOfBounds):
        check_json({"loop": loop})


def test_too_many_values_are_refused():
    with pytest.raises(OutOfBounds, match="more than 10 values"):
        check_json(list(range(20)), max_items=10)


def test_only_a_real_nul_is_refused_not_the_text_backslash_u0000():
    check_json({"text": "\\u0000"})
    with pytest.raises(OutOfBounds, match="NUL"):
        check_json({"text": "a\x00b"})
    with pytest.raises(OutOfBounds, match="NUL"):
        check_json({"a\x00": 1})


@pytest.mark.parametrize(
    ("text", "depth"),
    [("{}", 1), ('{"a": [1, {"b": []}]}', 4), ('["[[[", "\\"[["]', 1), ("1", 0), ("[" * 100_000, MAX_JSON_DEPTH + 1)],
)
def test_json_text_depth_counts_brackets_outside_strings(text, depth):
    assert json_text_depth(text) == depth


@pytest.mark.parametrize(
    "moment",
    [
        datetime.fromisoformat("0001-01-01T00:00:00+01:00"),
        datetime.fromisoformat("9999-12-31T23:00:00-02:00"),
        datetime(1999, 12, 31, 23, 59, tzinfo=UTC),
        datetime(9000, 1, 1, tzinfo=UTC),
        datetime.max.replace(tzinfo=timezone(timedelta(hours=-23))),
    ],
)
def test_moments_outside_2000_to_9000_are_refused(moment):
    with pytest.raises(OutOfBounds, match="between 2000-01-01 and 9000-01-01"):
        check_moment(moment)


def test_moments_inside_the_bounds_pass():
    assert check_moment(datetime(2000, 1, 1, 5, tzinfo=timezone(timedelta(hours=5)))) == datetime(2000, 1, 1, tzinfo=UTC)
    check_moment(datetime(8999, 12, 31, 23, 59, tzinfo=UTC))


@pytest.mark.parametrize(
    "value", [timedelta(days=10**6), timedelta.max, timedelta(seconds=-1), -5, 10**400, "1" * 400, "3651d", "-1s"]
)
def test_durations_out_of_range_are_refused_with_a_short_message(value):
    with pytest.raises(ValueError, match="duration") as refused:
        parse_duration(value)
    assert len(str(refused.value)) < 150


def test_the_longest_duration_is_ten_years():
    assert parse_duration("3650d") == timedelta(days=3650)
    assert parse_positive_duration(timedelta(hours=1)) == timedelta(hours=1)
