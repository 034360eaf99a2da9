"""Hostile and careless input at every entry point: refused with a clear message, nothing stored.

And rows already stored out of range (written before these bounds, or by raw SQL) never stop the
sweeps, the passes, the worker, the admin or the status API.
"""
from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta, timezone

import pytest
from django.contrib.auth.models import Permission, User
from django.core.management import CommandError, call_command
from django.db import connection
from django.test import Client

from dispatcher.exceptions import InvalidCall, InvalidKey, InvalidParams
from dispatcher.models import CallQueue, KeyState, RateLimit
from support.processes import wait_until
from tests.claims import claim

pytestmark = pytest.mark.django_db

TOKEN = "t0ken-for-hostile-tests"
FAR_PAST = "0001-01-01T00:00:00+01:00"
FAR_FUTURE = "9999-12-31T23:00:00-02:00"


@pytest.fixture(autouse=True)
def api_token(settings):
    settings.DISPATCHER_API_TOKENS = TOKEN


def post(client: Client, body: str | dict) -> object:
    data = body if isinstance(body, str) else json.dumps(body)
    return client.post("/api/calls/", data=data, content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {TOKEN}")


def nested(depth: int) -> list:
    value: list = []
    for _ in range(depth - 1):
        value = [value]
    return value


def staff(*perms: str) -> Client:
    user = User.objects.create_user("staff", password="pw", is_staff=True)
    for codename in perms:
        user.user_permissions.add(Permission.objects.get(content_type__app_label="dispatcher", codename=codename))
    client = Client(raise_request_exception=False)
    client.force_login(user)
    return client


# --- 1. moments out of range ---------------------------------------------------------------


@pytest.mark.parametrize("text", [FAR_PAST, FAR_FUTURE])
def test_send_and_send_many_refuse_a_run_at_outside_2000_to_9000(text):
    moment = datetime.fromisoformat(text)
    with pytest.raises(InvalidCall, match="between 2000-01-01 and 9000-01-01"):
        CallQueue.objects.send("noop", {}, run_at=moment)
    with pytest.raises(InvalidCall, match="call 1: run_at must be between"):
        CallQueue.objects.send_many([{"method": "noop"}, {"method": "noop", "run_at": moment}])
    assert not CallQueue.objects.exists()


@pytest.mark.parametrize("text", [FAR_PAST, FAR_FUTURE, "2030-01-01T00:00:00+23:59"])
def test_the_api_answers_400_for_a_run_at_out_of_range(client, text):
    response = post(client, {"method": "noop", "run_at": text})
    if text.startswith("2030"):  # an odd offset but an ordinary moment
        assert response.status_code == 201
        return
    assert response.status_code == 400, response.content
    assert "between 2000-01-01 and 9000-01-01" in response.json()["error"]
    assert not CallQueue.objects.exists()


def test_a_run_at_within_the_bounds_is_stored():
    call = CallQueue.objects.send("noop", {}, run_at=datetime(8999, 1, 1, tzinfo=timezone(timedelta(hours=5))))
    assert CallQueue.objects.get(id=call.id).run_at == datetime(8998, 12, 31, 19, tzinfo=UTC)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["ratelimit", "pause", "api", "--for", "99999d"], "out of range"),
        (["ratelimit", "set", "api", "--limit", "1", "--per", "99999999999999999999999d"], "out of range"),
        (["prune_calls", "--older-than", "1" * 400], "out of range"),
        (["prune_calls", "--older-than=-5s"], "not a duration"),
        (["prune_calls", "--batch", "1" + "0" * 20], "--batch must be between 1 and 1000000"),
    ],
)
def test_commands_refuse_durations_out_of_range_and_change_nothing(args, message):
    with pytest.raises(CommandError, match=message):
        call_command(*args)
    assert not RateLimit.objects.exists() and not KeyState.objects.exists()


