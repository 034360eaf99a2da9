"""The failures view: failed and retrying calls grouped by key set and error class, and a group's bulk
retry or cancel, each behind a page that says what will happen to how many calls."""
from __future__ import annotations

from datetime import datetime
from typing import Any
from urllib.parse import urlencode

from django.contrib import messages
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse, HttpResponseBadRequest, HttpResponseRedirect, QueryDict
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils.translation import ngettext

from dispatcher import failures
from dispatcher.admin.common import ModelAdmin, _log_change
from dispatcher.clock import db_now
from dispatcher.durations import format_moment, humanize
from dispatcher.keys import parse_key_set
from dispatcher.models import CallQueue
from dispatcher.redact import redact_text

LIST_PARAMS = {"key", "state", "p"}
GROUP_PARAMS = {"key_set", "state", "class", "do"}
ACTIONS = {"retry": "Retry", "cancel": "Cancel"}
# Longest query value taken: a key set of the longest keys, a class, a key; longer is no group of ours.
MAX_VALUE = 4000
# Ids per statement of a bulk action: the manager's retry and cancel take a list of ids.
CHUNK = 1000


def _refusal(params: QueryDict, allowed: set[str]) -> str:
    """Return why a query string or form is refused ("" if it is fine): unknown names, repeats, NULs, length."""
    if any("\x00" in name or any("\x00" in value for value in values) for name, values in params.lists()):
        return "A query or form value holds a NUL character."
    for name, values in params.lists():
        if name == "csrfmiddlewaretoken":
            continue
        if name not in allowed:
            return f"Unknown parameter {name!r}; this page takes {', '.join(sorted(allowed))}."
        if len(values) > 1:
            return f"Parameter {name!r} is given more than once."
        if len(values[0]) > MAX_VALUE:
            return f"Parameter {name!r} is too long."
    state = params.get("state", "")
    if state not in ("", *failures.STATES):
        return f"state is one of {', '.join(failures.STATES)}."
    return ""


def _seen(moment: datetime | None, now: datetime) -> dict[str, str]:
    """A moment as the list shows it: relative, the full moment on hover."""
    return {"short": humanize(moment, now), "full": format_moment(moment, now)} if moment else {"short": "-", "full": ""}


def _bad(text: str) -> HttpResponse:
    return HttpResponseBadRequest(text, content_type="text/plain")


