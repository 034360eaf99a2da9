"""The calls' admin: the list (state and key filters, search), the call's page (why it waits, attempts), retry and cancel."""
from __future__ import annotations

import json
import threading
from collections.abc import Callable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.core.exceptions import PermissionDenied
from django.db.models import Q, QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseBadRequest, JsonResponse
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils.html import format_html, format_html_join
from django.utils.translation import ngettext

from dispatcher import status as live
from dispatcher import waits
from dispatcher.clock import db_now
from dispatcher.durations import format_duration, format_moment, humanize, humanize_duration
from dispatcher.keys import key_in_set
from dispatcher.models import CallQueue
from dispatcher.redact import redact, redact_text

if TYPE_CHECKING:
    from django.contrib.admin.options import _FieldGroups

from dispatcher.admin.common import (
    MAX_ID,
    ButtonsMixin,
    ModelAdmin,
    ReadOnlyAdminMixin,
    RefuseUnstorableMixin,
    _log_change,
    _pretty_json,
    known_keys,
)
from dispatcher.admin.failures import FailuresViews

# Search in params looks at this many of the newest calls whose stored params contain the text.
PARAMS_SEARCH_CANDIDATES = 200
# Characters of an http call's host and path shown in the list (the call's page shows its params).
TARGET_CHARS = 60
# Calls a cancel's confirmation lists by id (it counts them all).
CONFIRM_LISTED = 20


def _params_matching(queryset: QuerySet[Any], term: str) -> list[int]:
    """Return ids of calls whose params, as the admin shows them (redacted), contain the term.

    The database finds candidates in the stored text; each is kept only if the term is also in
    its redacted text, so no search can probe a redacted value one character at a time.
    """
    needle = term.casefold()
    candidates = queryset.filter(params__icontains=term).order_by("-id").values_list("id", "params")
    return [
        call_id for call_id, params in candidates[:PARAMS_SEARCH_CANDIDATES]
        if needle in json.dumps(redact(params), ensure_ascii=False, default=str).casefold()
    ]


def _errors_matching(queryset: QuerySet[Any], term: str) -> list[int]:
    """Return ids of calls whose last error, as the admin shows it (redacted), contains the term."""
    needle = term.casefold()
    candidates = queryset.filter(last_error__icontains=term).order_by("-id").values_list("id", "last_error")
    return [
        call_id for call_id, error in candidates[:PARAMS_SEARCH_CANDIDATES] if needle in redact_text(error).casefold()
    ]


class CallStateFilter(admin.SimpleListFilter):
    """Status, with waiting split into never tried, waiting for a retry, and deferred by a 429."""

    title = "state"
    parameter_name = "state"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [
            ("waiting", "Waiting (all)"),
            ("new", "Waiting, never tried"),
            ("retry", "Waiting for a retry"),
            ("deferred", "Waiting after a 429"),
            ("in_flight", "In flight (dispatched or running)"),
            (CallQueue.Status.DISPATCHED, "Dispatched, not started"),
            (CallQueue.Status.RUNNING, "Running"),
            (CallQueue.Status.DONE, "Done"),
            (CallQueue.Status.FAILED, "Failed (gave up)"),
            (CallQueue.Status.CANCELLED, "Cancelled"),
        ]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        if value == "waiting":
            return queryset.filter(status=CallQueue.Status.PENDING)
        if value == "new":
            return queryset.filter(status=CallQueue.Status.PENDING, attempts=0, deferrals=0)
        if value == "retry":
            return queryset.filter(status=CallQueue.Status.PENDING, attempts__gt=0)
        if value == "deferred":
            return queryset.filter(status=CallQueue.Status.PENDING, attempts=0, deferrals__gt=0)
        if value == "in_flight":
            return queryset.filter(status__in=CallQueue.IN_FLIGHT)
        if value in set(CallQueue.Status.values) - {CallQueue.Status.PENDING}:
            return queryset.filter(status=value)
        return queryset


