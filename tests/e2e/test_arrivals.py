"""Held at the API: fake partners enforcing each policy shape on arrival answer no 429 (PostgreSQL,
several dispensers, workers that start late, default settings: the guard each key learns from its
measured start-to-send delays, never below DISPATCHER_ARRIVAL_GUARD). How much of each allowance
the calls use is a timing figure: printed here, held to its target by the benchmark
(``python -m bench --only pacing``, which runs the same partners on a machine kept busy, and
smooth rates behind a real nginx ``limit_req``)."""
from __future__ import annotations

import pytest

from support.arrivals import SHAPES, run_shapes


@pytest.mark.postgres
@pytest.mark.slow
def test_every_shape_is_kept_at_the_api(procs, fake_api):
    # A handler that keeps its connection pool, as the http handler does with a pooled client.
    check(run_shapes(procs, fake_api, method="pooled_get"))


@pytest.mark.postgres
@pytest.mark.slow
def test_the_http_handler_keeps_every_shape_at_the_api_at_default_settings(procs, fake_api):
    check(run_shapes(procs, fake_api))


def check(figures: dict[str, dict[str, float]]) -> None:
    """No partner answered 429: no window of any shape held more than its policy allows at the API.
    The share of each allowance used is printed (a smooth rate pays the whole guard on every
    request, 500 / (500 + 20 + the learnt delay): 94.0-94.7% in 12 runs on an idle machine, far less
    on a loaded one; docs/performance.md)."""
    print({name: f"{f['used']:.1%} used" for name, f in figures.items()})
    assert {name: f["refused"] for name, f in figures.items()} == dict.fromkeys(SHAPES, 0), figures


@pytest.mark.postgres
@pytest.mark.slow
def test_a_wide_guard_absorbs_the_spread_of_the_http_handler(procs, fake_api):
    figures = run_shapes(procs, fake_api, {"DISPATCHER_ARRIVAL_GUARD": "300ms"})
    assert {name: f["refused"] for name, f in figures.items()} == dict.fromkeys(SHAPES, 0), figures


@pytest.mark.postgres
@pytest.mark.slow
def test_calls_sent_several_per_message_are_kept_at_the_api(procs, fake_api):
    # Each handler thread of a message measures its own send delay for the guard, as a call alone
    # does (when they did not, the window partner refused 4 requests in 2 of 2 runs). Use is
    # printed, not asserted: with calls started 4 at a time it measured 90.7-96.8% in 4 runs,
    # the bucket lowest, too close to the 90% line of the tests above to hold under load.
    figures = run_shapes(procs, fake_api, {"DISPATCHER_CALLS_PER_MESSAGE": "4"})
    assert {name: f["refused"] for name, f in figures.items()} == dict.fromkeys(SHAPES, 0), figures