class FailuresViews:
    """The views, served under the calls' admin (``CallQueueAdmin.get_urls``) with its permissions."""

    def __init__(self, model_admin: ModelAdmin):
        self.model_admin = model_admin

    def urls(self) -> list[URLPattern]:
        site = self.model_admin.admin_site
        return [
            path("failures/", site.admin_view(self.list_view), name="dispatcher_callqueue_failures"),
            path("failures/group/", site.admin_view(self.group_view), name="dispatcher_callqueue_failures_group"),
        ]

    def _context(self, request: HttpRequest, title: str) -> dict[str, Any]:
        opts = CallQueue._meta
        return {**self.model_admin.admin_site.each_context(request), "title": title, "opts": opts,
                "app_label": opts.app_label, "calls_url": reverse("admin:dispatcher_callqueue_changelist"),
                "failures_url": reverse("admin:dispatcher_callqueue_failures")}

    def list_view(self, request: HttpRequest) -> HttpResponse:
        """List the groups, largest first, a page at a time."""
        if not self.model_admin.has_view_permission(request):
            raise PermissionDenied
        refused = _refusal(request.GET, LIST_PARAMS)
        number = request.GET.get("p", "1")
        if not refused and not (number.isascii() and number.isdigit() and 1 <= int(number[:6]) <= failures.MAX_PAGE):
            refused = f"p is a page number from 1 to {failures.MAX_PAGE}."
        if refused:
            return _bad(refused)
        key, state, page_no = request.GET.get("key", "").strip(), request.GET.get("state", ""), int(number)
        page = failures.groups(key, state, page_no)
        now = db_now()
        can_change = self.model_admin.has_change_permission(request)
        rows = []
        for group in page.groups:
            query = {"key_set": group.key_set, "state": group.state, "class": group.error_class}
            # A class is an exception's name or a fixed label; one that redaction would change is
            # shown redacted and offers no action (its text would ride in the links).
            shown_class = redact_text(group.error_class)
            actable = can_change and shown_class == group.error_class
            group_url = reverse("admin:dispatcher_callqueue_failures_group")
            rows.append({
                "group": group,
                "first_seen": _seen(group.first_seen, now), "last_seen": _seen(group.last_seen, now),
                "example_url": reverse("admin:dispatcher_callqueue_change", args=[group.example]),
                "error_class": shown_class,
                "retry_url": f"{group_url}?{urlencode({**query, 'do': 'retry'})}" if actable else "",
                "cancel_url": f"{group_url}?{urlencode({**query, 'do': 'cancel'})}" if actable and group.state == failures.RETRYING else "",
            })
        filters = {k: v for k, v in (("key", key), ("state", state)) if v}
        pages = {
            "previous": f"?{urlencode({**filters, 'p': page_no - 1})}" if page_no > 1 else "",
            "next": f"?{urlencode({**filters, 'p': page_no + 1})}" if page_no < page.pages else "",
        }
        context = {**self._context(request, "Failures"), "rows": rows, "page": page, "key": key, "state": state,
                   "states": failures.STATES, "can_change": can_change, "pages": pages}
        return TemplateResponse(request, "admin/dispatcher/callqueue/failures.html", context)

    def group_view(self, request: HttpRequest) -> HttpResponse:
        """GET: say what a bulk retry or cancel of one group will do and to how many calls; POST: do it."""
        if not self.model_admin.has_change_permission(request):
            raise PermissionDenied
        params = request.POST if request.method == "POST" else request.GET
        refused = _refusal(params, GROUP_PARAMS)
        key_set, state, error, action = (params.get(n, "") for n in ("key_set", "state", "class", "do"))
        if not refused and (not key_set or not state or action not in ACTIONS):
            refused = "Name a group (key_set, state, class) and what to do (do=retry or do=cancel)."
        if not refused and action == "cancel" and state != failures.RETRYING:
            refused = "Only waiting calls can be cancelled: a failed call has already stopped."
        if refused:
            return _bad(refused)
        calls = failures.group_calls(key_set, state, error)
        if request.method == "POST":
            return self._act(request, action, failures.group_ids(key_set, state, error))
        count = calls.count()
        shown = min(count, failures.BULK_MAX)
        if action == "retry":
            effect = ("each gets one more attempt, due now." if state == failures.FAILED
                      else "each is made due now, without waiting for its retry's delay.")
            effect += " Their keys' limits and pauses still apply."
        else:
            effect = "each is cancelled and will not run; a call already dispatched or running is left alone."
        example = calls.order_by("-id").values_list("id", flat=True).first()
        verb = ACTIONS[action]
        title = f"{verb} {ngettext('%d call', '%d calls', shown) % shown}?" if count else f"{verb}: no call left in this group"
        context = {
            **self._context(request, title), "count": count, "shown": shown, "more": count - shown, "effect": effect,
            "verb": verb, "action": action, "key_set": key_set, "keys": ", ".join(parse_key_set(key_set)) or key_set,
            "state": state, "state_label": failures.STATES[state], "error_class": error,
            "example_url": reverse("admin:dispatcher_callqueue_change", args=[example]) if example else "",
        }
        return TemplateResponse(request, "admin/dispatcher/callqueue/failures_confirm.html", context)

    def _act(self, request: HttpRequest, action: str, ids: list[int]) -> HttpResponse:
        done = 0
        for start in range(0, len(ids), CHUNK):
            chunk = ids[start : start + CHUNK]
            if action == "retry":
                changed = CallQueue.objects.retry_now(chunk)
            else:
                changed = CallQueue.objects.cancel(chunk)
            done += changed
            if changed:
                now_in = CallQueue.Status.PENDING if action == "retry" else CallQueue.Status.CANCELLED
                _log_change(request, CallQueue.objects.filter(id__in=chunk, status=now_in), f"{ACTIONS[action]} (failures view)")
        if action == "retry":
            text = ngettext("%d call is due now.", "%d calls are due now.", done) % done
        else:
            text = ngettext("%d call cancelled.", "%d calls cancelled.", done) % done
        self.model_admin.message_user(request, text, messages.SUCCESS if done else messages.WARNING)
        return HttpResponseRedirect(reverse("admin:dispatcher_callqueue_failures"))