def test_the_admin_refuses_a_period_and_a_pause_out_of_range():
    client = staff("view_ratelimit", "change_ratelimit", "add_ratelimit")
    response = client.post("/admin/dispatcher/ratelimit/add/", {"key": "api", "limit": "1", "period": "99999d"})
    assert response.status_code == 200 and "out of range" in response.content.decode()
    policy = RateLimit.objects.create(key="api", limit=1, period=timedelta(seconds=1))
    response = client.post(
        "/admin/dispatcher/ratelimit/",
        {"action": "pause", "_selected_action": [str(policy.id)], "index": 0, "duration": str(10**400)},
        follow=True,
    )
    assert response.status_code == 200 and "out of range" in response.content.decode()
    assert not KeyState.objects.filter(paused_until__isnull=False).exists()


def test_a_setting_out_of_range_is_a_system_check_error(settings):
    from django.core.checks import run_checks

    settings.DISPATCHER_RUN_TIMEOUT = timedelta(days=10**6)
    errors = [m for m in run_checks(databases=["default"]) if m.id == "dispatcher.E001"]
    assert errors and "DISPATCHER_RUN_TIMEOUT" in errors[0].msg and "out of range" in errors[0].msg


# --- 2. deep nesting ---------------------------------------------------------------------------


@pytest.mark.parametrize("depth", [950, 5_000])
def test_send_refuses_deeply_nested_params(depth):
    with pytest.raises(InvalidParams, match=r"nested too deeply \(more than 32 levels\)"):
        CallQueue.objects.send("noop", {"x": nested(depth)})
    with pytest.raises(InvalidParams, match="nested too deeply"):
        CallQueue.objects.send_many([{"method": "noop", "params": {"x": nested(depth)}}])
    assert not CallQueue.objects.exists()


def test_the_api_answers_400_for_a_100k_deep_body_and_5000_deep_params(client):
    response = post(client, "[" * 100_000 + "]" * 100_000)
    assert response.status_code == 400 and "nested too deeply" in response.json()["error"]
    response = post(client, '{"method": "noop", "params": {"x": ' + "[" * 5_000 + "]" * 5_000 + "}}")
    assert response.status_code == 400 and "nested too deeply" in response.json()["error"]
    assert not CallQueue.objects.exists()


def test_params_as_deep_as_allowed_are_stored_and_shown_in_the_admin():
    call = CallQueue.objects.send("noop", {"x": nested(31)})
    client = staff("view_callqueue")
    assert client.get("/admin/dispatcher/callqueue/").status_code == 200
    assert client.get(f"/admin/dispatcher/callqueue/{call.id}/change/").status_code == 200


def test_a_handler_result_too_deep_to_store_is_kept_as_a_short_repr():
    from dispatcher.worker import _jsonable

    kept = _jsonable(nested(5_000))
    assert set(kept) == {"repr"} and len(kept["repr"]) < 100


# --- 14. the smaller ones -----------------------------------------------------------------------


def test_the_text_backslash_u0000_is_accepted_and_only_a_real_nul_refused(client):
    call = CallQueue.objects.send("noop", {"text": "C:\\u0000"})
    assert CallQueue.objects.get(id=call.id).params == {"text": "C:\\u0000"}
    assert post(client, {"method": "noop", "params": {"text": "\\u0000"}}).status_code == 201
    with pytest.raises(InvalidParams, match="NUL"):
        CallQueue.objects.send("noop", {"text": "a\x00b"})
    assert post(client, {"method": "noop", "params": {"text": "\u0000"}}).status_code == 400
    assert CallQueue.objects.count() == 2


def test_keys_given_as_an_object_are_refused(client):
    with pytest.raises(InvalidKey, match="list of strings"):
        CallQueue.objects.send("noop", {}, keys={"a": 1})
    response = post(client, {"method": "noop", "keys": {"tenant:1": True}})
    assert response.status_code == 400 and "list of strings" in response.json()["error"]
    assert not CallQueue.objects.exists()


@pytest.mark.parametrize(
    "key",
    ["tenant:\u202eevil", "ten\u200bant", "tenant\u200d", "\ufefftenant", "a\u2028b", "a\u2029b", "a\u2066b", "a\x85b"],
)
def test_bidi_and_zero_width_characters_are_refused_in_keys(client, key):
    with pytest.raises(InvalidKey, match="format"):
        CallQueue.objects.send("noop", {}, keys=[key])
    assert post(client, {"method": "noop", "keys": [key]}).status_code == 400
    with pytest.raises(CommandError, match="format"):
        call_command("ratelimit", "set", key, "--limit", "1", "--per", "1s")
    assert not CallQueue.objects.exists() and not RateLimit.objects.exists()


