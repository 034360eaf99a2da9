"""The admin: calls (read-only, retry/cancel), rate limits (live usage, pause/resume), a dashboard."""
from __future__ import annotations

import json
import threading
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from django import forms
from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.contrib.admin.helpers import ActionForm
from django.contrib.admin.models import CHANGE, LogEntry
from django.contrib.admin.utils import flatten
from django.contrib.admin.views.main import ChangeList
from django.core.exceptions import PermissionDenied
from django.db.models import Min, Q, QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseBadRequest, HttpResponseRedirect, JsonResponse
from django.shortcuts import get_object_or_404
from django.urls import path, reverse
from django.utils.html import format_html, format_html_join
from django.utils.translation import ngettext

from dispatcher import liveness, waits
from dispatcher import status as live
from dispatcher.clock import db_now
from dispatcher.durations import format_duration, format_moment, humanize, humanize_duration, parse_positive_duration
from dispatcher.keys import is_pattern, key_in_set, parse_key_set, pattern_matches, validate_policy_key
from dispatcher.limits.shapes import PolicyError, validate
from dispatcher.models import CallQueue, KeyState, LearntLimit, RateLimit
from dispatcher.redact import redact, redact_text

if TYPE_CHECKING:
    from django.contrib.admin.options import _FieldGroups

MAX_ID = 2**63 - 1
# Search in params looks at this many of the newest calls whose stored params contain the text.
PARAMS_SEARCH_CANDIDATES = 200


def _log_change(request: HttpRequest, queryset: QuerySet, message: str) -> None:
    """Leave admin history: who did what to which calls or policies, one entry per row."""
    user_id = request.user.pk
    if user_id is None:  # the admin's views let only a logged-in staff user this far
        raise PermissionDenied
    LogEntry.objects.log_actions(user_id, queryset, CHANGE, message)


def _params_matching(queryset: QuerySet, term: str) -> list[int]:
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


def _errors_matching(queryset: QuerySet, term: str) -> list[int]:
    """Return ids of calls whose last error, as the admin shows it (redacted), contains the term."""
    needle = term.casefold()
    candidates = queryset.filter(last_error__icontains=term).order_by("-id").values_list("id", "last_error")
    return [
        call_id for call_id, error in candidates[:PARAMS_SEARCH_CANDIDATES] if needle in redact_text(error).casefold()
    ]


def _pretty_json(value: Any) -> str:
    return format_html("<pre>{}</pre>", json.dumps(redact(value), indent=2, sort_keys=True, default=str))


# --- calls -------------------------------------------------------------------------------


