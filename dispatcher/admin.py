"""The admin: calls (read-only, retry/cancel), rate limits (live usage, pause/resume), a dashboard."""
from __future__ import annotations

import json
import threading
from datetime import timedelta
from typing import Any

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.helpers import ActionForm
from django.core.exceptions import PermissionDenied
from django.db.models import Q, QuerySet
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.utils.html import format_html, format_html_join
from django.utils.translation import ngettext

from dispatcher import status as live
from dispatcher.clock import db_now
from dispatcher.durations import format_duration, parse_positive_duration
from dispatcher.keys import is_pattern, pattern_matches, validate_policy_key
from dispatcher.models import CallQueue, KeyState, RateLimit
from dispatcher.redact import redact


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
            ("done", "Done"),
            ("failed", "Failed (gave up)"),
            ("cancelled", "Cancelled"),
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
            return queryset.in_flight()
        if value in {"done", "failed", "cancelled"}:
            return queryset.filter(status=value)
        return queryset


class KeyFilter(admin.SimpleListFilter):
    """Calls that carry one key (keys with a policy or known to the limiter)."""

    title = "key"
    parameter_name = "key"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        known = set(KeyState.objects.exclude(key__endswith="*").values_list("key", flat=True)[:200])
        known.update(k for k in RateLimit.objects.values_list("key", flat=True) if not is_pattern(k))
        if self.value():
            known.add(self.value())
        return [(k, k) for k in sorted(known)]

    def queryset(self, request: HttpRequest, queryset: QuerySet) -> QuerySet:
        if not self.value():
            return queryset
        # key_set is the sorted keys as JSON text, so the quoted key matches one element exactly.
        return queryset.filter(key_set__contains=json.dumps(self.value()))


class ReadOnlyAdminMixin:
    """Calls are changed only by the dispatcher and by the actions, never by hand."""

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        return list(self.fields or [])


@admin.register(CallQueue)
class CallQueueAdmin(ReadOnlyAdminMixin, admin.ModelAdmin):
    list_display = ["id", "method", "state_label", "keys_label", "attempts_label", "age", "next_try"]
    list_filter = [CallStateFilter, "status", "method", KeyFilter]
    search_fields = ["method"]
    search_help_text = "Search by call id or by text in the method or params."
    ordering = ["-id"]
    list_per_page = 50
    show_full_result_count = False
    actions = ["retry_now", "cancel"]
    fields = [
        "method", "state_label", "why_waiting", "keys_label", "cost_label", "priority", "queue", "attempts_label", "deferrals",
        "run_at", "created_at", "dispatched_at", "started_at", "finished_at", "params_shown", "result_shown",
        "last_error", "traceback_shown", "attempt_history",
    ]

    def get_search_results(self, request: HttpRequest, queryset: QuerySet, search_term: str) -> tuple[QuerySet, bool]:
        term = search_term.strip()
        if not term:
            return queryset, False
        query = Q(method__icontains=term) | Q(params__icontains=term)
        if term.lstrip("#").isdigit():
            query |= Q(id=int(term.lstrip("#")))
        return queryset.filter(query), False

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
        return f"{call.attempts}/{call.max_attempts}"

    @admin.display(description="age", ordering="created_at")
    def age(self, call: CallQueue) -> str:
        end = call.finished_at or db_now()
        return live.humanize_duration(end - call.created_at) if call.created_at else "-"

    @admin.display(description="next try", ordering="run_at")
    def next_try(self, call: CallQueue) -> str:
        if call.status != CallQueue.Status.PENDING:
            return "-"
        return live.humanize(call.run_at, db_now())

    @admin.display(description="why it waits")
    def why_waiting(self, call: CallQueue) -> str:
        explanation = live.explain_call(call)
        if not explanation.waiting:
            return "not waiting"
        if not explanation.reasons:
            return "due now: the next dispense pass will send it"
        if explanation.until is None:
            until = "until a call in flight finishes"
        else:
            until = f"until {explanation.until:%Y-%m-%d %H:%M:%S} UTC ({live.humanize(explanation.until, explanation.now)})"
        items = format_html_join("", "<li>{}</li>", ((r.text,) for r in explanation.reasons))
        return format_html("<ul class='why-waiting'>{}</ul><p>Waits {}.</p>", items, until)

    @admin.display(description="params")
    def params_shown(self, call: CallQueue) -> str:
        return _pretty_json(call.params)

    @admin.display(description="result")
    def result_shown(self, call: CallQueue) -> str:
        return _pretty_json(call.result) if call.result is not None else "-"

    @admin.display(description="traceback")
    def traceback_shown(self, call: CallQueue) -> str:
        return format_html("<pre>{}</pre>", call.last_traceback) if call.last_traceback else "-"

    @admin.display(description="attempt history")
    def attempt_history(self, call: CallQueue) -> str:
        attempts = list(call.attempt_set.order_by("id"))
        if not attempts:
            return "no attempt yet"
        rows = format_html_join(
            "",
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            (
                (a.number, f"{a.started_at:%Y-%m-%d %H:%M:%S.%f}"[:-3],
                 format_duration(a.finished_at - a.started_at) if a.finished_at else "-",
                 a.get_outcome_display(), a.error[:500] or "-", a.worker or "-")
                for a in attempts
            ),
        )
        return format_html(
            "<table class='attempts'><thead><tr><th>#</th><th>started</th><th>took</th><th>outcome</th>"
            "<th>error</th><th>worker</th></tr></thead><tbody>{}</tbody></table>",
            rows,
        )

    @admin.action(description="Retry now (failed calls get one more attempt)", permissions=["change"])
    def retry_now(self, request: HttpRequest, queryset: QuerySet) -> None:
        eligible = list(queryset.filter(status__in=[CallQueue.Status.PENDING, CallQueue.Status.FAILED]).values_list("id", flat=True))
        skipped = queryset.count() - len(eligible)
        done = CallQueue.objects.retry_now(eligible)
        self.message_user(request, ngettext("%d call will be retried now.", "%d calls will be retried now.", done) % done)
        if skipped:
            self.message_user(
                request,
                ngettext("%d call was not waiting or failed and was left alone.",
                         "%d calls were not waiting or failed and were left alone.", skipped) % skipped,
                messages.WARNING,
            )

    @admin.action(description="Cancel (waiting calls only)", permissions=["change"])
    def cancel(self, request: HttpRequest, queryset: QuerySet) -> None:
        ids = list(queryset.values_list("id", flat=True))
        done = CallQueue.objects.cancel(ids)
        self.message_user(request, ngettext("%d call cancelled.", "%d calls cancelled.", done) % done)
        if len(ids) - done:
            skipped = len(ids) - done
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
        from dispatcher.policies import PolicyError, validate

        data = super().clean()
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


