"""Held at the API: fake partners enforcing each policy shape on arrival answer no 429 (PostgreSQL,
several dispensers, workers that start late, default settings: the guard each key learns from its
measured start-to-send delays, never below DISPATCHER_ARRIVAL_GUARD). How much of each allowance
the calls use is a timing figure: printed here, held to its target by the benchmark
(``python -m bench --only pacing``, which runs the same partners on a machine kept busy, and
smooth rates behind a real nginx ``limit_req``)."""
from __future__ import annotations

from datetime import timedelta

import pytest

from dispatcher import liveness
from dispatcher.limits import edit
from dispatcher.models import CallQueue
from support.arrivals import SHAPES, run_shapes
from support.fakeapi import Window
from support.processes import wait_until


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


@pytest.mark.postgres
@pytest.mark.slow
def test_a_late_request_behind_a_slow_api_keeps_the_window_at_the_api(procs, fake_api):
    """A partner allowing 5 per second on arrival, answering each request 1.5 s after it came (an
    API slower than its window), our window of 5 per second, a `-P threads` worker at default
    settings. The first call's request goes out 150 ms after its start. Its key must count that
    delay for the starts a second later, before its answer comes: kept only with its answer, the
    next five went out within a second of it and the partner refused one (the code before this
    test: a 429 in 3 of 3 runs)."""
    fake_api.shapes["win"] = Window(5, 1.0)
    fake_api.latency = (1.5, 1.5)
    edit.set_policy("win", 5, timedelta(seconds=1))
    for i in range(10):
        params = {"url": f"{fake_api.url}/win/{i}", "late": 0.15 if i == 0 else 0.0}
        CallQueue.objects.send("pooled_get", params, keys=["win"])
    # Slots for all ten: the five calls a second later start as soon as the window lets them.
    procs.worker(procs.queue, concurrency=16, pool="threads")
    assert wait_until(lambda: liveness.worker_slots() == 16, timeout=30), procs.logs()
    procs.dispenser()
    assert wait_until(lambda: CallQueue.objects.filter(status="done").count() == 10, timeout=60), procs.logs()
    assert fake_api.refused["win"] == 0, sorted(a.at for a in fake_api.arrivals)
    assert len(fake_api.answered) == 10
