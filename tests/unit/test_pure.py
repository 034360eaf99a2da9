"""Pure logic, tested without a database: durations, keys, backoff, policy resolution."""
from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from dispatcher.durations import format_duration, parse_duration, parse_positive_duration
from dispatcher.exceptions import InvalidKey
from dispatcher.keys import format_key, key_set, resolve_keys, validate_policy_key
from dispatcher.limits.catalog import Policies, Policy
from dispatcher.limits.gate import Verdict, combine
from dispatcher.retry import RetryPolicy


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("500ms", 0.5), ("2s", 2), ("5m", 300), ("1h", 3600), ("1d", 86400), ("1h30m", 5400), ("90", 90), (" 2S ", 2)],
)
def test_parse_duration_reads_the_documented_units(text, seconds):
    assert parse_duration(text) == timedelta(seconds=seconds)


@pytest.mark.parametrize("text", ["", "abc", "5x", "m5", "1h 30", "-1s", "1e9s", "nan", "5m5"])
def test_parse_duration_refuses_malformed_text_with_a_hint(text):
    with pytest.raises(ValueError, match="duration"):
        parse_duration(text)


def test_positive_duration_refuses_zero():
    with pytest.raises(ValueError, match="greater than zero"):
        parse_positive_duration("0s")


def test_format_duration_is_compact():
    assert format_duration(timedelta(seconds=0.5)) == "500ms"
    assert format_duration(timedelta(seconds=90)) == "1m30s"
    assert format_duration(timedelta(hours=2)) == "2h"


def test_key_templates_are_filled_from_params():
    assert format_key("mailgun:{account_id}", {"account_id": 42}) == "mailgun:42"


def test_key_template_missing_param_is_a_clear_error():
    with pytest.raises(InvalidKey, match="needs param 'account_id'"):
        format_key("mailgun:{account_id}", {})


def test_key_template_cannot_reach_into_attributes():
    with pytest.raises(InvalidKey):
        format_key("x:{account.__class__}", {"account": 1})


def test_keys_from_handler_and_send_are_united_without_duplicates():
    assert resolve_keys(["a", "a:{n}"], ["a", "extra"], {"n": 1}) == ["a", "a:1", "extra"]


@pytest.mark.parametrize("bad", ["", " a", "a*", "x\n", 5, "k" * 201, "lone\ud800"])
def test_bad_call_keys_are_refused(bad):
    with pytest.raises(InvalidKey):
        resolve_keys([], [bad], {})


def test_a_single_string_is_not_a_list_of_keys():
    with pytest.raises(InvalidKey, match="list"):
        resolve_keys([], "mailgun", {})


def test_key_set_is_canonical():
    assert key_set(["b", "a", "b"]) == key_set(["a", "b"]) == '["a","b"]'


def test_policy_keys_allow_a_trailing_star_only():
    assert validate_policy_key("mailgun:*") == "mailgun:*"
    with pytest.raises(ValueError, match="end a pattern"):
        validate_policy_key("mail*gun")


def test_backoff_doubles_and_is_capped():
    policy = RetryPolicy(base=timedelta(seconds=1), max=timedelta(seconds=10), jitter=0.5)
    assert policy.delay(1, rand=0) == timedelta(seconds=1)
    assert policy.delay(3, rand=0) == timedelta(seconds=4)
    assert policy.delay(3, rand=1) == timedelta(seconds=6)
    assert policy.delay(50, rand=0) == timedelta(seconds=10)


def test_exact_policy_overrides_pattern_and_longest_pattern_wins():
    second = timedelta(seconds=1)
    policies = Policies.from_rows(
        [
            Policy("mailgun:*", 5, second),
            Policy("mailgun:vip:*", 50, second),
            Policy("mailgun:7", 1, second),
            Policy("*", 1000, second),
        ]
    )
    assert [p.limit for p in policies.for_key("mailgun:3")] == [5]
    assert [p.limit for p in policies.for_key("mailgun:vip:3")] == [50]
    assert [p.limit for p in policies.for_key("mailgun:7")] == [1]
    assert [p.limit for p in policies.for_key("other")] == [1000]


def test_pattern_pause_applies_to_matching_keys():
    until = datetime(2030, 1, 1, tzinfo=UTC)
    policies = Policies.from_rows([], {"mailgun:*": until})
    assert policies.pattern_pause("mailgun:3") == until
    assert policies.pattern_pause("stripe") is None


def test_combined_verdict_is_the_tightest():
    t1 = datetime(2030, 1, 1, tzinfo=UTC)
    t2 = t1 + timedelta(seconds=5)
    assert combine([Verdict(3), Verdict(1)]).room == 1
    blocked = combine([Verdict(2), Verdict(0, t1, "a"), Verdict(0, t2, "b")])
    assert (blocked.room, blocked.until, blocked.reason) == (0, t2, "b")


def test_max_in_window_counts_a_closed_interval():
    from support.windows import max_in_window

    assert max_in_window([0.0, 0.5, 1.0, 2.5], 1.0) == 3
    assert max_in_window([0.0, 1.01, 2.02], 1.0) == 1
    assert max_in_window([], 1.0) == 0