@admin.register(RateLimit)
class RateLimitAdmin(admin.ModelAdmin):
    form = RateLimitForm
    action_form = PauseActionForm
    list_display = ["key", "policy_label", "usage", "in_flight", "waiting", "oldest_wait", "paused_until", "next_free_slot"]
    search_fields = ["key"]
    actions = ["pause", "resume"]

    def changelist_view(self, request: HttpRequest, extra_context: dict | None = None) -> HttpResponse:
        # One read of the live state per page, shared by every row's columns.
        # Kept per thread: the admin instance is shared by every request.
        _page.statuses = {s.key: s for s in live.key_statuses()}
        try:
            response = super().changelist_view(request, extra_context)
            if hasattr(response, "render"):
                response.render()  # while the statuses are set: the columns read them
            return response
        finally:
            _page.statuses = {}

    def save_model(self, request: HttpRequest, obj: RateLimit, form: forms.Form, change: bool) -> None:
        from django.db import transaction

        with transaction.atomic():
            if change:
                # A new key or period is a new policy: set_policy upserts by (key, period).
                RateLimit.objects.filter(pk=obj.pk).exclude(key=obj.key, period=obj.period).delete()
            saved = RateLimit.objects.set_policy(obj.key, obj.limit, obj.period, obj.concurrency, burst=obj.burst)
        obj.pk = saved.pk

    def _statuses(self, policy: RateLimit) -> list[live.KeyStatus]:
        statuses = getattr(_page, "statuses", {})
        if not is_pattern(policy.key):
            return [statuses[policy.key]] if policy.key in statuses else []
        return [s for k, s in statuses.items() if pattern_matches(policy.key, k) and s.governed_by == policy.key]

    def _use(self, status: live.KeyStatus, policy: RateLimit) -> live.PolicyUse | None:
        return next((p for p in status.policies if p.period == policy.period and p.policy_key == policy.key), None)

    @admin.display(description="policy")
    def policy_label(self, policy: RateLimit) -> str:
        return policy.as_policy().label()

    @admin.display(description="used now")
    def usage(self, policy: RateLimit) -> str:
        statuses = self._statuses(policy)
        uses = [(s.key, u) for s in statuses if (u := self._use(s, policy))]
        if not uses:
            return f"0/{policy.as_policy().capacity()}"
        key, busiest = max(uses, key=lambda item: item[1].used)
        text = f"{busiest.used}/{busiest.capacity}"
        return f"{text} (busiest: {key})" if is_pattern(policy.key) else text

    @admin.display(description="in flight")
    def in_flight(self, policy: RateLimit) -> str:
        total = sum(s.in_flight for s in self._statuses(policy))
        return f"{total}/{policy.concurrency}" if policy.concurrency else str(total)

    @admin.display(description="waiting")
    def waiting(self, policy: RateLimit) -> int:
        return sum(s.waiting for s in self._statuses(policy))

    @admin.display(description="oldest wait")
    def oldest_wait(self, policy: RateLimit) -> str:
        waits = [s.oldest_wait for s in self._statuses(policy) if s.oldest_wait is not None]
        return live.humanize_duration(max(waits)) if waits else "-"

    @admin.display(description="paused until")
    def paused_until(self, policy: RateLimit) -> str:
        state = KeyState.objects.filter(key=policy.key, paused_until__gt=db_now()).first()
        if state is None:
            pauses = [s for s in self._statuses(policy) if s.paused_until]
            if not pauses:
                return "-"
            latest = max(pauses, key=lambda s: s.paused_until)
            return f"{latest.paused_until:%H:%M:%S} ({live.humanize(latest.paused_until, latest.now)})"
        return f"{state.paused_until:%H:%M:%S} ({live.humanize(state.paused_until, db_now())})"

    @admin.display(description="next free slot")
    def next_free_slot(self, policy: RateLimit) -> str:
        statuses = self._statuses(policy)
        blocked = [s for s in statuses if s.blocked]
        if not blocked:
            return "now"
        if any(s.next_free_at is None for s in blocked):
            return "when a call in flight finishes"
        latest = max(blocked, key=lambda s: s.next_free_at)
        return live.humanize(latest.next_free_at, latest.now)

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
        self.message_user(
            request,
            ngettext("%(n)d key paused until %(until)s.", "%(n)d keys paused until %(until)s.", len(keys))
            % {"n": len(keys), "until": f"{until:%Y-%m-%d %H:%M:%S} UTC"},
        )

    @admin.action(description="Resume the selected keys", permissions=["change"])
    def resume(self, request: HttpRequest, queryset: QuerySet) -> None:
        lifted = sum(RateLimit.objects.resume_key(k) for k in set(queryset.values_list("key", flat=True)))
        self.message_user(request, ngettext("%d pause lifted.", "%d pauses lifted.", lifted) % lifted)


