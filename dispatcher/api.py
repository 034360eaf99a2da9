"""A JSON API for services that are not Django: enqueue a call, read its status by id.

Authentication, either of:

- ``Authorization: Bearer <token>`` with a token listed in ``DISPATCHER_API_TOKENS``
  (comma-separated in the environment). No cookie is involved, so no CSRF check is needed;
  a token may enqueue and read any call.
- A Django session of an active staff user: enqueueing needs the ``dispatcher.add_callqueue``
  permission and passes Django's CSRF check (the ``X-CSRFToken`` header), exactly like a form;
  reading needs ``dispatcher.view_callqueue``.

Input is validated by ``CallQueue.objects.send`` itself, so the API accepts exactly what
``send()`` accepts; a refused call answers 400 with the reason and stores nothing.
"""
from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from django.db import transaction
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.middleware.csrf import CsrfViewMiddleware
from django.utils.dateparse import parse_datetime
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_GET, require_POST

from dispatcher.auth import bearer_token_ok
from dispatcher.conf import dispatcher_settings
from dispatcher.exceptions import InvalidCall
from dispatcher.models import CallQueue
from dispatcher.redact import redact, redact_text
from dispatcher.validation import MAX_JSON_DEPTH, json_text_depth
from dispatcher.waits import explain_call

MAX_BODY_BYTES = 1024 * 1024
SEND_FIELDS = {"method", "params", "keys", "priority", "run_at", "max_attempts", "queue"}
# Send once: a duplicate answers 200 with the call that holds the key, a stored call 201.
SEND_FIELDS |= {"unique_key", "unique_for", "on_duplicate"}


def _error(status: int, message: str, **extra: Any) -> JsonResponse:
    return JsonResponse({"error": message, **extra}, status=status)


def _never_called(request: HttpRequest) -> HttpResponse:
    """Stand for the view in Django's CSRF check, which reads only its csrf_exempt flag."""
    raise AssertionError("the CSRF check does not call the view")


def _authorise(request: HttpRequest, permission: str) -> JsonResponse | None:
    """Return an error response unless the request may use the API with this permission."""
    token = bearer_token_ok(request, dispatcher_settings.API_TOKENS)
    if token is True:
        return None
    if token is False:
        return _error(401, "invalid API token")
    user = request.user
    if not user.is_authenticated:
        return _error(401, "authentication required: send 'Authorization: Bearer <token>' or log in as staff")
    if not (user.is_active and user.is_staff and user.has_perm(permission)):
        return _error(403, f"permission {permission} required")
    if request.method == "POST":
        # A session is a cookie the browser sends by itself: apply Django's CSRF check.
        rejected = CsrfViewMiddleware(_never_called).process_view(request, _never_called, (), {})
        if rejected is not None:
            return _error(403, "CSRF check failed: send the X-CSRFToken header with the csrftoken cookie's value")
    return None


def _parse_run_at(value: Any) -> Any:
    if value is None or isinstance(value, datetime):
        return value
    if not isinstance(value, str):
        raise InvalidCall(f"run_at must be an ISO 8601 date-time string, not {type(value).__name__}")
    parsed = parse_datetime(value)
    if parsed is None:
        raise InvalidCall(f"run_at is not an ISO 8601 date-time: {value!r}")
    return parsed


def call_data(call: Any) -> dict[str, Any]:
    """Return what the API shows of a call."""
    data: dict[str, Any] = {
        "id": call.id,
        "method": call.method,
        "status": call.status,
        "state": call.get_status_display(),  # the word every screen uses ("Waiting" for "pending")
        "keys": call.keys,
        "attempts": call.attempts,
        "max_attempts": call.max_attempts,
        "deferrals": call.deferrals,
        "run_at": call.run_at.isoformat() if call.run_at else None,
        "created_at": call.created_at.isoformat() if call.created_at else None,
        "finished_at": call.finished_at.isoformat() if call.finished_at else None,
        "result": redact(call.result),
        "last_error": redact_text(call.last_error),
    }
    if call.status == CallQueue.Status.PENDING:
        explanation = explain_call(call)
        data["waiting"] = {
            "reasons": [{"kind": r.kind, "key": r.key or None, "text": r.text} for r in explanation.reasons],
            "until": explanation.until.isoformat() if explanation.until else None,
            # When it will start: "at" exactly, or not before it when "exact" is false.
            "expected": {
                "at": explanation.expected.at.isoformat(), "exact": explanation.expected.exact,
                "key": explanation.expected.key or None, "ahead": explanation.expected.ahead,
            } if explanation.expected is not None else None,
            "stalled": explanation.stalled or None,
        }
    return data


@csrf_exempt  # session requests are CSRF-checked in _authorise; token requests carry no cookie
@require_POST
def enqueue(request: HttpRequest) -> JsonResponse:
    """Store one call from a JSON body of send()'s arguments; answer 201 with its id (200: a unique key's holder)."""
    denied = _authorise(request, "dispatcher.add_callqueue")
    if denied is not None:
        return denied
    if request.content_type != "application/json":
        return _error(415, "send a JSON body with Content-Type: application/json")
    if len(request.body) > MAX_BODY_BYTES:
        return _error(413, f"body larger than {MAX_BODY_BYTES} bytes")
    # Python's JSON parser recurses once per level: measure the nesting before parsing.
    if json_text_depth(request.body, limit=MAX_JSON_DEPTH + 1) > MAX_JSON_DEPTH + 1:
        return _error(400, f"body is nested too deeply (more than {MAX_JSON_DEPTH + 1} levels)")
    try:
        body = json.loads(request.body)
    except (ValueError, UnicodeDecodeError) as exc:
        return _error(400, f"body is not valid JSON: {exc}")
    if not isinstance(body, dict):
        return _error(400, "body must be a JSON object of send() arguments")
    unknown = set(body) - SEND_FIELDS
    if unknown:
        return _error(400, f"unknown field(s): {', '.join(sorted(unknown))}", allowed=sorted(SEND_FIELDS))
    if not isinstance(body.get("method"), str):
        return _error(400, "'method' is required and must be a string")
    arguments = {k: v for k, v in body.items() if k != "method"}
    try:
        arguments["run_at"] = _parse_run_at(arguments.get("run_at"))
        with transaction.atomic():
            call = CallQueue.objects.send(body["method"], **arguments)
    except (InvalidCall, ValueError, TypeError) as exc:
        return _error(400, str(exc), kind=type(exc).__name__)
    return JsonResponse(
        {"id": call.id, "status": call.status, "keys": call.keys, "created": call.created},
        status=201 if call.created else 200,
    )


@require_GET
def call_status(request: HttpRequest, call_id: int) -> JsonResponse:
    """Return a call's status, attempts and result, and for a waiting call why it waits."""
    denied = _authorise(request, "dispatcher.view_callqueue")
    if denied is not None:
        return denied
    call = CallQueue.objects.filter(id=call_id).first()
    if call is None:
        return _error(404, f"no call with id {call_id}")
    return JsonResponse(call_data(call))