class KeyFilter(admin.SimpleListFilter):
    """Calls that carry one key: typed, with suggestions from every key known (no cap on the list)."""

    title = "key"
    parameter_name = "key"
    template = "admin/dispatcher/key_filter.html"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return []

    def has_output(self) -> bool:
        return True

    # The one choice is what key_filter.html reads (a typed key), not Django's (selected, query_string, display).
    def choices(self, changelist: Any) -> list[dict[str, Any]]:  # type: ignore[override]
        others = [(k, v) for k, v in changelist.params.items() if k not in (self.parameter_name, "p")]
        return [{"value": self.value() or "", "others": others, "suggest": reverse("admin:dispatcher_callqueue_keys"),
                 "clear": changelist.get_query_string(remove=[self.parameter_name])}]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        key = self.value()
        if not key:
            return queryset
        # key_set is the sorted keys as JSON text, so the quoted key matches one element exactly.
        return queryset.filter(key_set__contains=key_in_set(key))


_calls_page = threading.local()


def _moment_field(name: str) -> Callable[[CallQueueAdmin, CallQueue], str]:
    """Return a read-only field showing one of a call's moments against the page's clock."""

    @admin.display(description=name.replace("_", " "))
    def shown(admin_: CallQueueAdmin, call: CallQueue) -> str:
        return admin_._moment(getattr(call, name))

    shown.__name__ = f"{name}_shown"
    return shown


