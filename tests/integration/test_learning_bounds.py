"""What an API's rate-limit answers leave behind is bounded per key and never reaches another key."""
from __future__ import annotations

import random
import time
from datetime import datetime, timedelta

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dispatcher import learning, ratelimit_headers
from dispatcher.dispenser import Dispenser
from dispatcher.handlers import http
from dispatcher.limits import edit
from dispatcher.models import CallQueue, LearntLimit
from dispatcher.running import running
from support.fakeapi import answer
from tests.hostile_corpus import HEADERS
from tests.integration.test_http_hostile import Server

pytestmark = pytest.mark.django_db

BOUND = learning.MAX_LEARNT_PER_KEY


def policy_answer(rng: random.Random, members: int = 4, remaining: bool = False) -> httpx.Headers:
    """An answer announcing ``members`` policies, each with a window never seen before."""
    field = ", ".join(f'"p{i}";q=100000;w={rng.uniform(0.5, 5000):.6f}' for i in range(members))
    state = {"RateLimit": f'"p0";r={rng.randint(1, 99999)};t={rng.uniform(0.5, 50):.3f}'} if remaining else {}
    return httpx.Headers({"RateLimit-Policy": field, **state})


def teach(headers: httpx.Headers, keys: list[str]) -> None:
    with running(keys=keys):
        learning.apply(ratelimit_headers.parse(headers, 200, time.time()))


def test_ten_thousand_fresh_windows_leave_a_bounded_number_of_rows(make_call):
    rng = random.Random(24)
    edit.set_policy("other", 100, timedelta(seconds=1))
    for _ in range(10_000):
        teach(policy_answer(rng), ["flood"])
    assert LearntLimit.objects.filter(key="flood").count() <= BOUND
    # An unrelated key still dispenses, in one pass.
    other = make_call("noop", {}, keys=["other"])
    assert Dispenser().run_once().moved >= 1
    other.refresh_from_db()
    assert other.status == CallQueue.Status.DISPATCHED


def test_many_processes_each_learning_still_leave_a_bounded_number_of_rows():
    rng = random.Random(7)
    for _ in range(80):
        learning._new_lessons.clear()  # every answer read by a process that learnt nothing yet this minute
        learning._stored.clear()
        teach(policy_answer(rng, remaining=True), ["flood", "flood:tenant"])
    assert LearntLimit.objects.filter(key="flood").count() <= BOUND
    assert LearntLimit.objects.filter(key="flood:tenant").count() <= BOUND


def test_a_fresh_x_ratelimit_limit_on_every_answer_is_bounded_too():
    for n in range(500):
        learning._new_lessons.clear()
        teach(httpx.Headers({"X-RateLimit-Limit": str(1000 + n), "X-RateLimit-Remaining": "500",
                             "X-RateLimit-Reset": str(n % 60 + 1)}), ["xflood"])
    assert LearntLimit.objects.filter(key="xflood").count() <= BOUND


def test_a_key_learns_new_windows_only_a_few_times_a_minute(caplog):
    rng = random.Random(3)
    with caplog.at_level("WARNING", logger="dispatcher"):
        for _ in range(200):
            teach(policy_answer(rng, members=1), ["slow"])
    # Said once a minute, not once per answer (the test may straddle a minute).
    assert 1 <= caplog.text.count("learn_throttled") <= 2
    # Every row written is a lesson taken; the rest were dropped before any write.
    assert LearntLimit.objects.filter(key="slow").count() <= min(BOUND, learning.NEW_LESSONS_PER_MINUTE)


def test_the_same_window_repeated_is_still_learnt_and_kept():
    for _ in range(100):
        teach(httpx.Headers({"RateLimit-Policy": '"p";q=10;w=2'}), ["steady"])
    rows = list(LearntLimit.objects.filter(key="steady"))
    assert [(r.limit, r.period >= timedelta(seconds=2)) for r in rows] == [(10, True)]


def test_answers_through_the_http_handler_leave_a_bounded_number_of_rows(serve_policy):
    server = serve_policy
    for n in range(150):
        if n % 10 == 0:
            learning._new_lessons.clear()
        with running(keys=["partner"]):
            assert http(method="GET", url=f"{server.url}/")["status"] == 200
    assert LearntLimit.objects.filter(key="partner").count() <= BOUND
    assert len(server.seen) == 150