class CallStateFilter(admin.SimpleListFilter):
    """Status, with waiting split into never tried, waiting for a retry, and deferred by a 429."""

    title = "state"
    parameter_name = "state"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [
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

    def queryset(self, request: HttpRequest, queryset: QuerySet) -> QuerySet:
        value = self.value()
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

    def queryset(self, request: HttpRequest, queryset: QuerySet) -> QuerySet:
        key = self.value()
        if not key:
            return queryset
        # key_set is the sorted keys as JSON text, so the quoted key matches one element exactly.
        return queryset.filter(key_set__contains=key_in_set(key))


class RefuseUnstorableMixin:
    """Answer 400 to a list request holding what no column can: a NUL, or a selected id past bigint.

    Django passes filter values and selected ids to the database as they come; PostgreSQL
    refuses a NUL in text, SQLite an integer past 64 bits, and either would answer 500.
    """

    def changelist_view(self, request: HttpRequest, extra_context: dict | None = None) -> HttpResponse:
        for params in (request.GET, request.POST):
            if any("\x00" in name or any("\x00" in value for value in values) for name, values in params.lists()):
                return HttpResponseBadRequest("A query or form value holds a NUL character.", content_type="text/plain")
        for value in request.POST.getlist(helpers.ACTION_CHECKBOX_NAME):
            if not (value.isascii() and value.isdigit() and len(value) <= 19 and int(value) <= MAX_ID):
                return HttpResponseBadRequest("Selected ids must be whole numbers of a row.", content_type="text/plain")
        return super().changelist_view(request, extra_context)  # type: ignore[misc]


def known_keys(term: str, limit: int = 20) -> list[str]:
    """Return up to ``limit`` keys containing ``term``: keys with a policy, limiter state or waiting calls."""
    found = set(KeyState.objects.filter(key__icontains=term).exclude(key__endswith="*").values_list("key", flat=True)[:limit])
    found.update(k for k in RateLimit.objects.filter(key__icontains=term).values_list("key", flat=True) if not is_pattern(k))
    if len(found) < limit:
        for text in CallQueue.objects.pending().filter(key_set__icontains=term).values_list("key_set", flat=True)[:200]:
            found.update(k for k in parse_key_set(text) if term.lower() in k.lower())
    return sorted(found)[:limit]


_calls_page = threading.local()


def _moment_field(name: str) -> Callable[[CallQueueAdmin, CallQueue], str]:
    """Return a read-only field showing one of a call's moments against the page's clock."""

    @admin.display(description=name.replace("_", " "))
    def shown(admin_: CallQueueAdmin, call: CallQueue) -> str:
        return admin_._moment(getattr(call, name))

    shown.__name__ = f"{name}_shown"
    return shown


class ButtonsMixin(admin.ModelAdmin):
    """Buttons on an object's page that run one of the admin's actions on that object alone."""

    # Where the buttons are, for the answer to a request that is not theirs.
    button_page = "the object's page"

    def _button(self, request: HttpRequest, object_id: int, action: str) -> HttpResponse:
        if request.method != "POST":
            return HttpResponse(f"use the button on {self.button_page}", status=405, content_type="text/plain")
        if not self.has_change_permission(request):
            raise PermissionDenied
        get_object_or_404(self.model, id=object_id)
        getattr(self, action)(request, self.model.objects.filter(id=object_id))
        opts = self.model._meta
        return HttpResponseRedirect(reverse(f"admin:{opts.app_label}_{opts.model_name}_change", args=[object_id]))


class ReadOnlyAdminMixin(admin.ModelAdmin):
    """Calls are changed only by the dispatcher and by the actions, never by hand."""

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        return flatten(self.fields or [])


@admin.register(CallQueue)
class CallQueueAdmin(RefuseUnstorableMixin, ButtonsMixin, ReadOnlyAdminMixin, admin.ModelAdmin):
    button_page = "the call's page"

    list_display = ["id", "method", "state_label", "keys_label", "attempts_label", "age", "next_try", "error"]
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
        css = {"all": ["dispatcher/dashboard.css"]}  # the stalled-call warning
    show_full_result_count = False
    actions = ["retry_now", "cancel"]
    fields = [
        "method", "state_label", "why_waiting", "keys_label", "cost_label", "priority", "queue", "attempts_label",
        "deferrals", "unique_key", "unique_until",
        "run_at_shown", "created_at_shown", "dispatched_at_shown", "started_at_shown", "finished_at_shown",
        "params_shown", "result_shown", "error_shown", "traceback_shown", "attempt_history",
    ]

    def get_search_results(self, request: HttpRequest, queryset: QuerySet, search_term: str) -> tuple[QuerySet, bool]:
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

    def get_urls(self) -> list:
        urls = [
            path("keys/", self.admin_site.admin_view(self.keys_view), name="dispatcher_callqueue_keys"),
            path("<int:call_id>/retry/", self.admin_site.admin_view(self.retry_view), name="dispatcher_callqueue_retry"),
            path("<int:call_id>/cancel/", self.admin_site.admin_view(self.cancel_view), name="dispatcher_callqueue_cancel"),
        ]
        return urls + super().get_urls()

    def keys_view(self, request: HttpRequest) -> JsonResponse:
        """Suggest keys for the key filter, by text they contain."""
        if not self.has_view_permission(request):
            raise PermissionDenied
        term = request.GET.get("term", "").strip()[:200]
        return JsonResponse({"keys": known_keys(term) if term else []})

    def retry_view(self, request: HttpRequest, call_id: int) -> HttpResponse:
        return self._button(request, call_id, "retry_now")

    def cancel_view(self, request: HttpRequest, call_id: int) -> HttpResponse:
        return self._button(request, call_id, "cancel")

    def changelist_view(self, request: HttpRequest, extra_context: dict | None = None) -> HttpResponse:
        # One clock read and one limiter read per page, shared by every row's "age" and "next try".
        # Kept per thread: the admin instance is shared by every request.
        _calls_page.now = db_now()
        _calls_page.statuses = None
        try:
            response = super().changelist_view(request, extra_context)
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

    def changeform_view(self, request: HttpRequest, object_id: str | None = None, form_url: str = "", extra_context: dict | None = None) -> HttpResponse:
        if request.method == "POST":
            raise PermissionDenied("calls are read-only; use the retry and cancel actions")
        extra_context = {**(extra_context or {}), "show_save": False, "show_save_and_continue": False,
                         "show_save_and_add_another": False, "show_delete": False}
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
                return f"waiting after 429 ({call.deferrals} deferrals)"
            return "waiting (never tried)"
        if call.status == CallQueue.Status.FAILED:
            return f"failed (gave up after {call.attempts} attempts)"
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
        if call.finished_at:
            return f"{humanize_duration(call.finished_at - call.created_at)} (finished)"
        return humanize_duration(self._now() - call.created_at)

    @admin.display(description="next try", ordering="run_at")
    def next_try(self, call: CallQueue) -> str:
        """When a waiting call can start: its run_at, or later when a key's limit or pause blocks it."""
        if call.status != CallQueue.Status.PENDING:
            return "-"
        now = self._now()
        statuses = getattr(_calls_page, "statuses", None)
        if statuses is None:
            statuses = {s.key: s for s in live.key_statuses(call.keys, now=now)}
        moment, held = max(call.run_at, now), ""
        for key in call.keys:
            status = statuses.get(key)
            if status is None or not status.blocked:
                continue
            if status.next_free_at is None:
                return f"when a call in flight of {key} finishes"
            if status.next_free_at > moment:
                moment, held = status.next_free_at, f" (limit of {key})"
        if moment <= now:
            return "due now"
        return f"{format_moment(moment, now)}{held}"

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
    def retry_now(self, request: HttpRequest, queryset: QuerySet) -> None:
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
        if not ids:
            return ""
        calls = list(CallQueue.objects.filter(id__in=ids[:200], status=CallQueue.Status.PENDING))
        explanations = [(c, waits.explain_call(c)) for c in calls]
        held = [(c, e) for c, e in explanations if e.reasons]
        if not held:
            return ""
        call, first = held[0]
        when = "when a call in flight finishes" if first.until is None else f"at {format_moment(first.until, first.now)}"
        text = f"Call #{call.id} still waits: {first.reasons[0].text}; it will start {when}."
        if len(held) > 1:
            text += f" {len(held) - 1} more of the calls wait for their keys' limits too."
        return text

    @admin.action(description="Cancel (waiting calls only)", permissions=["change"])
    def cancel(self, request: HttpRequest, queryset: QuerySet) -> None:
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


# --- rate limits ---------------------------------------------------------------------------


class DurationTextField(forms.Field):
    """A duration written like 500ms, 2s, 5m, 1h or 1d."""

    default_error_messages = {"invalid": "Write a duration like 500ms, 2s, 5m, 1h or 1d."}

    def prepare_value(self, value: Any) -> Any:
        return format_duration(value) if isinstance(value, timedelta) else value

    def to_python(self, value: Any) -> timedelta | None:
        if value in self.empty_values:
            return None
        try:
            return parse_positive_duration(value)
        except ValueError as exc:
            raise forms.ValidationError(str(exc), code="invalid") from None


_page = threading.local()


class RateLimitForm(forms.ModelForm):
    period = DurationTextField(help_text="Length of the window (or a bucket's refill of LIMIT units): 500ms, 2s, 5m, 1h, 1d.")
    limit = forms.IntegerField(min_value=1, help_text="Units that may start per period.")
    burst = forms.IntegerField(
        min_value=1, required=False,
        help_text="Empty: a sliding window. Set: a token bucket this deep refilling at LIMIT per period (1: evenly spaced).",
    )
    concurrency = forms.IntegerField(min_value=1, required=False, help_text="Most calls in flight at once (empty: no cap).")

    class Meta:
        model = RateLimit
        fields = ["key", "limit", "period", "burst", "concurrency"]

    def clean(self) -> dict[str, Any]:
        super().clean()
        data = self.cleaned_data
        if data.get("limit") is not None and data.get("period") is not None:
            try:
                validate(data["limit"], data["period"], data.get("burst"), data.get("concurrency"))
            except PolicyError as exc:
                raise forms.ValidationError(str(exc)) from None
        return data

    def clean_key(self) -> str:
        try:
            return validate_policy_key(self.cleaned_data["key"])
        except ValueError as exc:
            raise forms.ValidationError(str(exc)) from None


class PauseActionForm(ActionForm):
    duration = forms.CharField(required=False, label="pause for", help_text="e.g. 30s, 5m, 1h",
                               widget=forms.TextInput(attrs={"size": 6, "placeholder": "5m"}))


class KeyChangeList(ChangeList):
    """The policy list with one row per key: the key's first policy stands for the key."""

    def get_queryset(self, request: HttpRequest, exclude_parameters: Any = None) -> QuerySet:
        firsts = RateLimit.objects.values("key").annotate(first=Min("id")).values("first")
        return super().get_queryset(request, exclude_parameters).filter(id__in=firsts)


@admin.register(RateLimit)
class RateLimitAdmin(RefuseUnstorableMixin, ButtonsMixin, admin.ModelAdmin):
    button_page = "the policy's page"

    form = RateLimitForm
    action_form = PauseActionForm
    # One row per key (its first policy stands for it), every policy of the key listed in it.
    list_display = ["key", "policy_label", "in_flight", "waiting", "oldest_wait", "paused_until", "next_free_slot"]
    search_fields = ["key"]
    actions = ["pause", "resume"]
    change_form_template = "admin/dispatcher/ratelimit/change_form.html"

    class Media:
        css = {"all": ["dispatcher/dashboard.css"]}

    def get_urls(self) -> list:
        urls = [
            path("<int:policy_id>/pause/", self.admin_site.admin_view(self.pause_view), name="dispatcher_ratelimit_pause"),
            path("<int:policy_id>/resume/", self.admin_site.admin_view(self.resume_view), name="dispatcher_ratelimit_resume"),
        ]
        return urls + super().get_urls()

    def pause_view(self, request: HttpRequest, policy_id: int) -> HttpResponse:
        return self._button(request, policy_id, "pause")

    def resume_view(self, request: HttpRequest, policy_id: int) -> HttpResponse:
        return self._button(request, policy_id, "resume")


    def changelist_view(self, request: HttpRequest, extra_context: dict | None = None) -> HttpResponse:
        # One read of the live state per page, shared by every row's columns.
        # Kept per thread: the admin instance is shared by every request.
        _page.statuses = {s.key: s for s in live.key_statuses()}
        _page.policies = {}
        for policy in RateLimit.objects.order_by("key", "period"):
            _page.policies.setdefault(policy.key, []).append(policy)
        # A free slot sends nothing while no dispenser runs: say so where the slot is read.
        _page.free_now = "now, but no dispenser runs" if liveness.read().problem(liveness.DISPENSER) else "now"
        try:
            response = super().changelist_view(request, extra_context)
            if hasattr(response, "render"):
                response.render()  # while the statuses are set: the columns read them
            return response
        finally:
            _page.statuses, _page.policies, _page.free_now = {}, {}, "now"

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type:
        return KeyChangeList

    def get_actions(self, request: HttpRequest) -> dict:
        # A row stands for every policy of its key: deleting "the selected" would delete one of
        # them. A policy is deleted from its own page.
        actions = super().get_actions(request)
        actions.pop("delete_selected", None)
        return actions

    def save_model(self, request: HttpRequest, obj: RateLimit, form: forms.Form, change: bool) -> None:
        # The manager's edits lock the key and wake the dispensers, as the command's do.
        saved = RateLimit.objects.set_policy(
            obj.key, obj.limit, obj.period, obj.concurrency, burst=obj.burst, replacing=obj.pk if change else None
        )
        obj.pk = saved.pk

    def delete_model(self, request: HttpRequest, obj: RateLimit) -> None:
        RateLimit.objects.delete_policies(obj.key, obj.period)

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[RateLimit]) -> None:
        for key, period in queryset.values_list("key", "period"):
            RateLimit.objects.delete_policies(key, period)

    def _statuses(self, policy: RateLimit) -> list[live.KeyStatus]:
        statuses = getattr(_page, "statuses", {})
        if not is_pattern(policy.key):
            return [statuses[policy.key]] if policy.key in statuses else []
        return [s for k, s in statuses.items() if pattern_matches(policy.key, k) and s.governed_by == policy.key]

    def _use(self, status: live.KeyStatus, policy: RateLimit) -> live.PolicyUse | None:
        return next((p for p in status.policies if p.policy.period == policy.period and p.policy.key == policy.key), None)

    @admin.display(description="policies: used now, dispatched-not-started calls included")
    def policy_label(self, row: RateLimit) -> str:
        """Every policy of the row's key with what it has taken, in its own terms (window units, bucket tokens)."""
        policies = getattr(_page, "policies", {}).get(row.key) or [row]
        statuses = self._statuses(row)
        items = []
        for policy in policies:
            shape = policy.as_policy()
            uses = [(s.key, u) for s in statuses if (u := self._use(s, policy))]
            if uses:
                key, use = max(uses, key=lambda item: item[1].committed)
                usage = use.usage_text() + (f" (busiest: {key})" if is_pattern(row.key) else "")
            else:
                usage = live.PolicyUse(shape, 0).usage_text()
            url = reverse("admin:dispatcher_ratelimit_change", args=[policy.pk])
            items.append((url, f"{shape.shape} {shape.label()}", usage))
        learnt = [u for s in statuses for u in s.policies if u.learnt] if not is_pattern(row.key) else []
        html = format_html_join("", '<li class="policy-use"><a href="{}">{}</a>: {}</li>', items)
        html += format_html_join("", '<li class="policy-use learnt">{} {}: {}</li>',
                                 ((u.policy.shape, u.label(), u.usage_text()) for u in learnt))
        return format_html('<ul class="policy-uses">{}</ul>', html)

    @admin.display(description="in flight")
    def in_flight(self, policy: RateLimit) -> str:
        total = sum(s.in_flight for s in self._statuses(policy))
        caps = [p.concurrency for p in getattr(_page, "policies", {}).get(policy.key, [policy]) if p.concurrency]
        return f"{total}/{min(caps)}" if caps else str(total)

    @admin.display(description="waiting")
    def waiting(self, policy: RateLimit) -> int:
        return sum(s.waiting for s in self._statuses(policy))

    @admin.display(description="oldest wait")
    def oldest_wait(self, policy: RateLimit) -> str:
        waits = [s.oldest_wait for s in self._statuses(policy) if s.oldest_wait is not None]
        return humanize_duration(max(waits)) if waits else "-"

    @admin.display(description="paused until (by whom)")
    def paused_until(self, policy: RateLimit) -> str:
        now = db_now()
        state = KeyState.objects.filter(key=policy.key, paused_until__gt=now).first()
        if state is not None:
            until, reason = state.paused_until, state.pause_reason
        else:
            pauses = [(s.paused_until, s) for s in self._statuses(policy) if s.paused_until]
            if not pauses:
                return "-"
            until, latest = max(pauses, key=lambda pause: pause[0])
            reason, now = latest.pause_reason, latest.now
        source = waits.pause_source(reason)
        detail = f" ({reason})" if reason and source not in (reason, "operator", "pattern pause") else ""
        return f"{format_moment(until, now)}, by {source}{detail}"

    @admin.display(description="next free slot")
    def next_free_slot(self, policy: RateLimit) -> str:
        statuses = self._statuses(policy)
        blocked = [s for s in statuses if s.blocked]
        if not blocked:
            return getattr(_page, "free_now", "now")
        frees = [(s.next_free_at, s.now) for s in blocked if s.next_free_at is not None]
        if len(frees) < len(blocked):
            return "when a call in flight finishes"
        free_at, now = max(frees, key=lambda free: free[0])
        return humanize(free_at, now)

    def _duration(self, request: HttpRequest) -> timedelta | None:
        try:
            return parse_positive_duration(request.POST.get("duration", "") or "")
        except ValueError as exc:
            self.message_user(request, f"Pause not applied: {exc}", messages.ERROR)
            return None

    @admin.action(description="Pause the selected keys for the given duration", permissions=["change"])
    def pause(self, request: HttpRequest, queryset: QuerySet) -> None:
        duration = self._duration(request)
        if duration is None:
            return
        keys = sorted(set(queryset.values_list("key", flat=True)))
        for key in keys:
            until = RateLimit.objects.pause_key(key, duration)
        _log_change(request, queryset, f"Paused for {format_duration(duration)}")
        self.message_user(
            request,
            ngettext("%(n)d key paused until %(until)s.", "%(n)d keys paused until %(until)s.", len(keys))
            % {"n": len(keys), "until": format_moment(until, db_now())},
        )

    @admin.action(description="Resume the selected keys", permissions=["change"])
    def resume(self, request: HttpRequest, queryset: QuerySet) -> None:
        lifted = sum(RateLimit.objects.resume_key(k) for k in set(queryset.values_list("key", flat=True)))
        if lifted:
            _log_change(request, queryset, "Resumed")
        self.message_user(request, ngettext("%d pause lifted.", "%d pauses lifted.", lifted) % lifted)


# The admin index says whether dispensers and workers run and links the dashboard
# (a project with its own index template keeps it).
if admin.site.index_template is None:
    admin.site.index_template = "admin/dispatcher/index.html"


@admin.register(LearntLimit)
class LearntLimitAdmin(admin.ModelAdmin):
    """Limits the APIs announced in their answers; the dispatcher writes them, nobody edits them."""

    list_display = ("key", "limit", "period", "expires_at", "source", "signal", "observed_at")
    search_fields = ("key",)
    readonly_fields = list_display

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False