def test_keys_in_other_scripts_are_fine():
    call = CallQueue.objects.send("noop", {}, keys=["tenant:東京", "tenant:שלום", "café"])
    assert call.keys == ["tenant:東京", "tenant:שלום", "café"]


@pytest.mark.parametrize("term", ["9" * 5_000, "#" + "9" * 30, "²", "#", "  "])
def test_admin_search_for_odd_terms_answers_200(term):
    CallQueue.objects.send("noop", {"n": 1})
    client = staff("view_callqueue", "view_ratelimit")
    assert client.get("/admin/dispatcher/callqueue/", {"q": term}).status_code == 200
    assert client.get("/admin/dispatcher/ratelimit/", {"q": term}).status_code == 200


@pytest.mark.parametrize("query", [{"q": "1\x00"}, {"q": "\x00"}, {"method": "\x00"}, {"key": "a\x00"}, {"status": "\x00"}])
def test_admin_lists_answer_400_for_a_nul_in_a_search_or_filter(query):
    client = staff("view_callqueue", "view_ratelimit")
    for url in ("/admin/dispatcher/callqueue/", "/admin/dispatcher/ratelimit/"):
        response = client.get(url, query)
        assert response.status_code == 400 and b"NUL" in response.content


@pytest.mark.parametrize("selected", ["9" * 30, "-1", "1e3", "x"])
def test_admin_actions_answer_400_for_selected_ids_that_are_no_row_id(selected):
    call = CallQueue.objects.send("noop", {})
    client = staff("view_callqueue", "change_callqueue", "view_ratelimit", "change_ratelimit")
    for url, action in (("/admin/dispatcher/callqueue/", "cancel"), ("/admin/dispatcher/ratelimit/", "resume")):
        response = client.post(url, {"action": action, "_selected_action": [str(call.id), selected], "index": 0})
        assert response.status_code == 400, url
    assert CallQueue.objects.get(id=call.id).status == "pending"


# --- 10. search never looks inside redacted values ------------------------------------------


def test_admin_search_cannot_recover_a_redacted_password_by_prefix():
    call = CallQueue.objects.send("noop", {"user": "ada", "password": "hunter2", "headers": {"Authorization": "Bearer s3cr3t"}})
    client = staff("view_callqueue")

    def found(term: str) -> list[int]:
        response = client.get("/admin/dispatcher/callqueue/", {"q": term})
        assert response.status_code == 200
        return [c.id for c in response.context["cl"].result_list]

    for term in ['"password": "h', '"password": "hunter2"', "hunter", "s3cr", "Bearer s"]:
        assert found(term) == [], term
    # What the admin shows can still be searched.
    assert found("ada") == [call.id]
    assert found('"user": "ada"') == [call.id]
    assert found("password") == [call.id]


# --- 1. rows already stored out of range ------------------------------------------------------


def store_out_of_range(call_id: int, **columns: str) -> None:
    sets = ", ".join(f"{name} = %s::timestamptz" for name in columns)
    with connection.cursor() as cursor:
        cursor.execute(f"UPDATE dispatcher_call SET {sets} WHERE id = %s", [*columns.values(), call_id])


BC = "0001-12-31 23:00:00+00 BC"  # what PostgreSQL stored for run_at = 0001-01-01T00:00:00+01:00
AD_10000 = "10000-01-01 01:00:00+00"  # and for 9999-12-31T23:00:00-02:00