@pytest.fixture
def serve_policy():
    rng = random.Random(11)

    def respond(req) -> None:
        field = ", ".join(f'"p{i}";q=100000;w={rng.uniform(1, 3000):.5f}' for i in range(4))
        answer(req, 200, {"ok": True}, {"RateLimit-Policy": field})

    server = Server(respond)
    yield server
    server.close()


@pytest.mark.parametrize("fields", HEADERS)
def test_corpus_headers_leave_a_bounded_number_of_rows(fields):
    for _ in range(20):
        learning._new_lessons.clear()
        learning._stored.clear()
        teach(httpx.Headers(fields), ["corpus"])
    assert LearntLimit.objects.filter(key="corpus").count() <= BOUND


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.lists(st.tuples(st.integers(1, 10**9), st.floats(0.001, 10**6)), min_size=1, max_size=6),
                min_size=1, max_size=12))
def test_any_sequence_of_announced_policies_leaves_at_most_the_bound(answers):
    LearntLimit.objects.filter(key="prop").delete()
    learning._new_lessons.clear()
    learning._stored.clear()
    for members in answers:
        field = ", ".join(f'"p{i}";q={q};w={w:.6f}' for i, (q, w) in enumerate(members))
        teach(httpx.Headers({"RateLimit-Policy": field}), ["prop"])
        assert LearntLimit.objects.filter(key="prop").count() <= BOUND


def _busy_hour(starts: int, refused_at: set[int]) -> tuple[list[datetime], datetime]:
    """``starts`` starts of key "hot" over the last hour, each with its attempt (those numbered in
    ``refused_at`` refused with a 429); return the first start and the moment just after the last."""
    from dispatcher.clock import db_now
    from dispatcher.models import Attempt, KeyState, StartLog
    from dispatcher.states import AttemptOutcome

    now = db_now()
    step = timedelta(hours=1) / (starts + 1)
    calls = CallQueue.objects.bulk_create([CallQueue(method="http", params={}, key_set='["hot"]', status="done") for _ in range(starts)])
    moments = [now - timedelta(hours=1) + (i + 1) * step for i in range(starts)]
    StartLog.objects.bulk_create(
        [StartLog(key="hot", started_at=at, units=1, cum=i + 1, call_id=c.id) for i, (c, at) in enumerate(zip(calls, moments, strict=True))]
    )
    Attempt.objects.bulk_create([
        Attempt(call_id=c.id, number=1, started_at=at,
                outcome=AttemptOutcome.RATE_LIMITED if i in refused_at else AttemptOutcome.DONE)
        for i, (c, at) in enumerate(zip(calls, moments, strict=True))
    ])
    KeyState.objects.update_or_create(key="hot", defaults={"total": starts})
    return moments, now


@pytest.mark.parametrize("refused_at", [set(), {100, 1_500}], ids=["never-refused", "refused-twice"])
def test_a_retry_after_lesson_on_a_busy_key_counts_its_starts_in_the_database(refused_at):
    """A Retry-After-only 429 on a key that started 2,000 calls in the last hour: the lesson is
    the calls admitted since the last refusal, counted by the database in the same few
    statements whatever the number (the key's lock is held meanwhile; its starts were loaded
    with their attempts before, 1.5 s for 100,000)."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    moments, now = _busy_hour(2_000, refused_at)
    admitted = [at for i, at in enumerate(moments) if i > max(refused_at, default=-1)]
    with CaptureQueriesContext(connection) as statements:
        learning._infer(("hot",), now, 10.0, "")
    (lesson,) = LearntLimit.objects.filter(key="hot", source="retry-after")
    assert lesson.limit == len(admitted)
    assert lesson.period >= min(now + timedelta(seconds=10) - admitted[0], timedelta(hours=1))  # learnt windows stop at an hour
    assert len(statements) <= 20, [q["sql"][:120] for q in statements]
    assert max(len(q["sql"]) for q in statements) < 4_000, "a statement grew with the number of starts"