# --- dashboard -----------------------------------------------------------------------------

CHART_WIDTH, CHART_HEIGHT, CHART_PAD = 600, 160, 30


def chart(status: live.KeyStatus) -> dict[str, Any]:
    """Lay out one key's bar chart of starts per minute (last hour) with its limit line, as SVG numbers."""
    series = live.starts_per_minute(status.key, now=status.now)
    peak = max([n for _, n in series] + [1])
    limit_line = min((p.per_minute for p in status.policies), default=None)
    top = max(peak, limit_line or 0) * 1.15
    inner_w, inner_h = CHART_WIDTH - CHART_PAD, CHART_HEIGHT - CHART_PAD
    slot = inner_w / len(series)
    bars = []
    for i, (minute, n) in enumerate(series):
        height = inner_h * n / top
        bars.append({
            "x": round(CHART_PAD + i * slot + 1, 1), "y": round(inner_h - height + 5, 1),
            "w": round(max(slot - 2, 1), 1), "h": round(height, 1), "n": n, "minute": f"{minute:%H:%M}",
        })
    line_y = round(inner_h - inner_h * limit_line / top + 5, 1) if limit_line else None
    return {
        "width": CHART_WIDTH, "height": CHART_HEIGHT, "pad": CHART_PAD, "bars": bars, "peak": peak,
        "total": sum(n for _, n in series), "limit_per_minute": round(limit_line, 2) if limit_line else None,
        "line_y": line_y, "axis_y": inner_h + 5, "top_label": round(top), "first": bars[0]["minute"], "last": bars[-1]["minute"],
    }


def dashboard_view(request: HttpRequest) -> HttpResponse:
    """Per key: starts per minute over the last hour against the limit, backlog and drain estimate."""
    if not (request.user.has_perm("dispatcher.view_callqueue") or request.user.has_perm("dispatcher.view_ratelimit")):
        raise PermissionDenied
    rows = []
    for status in live.key_statuses():
        rows.append({
            "status": status,
            "chart": chart(status),
            "policies": ", ".join(p.label() for p in status.policies) or "no limit",
            "oldest_wait": live.humanize_duration(status.oldest_wait),
            "drain": live.humanize_duration(status.drain_time) if status.waiting else "-",
            "next_free": live.humanize(status.next_free_at, status.now),
            "paused": live.humanize(status.paused_until, status.now) if status.paused_until else "",
        })
    context = {**admin.site.each_context(request), "title": "Dispatcher dashboard", "rows": rows}
    return TemplateResponse(request, "admin/dispatcher/dashboard.html", context)