@pytest.mark.postgres
def test_rows_stored_out_of_range_do_not_stop_rescue_dispense_admin_status_or_prune(settings):
    from dispatcher.dispenser import Dispenser

    settings.DISPATCHER_API_TOKENS = TOKEN
    future = CallQueue.objects.send("noop", {}, keys=["a"])
    store_out_of_range(future.id, run_at=AD_10000, created_at=AD_10000)
    stuck_bad = CallQueue.objects.send("noop", {}, keys=["b"])
    stuck_good = CallQueue.objects.send("noop", {}, keys=["b"])
    CallQueue.objects.filter(id__in=[stuck_bad.id, stuck_good.id]).update(status="dispatched", dispatch_no=1)
    store_out_of_range(stuck_bad.id, dispatched_at=BC, run_at=BC)
    store_out_of_range(stuck_good.id, dispatched_at="2020-01-01 00:00:00+00")
    done_bad = CallQueue.objects.send("noop", {}, keys=["c"])
    CallQueue.objects.filter(id=done_bad.id).update(status="done")
    store_out_of_range(done_bad.id, finished_at=BC, created_at=BC)

    # The rescue sweep returns both stuck calls, the bad one included.
    report = CallQueue.objects.rescue()
    assert sorted(report.ids) == sorted([stuck_bad.id, stuck_good.id])
    # A dispense pass moves the due calls, past the one due in year 10000.
    assert Dispenser().run_once().moved == 2
    # The admin list and every detail page, the status API, the command and the metrics answer.
    client = staff("view_callqueue", "view_ratelimit")
    assert client.get("/admin/dispatcher/callqueue/").status_code == 200
    for call in (future, stuck_bad, done_bad):
        assert client.get(f"/admin/dispatcher/callqueue/{call.id}/change/").status_code == 200
        status = client.get(f"/api/calls/{call.id}/", HTTP_AUTHORIZATION=f"Bearer {TOKEN}")
        assert status.status_code == 200, status.content
    assert client.get(f"/api/calls/{future.id}/", HTTP_AUTHORIZATION=f"Bearer {TOKEN}").json()["run_at"].startswith("9000-")
    assert client.get("/admin/dispatcher/dashboard/").status_code == 200
    call_command("dispatcher_status")
    assert client.get("/metrics").status_code == 200
    # Retention deletes the finished one; the ORM can delete the others.
    assert CallQueue.objects.prune(timedelta(days=1)) == 1
    CallQueue.objects.filter(id=future.id).delete()
    assert not CallQueue.objects.filter(id__in=[done_bad.id, future.id]).exists()


@pytest.mark.postgres
def test_a_value_stored_out_of_range_is_logged_once_not_at_every_read(caplog):
    from dispatcher.dispenser import Dispenser

    far = CallQueue.objects.send("noop", {}, keys=["a"])
    stored = "10002-03-04 05:06:07+00"  # a value no other test logged in this process
    store_out_of_range(far.id, run_at=stored)
    with caplog.at_level("WARNING", logger="dispatcher"):
        for _ in range(3):
            Dispenser().run_once()
            CallQueue.objects.get(id=far.id)
    logged = [r for r in caplog.records if r.getMessage().startswith("timestamp_out_of_range") and stored in r.getMessage()]
    assert len(logged) == 1


@pytest.mark.postgres
@pytest.mark.slow
def test_a_real_worker_runs_a_call_stored_in_year_1_bc_and_one_with_a_result_too_deep(procs):
    bad = CallQueue.objects.send("noop", {}, keys=["k"])
    store_out_of_range(bad.id, run_at=BC, created_at=BC)
    deep = CallQueue.objects.send("deep_result", {"depth": 5_000}, keys=["k"])
    procs.worker(procs.queue, concurrency=1)
    procs.dispenser()
    finished = wait_until(
        lambda: set(CallQueue.objects.filter(id__in=[bad.id, deep.id]).values_list("status", flat=True)) == {"done"},
        timeout=60, interval=0.3,
    )
    assert finished, procs.logs()
    assert set(CallQueue.objects.get(id=deep.id).result) == {"repr"}


