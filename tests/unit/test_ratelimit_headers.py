"""Reading an API's rate-limit headers: pure, no database; hostile values never crash or overreach."""
from __future__ import annotations

import math

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dispatcher.ratelimit_headers import MAX_SECONDS, Signal, Window, parse, parse_reset, parse_retry_after, signal

NOW = 1_800_000_000.0


def headers(**fields: str) -> httpx.Headers:
    return httpx.Headers({k.replace("_", "-"): v for k, v in fields.items()})


def test_x_ratelimit_with_the_reset_in_seconds():
    found = parse(headers(x_ratelimit_limit="10", x_ratelimit_remaining="0", x_ratelimit_reset="2"), 200, NOW)
    assert (found.remaining, found.reset, found.windows) == (0, 2.0, (Window(10, 2.0),))
    assert found.wait() == 2.0


def test_x_ratelimit_with_the_reset_as_an_epoch_in_seconds_or_milliseconds():
    in_seconds = parse(headers(x_ratelimit_limit="10", x_ratelimit_reset=str(int(NOW) + 30)), 200, NOW)
    in_millis = parse(headers(x_ratelimit_limit="10", x_ratelimit_reset=str(int(NOW * 1000) + 30_000)), 200, NOW)
    assert in_seconds.reset == 30.0 and in_millis.reset == pytest.approx(30.0)


def test_ietf_fields_give_the_quota_window_remaining_and_reset():
    found = parse(headers(ratelimit_policy='"burst";q=100;w=60, "day";q=1000;w=86400', ratelimit='"burst";r=0;t=12'), 200, NOW)
    assert found.windows == (Window(100, 60.0), Window(1000, 86400.0))
    assert found.wait() == 12.0 and found.source == "ietf"


def test_retry_after_counts_on_429_and_503_only():
    assert parse(headers(retry_after="7"), 429, NOW).wait() == 7.0
    assert parse(headers(retry_after="7"), 503, NOW).wait() == 7.0
    assert parse(headers(retry_after="7"), 200, NOW).wait() is None


def test_retry_after_as_an_http_date():
    assert parse_retry_after("Fri, 15 Jan 2027 08:00:10 GMT", 1_800_000_000.0) is not None
    assert parse_retry_after("Thu, 01 Jan 1970 00:00:00 GMT", NOW) == 0.0


@pytest.mark.parametrize("value", ["-5", "NaN", "nan", "inf", "1e400", "9" * 400, "", " ", "abc", "1;2", "0x10", "١٢"])
def test_garbage_retry_after_is_ignored_or_bounded(value):
    seconds = parse_retry_after(value, NOW)
    assert seconds is None or 0 <= seconds <= MAX_SECONDS


def test_far_future_epochs_and_huge_values_are_cut_to_the_bound():
    assert parse_reset("99999999999999", NOW) <= MAX_SECONDS
    assert parse_retry_after("99999999", NOW) == MAX_SECONDS


def test_an_answer_without_rate_limit_headers_says_nothing():
    assert parse(headers(content_type="application/json", x_request_id="7", ratelimit_note="5"), 429, NOW) == Signal()


def test_one_rate_limit_header_among_others_is_read_whatever_its_case():
    found = parse(httpx.Headers({"Content-Type": "text/plain", "X-RateLimit-Remaining": "0", "X-RATELIMIT-RESET": "5"}), 200, NOW)
    assert found.wait() == 5.0 and found.text == "0 remaining, reset in 5s"


def test_a_handler_reports_its_own_signals():
    found = signal(limit=40, window=60, remaining=3, reset=20)
    assert found.windows == (Window(40, 60.0),) and found.remaining == 3 and "40 per 60s" in found.text
    assert signal(limit=-1, window=float("nan"), remaining=True).empty


header_values = st.one_of(
    st.text(max_size=64), st.from_regex(r"-?\d{1,30}(\.\d{0,5})?", fullmatch=True),
    st.sampled_from(["NaN", "inf", "-inf", "1e308", "0", "-0", "1,2,3", '"x";q=1;w=0', '"x";q=-1', '"a";r=;t=']),
    st.text(max_size=2000),
)
names = st.sampled_from([
    "retry-after", "x-ratelimit-limit", "x-ratelimit-remaining", "x-ratelimit-reset", "ratelimit", "ratelimit-policy",
    "ratelimit-limit", "ratelimit-remaining", "ratelimit-reset",
])


@settings(max_examples=400, deadline=None)
@given(st.lists(st.tuples(names, header_values), max_size=12), st.sampled_from([200, 429, 503]))
def test_hostile_headers_never_crash_nor_ask_beyond_the_bound(fields, status):
    raw = httpx.Headers([(name, value.encode("utf-8", "replace").decode("ascii", "replace").replace("\ufffd", "?")
                          .replace("\r", "").replace("\n", "")) for name, value in fields])
    found = parse(raw, status, NOW)
    wait = found.wait()
    assert wait is None or (math.isfinite(wait) and 0 <= wait <= MAX_SECONDS)
    for window in found.windows:
        assert window.limit >= 0 and 0 < window.seconds <= MAX_SECONDS
    assert found.remaining is None or found.remaining >= 0