@admin.register(CallQueue)
class CallQueueAdmin(RefuseUnstorableMixin, ButtonsMixin, ReadOnlyAdminMixin, ModelAdmin):
    button_page = "the call's page"

    list_display = ["id", "method", "target", "state_label", "keys_label", "attempts_label", "age", "next_try", "error"]
    list_filter = [CallStateFilter, "method", KeyFilter]
    search_fields = ["method", "unique_key"]
    search_help_text = (
        "Search by call id, or by text in the method, keys, unique key, params or last error"
        " (secret values are never searched)."
    )
    change_form_template = "admin/dispatcher/callqueue/change_form.html"
    ordering = ["-id"]
    list_per_page = 50

    class Media:
        css = {"all": ["dispatcher/dashboard.css", "dispatcher/admin.css"]}  # the stalled-call warning, narrow columns
    show_full_result_count = False
    actions = ["retry_now", "cancel"]
    fields = [
        "method", "state_label", "why_waiting", "keys_label", "cost_label", "priority", "queue", "attempts_label",
        "deferrals", "unique_key", "unique_until",
        "run_at_shown", "created_at_shown", "dispatched_at_shown", "started_at_shown", "finished_at_shown",
        "params_shown", "result_shown", "error_shown", "traceback_shown", "attempt_history",
    ]

    def get_search_results(self, request: HttpRequest, queryset: QuerySet[Any], search_term: str) -> tuple[QuerySet[Any], bool]:
        # A NUL is refused by PostgreSQL's text type, and no stored text holds one.
        term = search_term.replace("\x00", "").strip()
        if not term:
            return queryset, False
        # last_error holds handlers' messages, shown redacted; it is matched on its redacted text too.
        query = (
            Q(method__icontains=term) | Q(key_set__icontains=term) | Q(id__in=_params_matching(queryset, term))
            | Q(id__in=_errors_matching(queryset, term)) | Q(unique_key__icontains=term)
        )
        number = term.removeprefix("#")
        # ASCII digits only ("²" is a digit to isdigit()), and within the id column's range.
        if number.isascii() and number.isdigit() and len(number) <= 19 and int(number) <= MAX_ID:
            query |= Q(id=int(number))
        return queryset.filter(query), False

    def get_urls(self) -> list[URLPattern]:
        urls = [
            path("keys/", self.admin_site.admin_view(self.keys_view), name="dispatcher_callqueue_keys"),
            path("<int:call_id>/retry/", self.admin_site.admin_view(self.retry_view), name="dispatcher_callqueue_retry"),
            path("<int:call_id>/cancel/", self.admin_site.admin_view(self.cancel_view), name="dispatcher_callqueue_cancel"),
            *FailuresViews(self).urls(),
        ]
        return urls + super().get_urls()

    def keys_view(self, request: HttpRequest) -> HttpResponse:
        """Suggest keys for the key filter, by text they contain."""
        if not self.has_view_permission(request):
            raise PermissionDenied
        term = request.GET.get("term", "").strip()[:200]
        if "\x00" in term:
            return HttpResponseBadRequest("A query value holds a NUL character.", content_type="text/plain")
        return JsonResponse({"keys": known_keys(term) if term else []})

    def retry_view(self, request: HttpRequest, call_id: int) -> HttpResponse:
        return self._button(request, call_id, "retry_now")

    def cancel_view(self, request: HttpRequest, call_id: int) -> HttpResponse:
        """GET: ask first (the call page's Cancel leads here); POST: cancel."""
        if request.method == "GET":
            if not self.has_change_permission(request):
                raise PermissionDenied
            return self._confirm_cancel(request, CallQueue.objects.filter(id=call_id), single=call_id)
        return self._button(request, call_id, "cancel")

    def _confirm_cancel(self, request: HttpRequest, queryset: QuerySet[Any], single: int | None = None) -> TemplateResponse:
        """Say which calls a cancel will stop and which it leaves alone, with the form that does it."""
        waiting = list(queryset.filter(status=CallQueue.Status.PENDING).order_by("id")[:CONFIRM_LISTED])
        count = queryset.filter(status=CallQueue.Status.PENDING).count()
        return TemplateResponse(request, "admin/dispatcher/callqueue/cancel_confirm.html", {
            **self.admin_site.each_context(request), "opts": self.model._meta,
            "title": f"Cancel call {single}?" if single else "Cancel calls?", "waiting": waiting, "count": count,
            "others": queryset.count() - count, "single": single, "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
            # The action's own choice, posted again as Django's delete confirmation does.
            "selected": request.POST.getlist(helpers.ACTION_CHECKBOX_NAME), "select_across": request.POST.get("select_across", "0"),
        })

    def changelist_view(self, request: HttpRequest, extra_context: dict[str, Any] | None = None) -> HttpResponse:
        # One clock read and one limiter read per page, shared by every row's "age" and "next try".
        # Kept per thread: the admin instance is shared by every request.
        _calls_page.now = db_now()
        _calls_page.statuses = None
        try:
            response = super().changelist_view(request, {"title": "Calls", **(extra_context or {})})
            if hasattr(response, "render"):
                cl = getattr(response, "context_data", {}).get("cl")
                if cl is not None:
                    keys = {k for c in cl.result_list if c.status == CallQueue.Status.PENDING for k in c.keys}
                    _calls_page.statuses = {s.key: s for s in live.key_statuses(keys, now=_calls_page.now)} if keys else {}
                response.render()
            return response
        finally:
            _calls_page.now = None
            _calls_page.statuses = None

    def _now(self) -> Any:
        return getattr(_calls_page, "now", None) or db_now()

    def get_fields(self, request: HttpRequest, obj: CallQueue | None = None) -> _FieldGroups:
        fields = list(super().get_fields(request, obj))
        if obj is not None and obj.status in CallQueue.FINISHED:
            fields.remove("why_waiting")  # a finished call does not wait
        return fields

    def changeform_view(self, request: HttpRequest, object_id: str | None = None, form_url: str = "", extra_context: dict[str, Any] | None = None) -> HttpResponse:
        if request.method == "POST":
            raise PermissionDenied("calls are read-only; use the retry and cancel actions")
        extra_context = {**(extra_context or {}), "show_save": False, "show_save_and_continue": False,
                         "show_save_and_add_another": False, "show_delete": False,
                         "title": f"Call {object_id}" if object_id and object_id.isdigit() else "Call"}
        return super().changeform_view(request, object_id, form_url, extra_context)

    @admin.display(description="cost")
    def cost_label(self, call: CallQueue) -> str:
        if not call.cost:
            return "1 unit per key"
        return ", ".join(f"{key}: {units}" for key, units in call.cost.items())

    @admin.display(description="state", ordering="status")
    def state_label(self, call: CallQueue) -> str:
        if call.status == CallQueue.Status.PENDING:
            if call.attempts > 0:
                return f"waiting for retry ({call.attempts}/{call.max_attempts} tried)"
            if call.deferrals > 0:
                return f"waiting after 429 ({ngettext('%d deferral', '%d deferrals', call.deferrals) % call.deferrals})"
            return "waiting (never tried)"
        if call.status == CallQueue.Status.FAILED:
            return f"failed (gave up after {ngettext('%d attempt', '%d attempts', call.attempts) % call.attempts})"
        return call.get_status_display().lower()

    @admin.display(description="keys")
    def keys_label(self, call: CallQueue) -> str:
        return ", ".join(call.keys) or "-"

    @admin.display(description="attempts")
    def attempts_label(self, call: CallQueue) -> str:
        text = f"{call.attempts}/{call.max_attempts}"
        if call.deferrals:
            text += f" (+{call.deferrals} deferred by 429, not counted)"
        return text

    @admin.display(description="age", ordering="created_at")
    def age(self, call: CallQueue) -> str:
        """Waiting or in flight: since created; finished: created to finished."""
        if not call.created_at:
            return "-"
        if call.finished_at:  # not "8 s": that reads like "8 s ago"
            return f"finished after {humanize_duration(call.finished_at - call.created_at)}"
        return humanize_duration(self._now() - call.created_at)

    @admin.display(description="next try", ordering="run_at")
    def next_try(self, call: CallQueue) -> str:
        """The earliest a waiting call can start, short ("in 3 min, paused"), the moment on hover: a
        lower bound from its run_at and every key's next free slot (``status``: held-aware); the
        call's own page says exactly when, counting the calls ahead of it (``waits.expected_start``),
        which a list of a hundred calls cannot afford."""
        if call.status != CallQueue.Status.PENDING:
            return "-"
        now = self._now()
        statuses = getattr(_calls_page, "statuses", None)
        if statuses is None:
            statuses = {s.key: s for s in live.key_statuses(call.keys, now=now)}
        moment, why = max(call.run_at, now), ""
        for key in call.keys:
            status = statuses.get(key)
            if status is None or not status.waiting:
                continue
            if status.next_free_at is None:
                return format_html('<span title="when a call in flight of {} finishes">after one in flight</span>', key)
            if status.next_free_at > moment:
                moment = status.next_free_at
                # A pause is the operator's (or a 429's), not a limit: say so, as the call's page does.
                why = "paused" if status.paused_until and status.paused_until > now else f"limit of {status.held_by or key}"
        if moment <= now:
            return "due now"
        short = humanize(moment, now) + (f", {why[:30]}" if why else "")
        return format_html('<span title="not before {}{}">{}</span>', format_moment(moment, now), f" ({why})" if why else "", short)

    @admin.display(description="target")
    def target(self, call: CallQueue) -> str:
        """An http call's host and path (no query: it may hold tokens), redacted and cut; '-' for other methods."""
        url = call.params.get("url") if call.method == "http" and isinstance(call.params, dict) else None
        if not isinstance(url, str):
            return "-"
        parts = urlsplit(url)
        text = redact_text(f"{parts.netloc}{parts.path}")
        return text[:TARGET_CHARS] + "…" if len(text) > TARGET_CHARS else text

    @admin.display(description="error")
    def error(self, call: CallQueue) -> str:
        error = redact_text(call.last_error).strip()
        text = error.splitlines()[0] if error else ""
        return (text[:80] + "…" if len(text) > 80 else text) or "-"

    @admin.display(description="why it waits")
    def why_waiting(self, call: CallQueue) -> str:
        explanation = waits.explain_call(call)
        stalled = format_html("<p class='why-stalled'>{}</p>", explanation.stalled) if explanation.stalled else ""
        if not explanation.waiting:
            return stalled or "in flight"
        if not explanation.reasons:
            text = "due now, but nothing will send it" if stalled else "due now: the next dispense pass will send it"
            return format_html("<p>{}</p>{}", text, stalled)
        expected = explanation.expected
        when = expected.text(format_moment, explanation.now) if expected is not None else ""
        if explanation.until is None:
            until = f"Waits until a call in flight finishes ({when})" if when else "Waits until a call in flight finishes"
        else:
            until = when[:1].upper() + when[1:]
        items = format_html_join("", "<li>{}</li>", ((r.text,) for r in explanation.reasons))
        return format_html("<ul class='why-waiting'>{}</ul><p>{}.</p>{}", items, until, stalled)

    def _moment(self, value: datetime | None) -> str:
        return format_moment(value, self._now()) if value else "-"

    run_at_shown = _moment_field("run_at")
    created_at_shown = _moment_field("created_at")
    dispatched_at_shown = _moment_field("dispatched_at")
    started_at_shown = _moment_field("started_at")
    finished_at_shown = _moment_field("finished_at")

    @admin.display(description="params")
    def params_shown(self, call: CallQueue) -> str:
        return _pretty_json(call.params)

    @admin.display(description="result")
    def result_shown(self, call: CallQueue) -> str:
        return _pretty_json(call.result) if call.result is not None else "-"

    @admin.display(description="last error")
    def error_shown(self, call: CallQueue) -> str:
        return redact_text(call.last_error) or "-"

    @admin.display(description="traceback")
    def traceback_shown(self, call: CallQueue) -> str:
        return format_html("<pre>{}</pre>", redact_text(call.last_traceback)) if call.last_traceback else "-"

    @admin.display(description="attempt history")
    def attempt_history(self, call: CallQueue) -> str:
        attempts = list(call.attempt_set.order_by("id"))
        if not attempts:
            return "no attempt yet"
        rows, counted, deferred = [], 0, 0
        for a in attempts:
            # A 429 deferral counts against the limits but not against max_attempts: say which is which.
            if a.outcome == a.Outcome.RATE_LIMITED:
                deferred += 1
                label = f"deferral {deferred} (429, not counted)"
            else:
                counted += 1
                label = f"attempt {counted} of {call.max_attempts}"
            rows.append((label, f"{a.started_at.astimezone(UTC):%Y-%m-%d %H:%M:%S.%f}"[:-3] + " UTC",
                         format_duration(a.finished_at - a.started_at) if a.finished_at else "-",
                         a.get_outcome_display(), redact_text(a.error[:500]) or "-", a.worker or "-"))
        body = format_html_join("", "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>", rows)
        return format_html(
            "<p>{} counted against max_attempts ({}), {} deferred by a 429.</p>"
            "<table class='attempts'><thead><tr><th>start</th><th>started</th><th>took</th><th>outcome</th>"
            "<th>error</th><th>worker</th></tr></thead><tbody>{}</tbody></table>",
            ngettext("%d attempt", "%d attempts", counted) % counted, call.max_attempts,
            ngettext("%d start", "%d starts", deferred) % deferred, body,
        )

    def _log(self, request: HttpRequest, ids: list[int], message: str) -> None:
        if ids:
            _log_change(request, self.model.objects.filter(id__in=ids), message)

    @admin.action(description="Retry now (failed calls get one more attempt)", permissions=["change"])
    def retry_now(self, request: HttpRequest, queryset: QuerySet[Any]) -> None:
        eligible = list(queryset.filter(status__in=[CallQueue.Status.PENDING, CallQueue.Status.FAILED]).values_list("id", flat=True))
        skipped = queryset.count() - len(eligible)
        done = CallQueue.objects.retry_now(eligible)
        self._log(request, eligible, "Retried now")
        self.message_user(request, ngettext("%d call is due now.", "%d calls are due now.", done) % done)
        held = self._held(eligible)
        if held:
            self.message_user(request, held, messages.WARNING)
        if skipped:
            self.message_user(
                request,
                ngettext("%d call was not waiting or failed and was left alone.",
                         "%d calls were not waiting or failed and were left alone.", skipped) % skipped,
                messages.WARNING,
            )

    def _held(self, ids: list[int]) -> str:
        """Say when calls just made due will really start, if a limit or pause holds them back."""
        held = waits.first_held(ids) if ids else None
        if held is None:
            return ""
        call, first = held.call, held.explanation
        when = first.expected.text(format_moment, first.now) if first.expected is not None else ""
        if first.until is None:
            when = f"waits until a call in flight finishes ({when})"
        text = f"Call #{call.id} still waits: {first.reasons[0].text}; {when}."
        if held.more:
            text += f" {held.more} more of the calls wait for their keys' limits too."
        return text

    @admin.action(description="Cancel (waiting calls only; asks first)", permissions=["change"])
    def cancel(self, request: HttpRequest, queryset: QuerySet[Any]) -> TemplateResponse | None:
        # As Django's delete: the action's first POST shows what it will do; the page's own POST does it.
        if request.POST.get("post") != "yes" and request.POST.get("action") == "cancel":
            return self._confirm_cancel(request, queryset)
        ids = list(queryset.filter(status=CallQueue.Status.PENDING).values_list("id", flat=True))
        total = queryset.count()
        done = CallQueue.objects.cancel(ids)
        cancelled = list(CallQueue.objects.filter(id__in=ids, status=CallQueue.Status.CANCELLED).values_list("id", flat=True))
        self._log(request, cancelled, "Cancelled")
        self.message_user(request, ngettext("%d call cancelled.", "%d calls cancelled.", done) % done)
        if total - done:
            skipped = total - done
            self.message_user(
                request,
                ngettext("%d call was not waiting and was left alone.", "%d calls were not waiting and were left alone.", skipped) % skipped,
                messages.WARNING,
            )
        return None