@pytest.mark.parametrize("params", [{"retry_after": 1e20}, {"retry_after": float("nan")}, {"huge": True}, {"retry_after": -5}])
def test_a_retry_after_out_of_range_defers_the_call_instead_of_crashing_the_worker(params):
    from dispatcher.worker import execute

    if params.get("retry_after") != params.get("retry_after"):
        params = {"retry_after": "nan"}
    call = CallQueue.objects.send("slow_down", params)
    claimed = claim(call.key_set, 1).calls[0]
    assert execute(claimed.id, claimed.dispatch_no) == "rate_limited"
    call.refresh_from_db()
    assert call.status == "pending" and call.deferrals == 1
    paused = KeyState.objects.get(key="slow").paused_until
    assert paused is not None and paused < datetime.now(UTC) + timedelta(days=3651)


def test_a_row_stored_with_950_deep_params_does_not_break_the_admin_the_api_or_search():
    call = CallQueue.objects.send("noop", {}, keys=["k"])
    CallQueue.objects.filter(id=call.id).update(status="done")
    deep = "[" * 950 + "]" * 950
    table = CallQueue._meta.db_table
    cast = "::jsonb" if connection.vendor == "postgresql" else ""
    with connection.cursor() as cursor:
        cursor.execute(
            f"UPDATE {table} SET params = %s{cast}, result = %s{cast} WHERE id = %s", ['{"x": ' + deep + "}", deep, call.id]
        )
    client = staff("view_callqueue")
    for url, query in [
        ("/admin/dispatcher/callqueue/", {}),
        ("/admin/dispatcher/callqueue/", {"q": "x"}),
        (f"/admin/dispatcher/callqueue/{call.id}/change/", {}),
        (f"/api/calls/{call.id}/", {}),
    ]:
        response = client.get(url, query, HTTP_AUTHORIZATION=f"Bearer {TOKEN}")
        assert response.status_code == 200, url
    assert "too deeply to read" in client.get(f"/admin/dispatcher/callqueue/{call.id}/change/").content.decode()


def store_raw(call_id: int, **columns: str) -> None:
    sets = ", ".join(f"{name} = %s" + ("::jsonb" if name == "cost" else "") for name in columns)
    with connection.cursor() as cursor:
        cursor.execute(f"UPDATE dispatcher_call SET {sets} WHERE id = %s", [*columns.values(), call_id])


@pytest.mark.postgres
def test_rows_with_unreadable_keys_or_cost_are_failed_and_the_others_still_rescued_and_dispensed():
    from dispatcher.dispenser import Dispenser

    good = [CallQueue.objects.send("noop", {}, keys=[key]) for key in ("a", "b")]
    waiting_bad = {
        "{not json": CallQueue.objects.send("noop", {}, keys=["c"]),
        "[1]": CallQueue.objects.send("noop", {}, keys=["d"]),
        '{"e": 1}': CallQueue.objects.send("noop", {}, keys=["e"]),
    }
    for text, call in waiting_bad.items():
        store_raw(call.id, key_set=text)
    bad_cost = CallQueue.objects.send("noop", {}, keys=["a"], priority=9)
    store_raw(bad_cost.id, cost='"lots"')
    stuck_bad = CallQueue.objects.send("noop", {}, keys=["f"])
    stuck_good = CallQueue.objects.send("noop", {}, keys=["f"])
    CallQueue.objects.filter(id__in=[stuck_bad.id, stuck_good.id]).update(status="dispatched", dispatch_no=1)
    store_raw(stuck_bad.id, key_set="[[", dispatched_at="2020-01-01 00:00:00+00")
    store_raw(stuck_good.id, dispatched_at="2020-01-01 00:00:00+00")

    report = CallQueue.objects.rescue()
    assert report.dispatched == 1 and sorted(report.ids) == sorted([stuck_bad.id, stuck_good.id])
    # The sweep and the pass serve every good call: both waiting ones and the rescued one.
    assert Dispenser().run_once().moved == 3
    statuses = dict(CallQueue.objects.values_list("id", "status"))
    assert [statuses[c.id] for c in (*good, stuck_good)] == ["dispatched"] * 3
    for call in (*waiting_bad.values(), bad_cost, stuck_bad):
        call.refresh_from_db()
        assert call.status == "failed", call.id
        assert call.last_error.startswith("unreadable row: the stored"), call.last_error
    # A second pass finds nothing left to stop it.
    assert Dispenser().run_once().moved == 0
