"""The rate limits' admin (live use, pause and resume, edits through the limiter) and the learnt limits'."""
from __future__ import annotations

import threading
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.helpers import ActionForm
from django.contrib.admin.views.main import ChangeList
from django.db.models import Min, QuerySet
from django.http import HttpRequest, HttpResponse
from django.urls import URLPattern, path, reverse
from django.utils.html import format_html, format_html_join
from django.utils.translation import ngettext

from dispatcher import liveness, waits
from dispatcher import status as live
from dispatcher.clock import db_now
from dispatcher.durations import format_duration, format_moment, humanize, humanize_duration, parse_positive_duration
from dispatcher.keys import is_pattern, pattern_matches, validate_policy_key
from dispatcher.limits.shapes import PolicyError, validate
from dispatcher.models import KeyState, LearntLimit, RateLimit

if TYPE_CHECKING:
    pass

from dispatcher.admin.common import ButtonsMixin, ModelAdmin, ModelForm, RefuseUnstorableMixin, _log_change
from dispatcher.limits import edit


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


class RateLimitForm(ModelForm):
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

    def get_queryset(self, request: HttpRequest, exclude_parameters: Any = None) -> QuerySet[Any]:
        firsts = RateLimit.objects.values("key").annotate(first=Min("id")).values("first")
        return super().get_queryset(request, exclude_parameters).filter(id__in=firsts)


@admin.register(RateLimit)
class RateLimitAdmin(RefuseUnstorableMixin, ButtonsMixin, ModelAdmin):
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

    def get_urls(self) -> list[URLPattern]:
        urls = [
            path("<int:policy_id>/pause/", self.admin_site.admin_view(self.pause_view), name="dispatcher_ratelimit_pause"),
            path("<int:policy_id>/resume/", self.admin_site.admin_view(self.resume_view), name="dispatcher_ratelimit_resume"),
        ]
        return urls + super().get_urls()

    def pause_view(self, request: HttpRequest, policy_id: int) -> HttpResponse:
        return self._button(request, policy_id, "pause")

    def resume_view(self, request: HttpRequest, policy_id: int) -> HttpResponse:
        return self._button(request, policy_id, "resume")


    def changelist_view(self, request: HttpRequest, extra_context: dict[str, Any] | None = None) -> HttpResponse:
        # One read of the live state per page, shared by every row's columns.
        # Kept per thread: the admin instance is shared by every request.
        _page.statuses = {s.key: s for s in live.key_statuses()}
        _page.policies = {}
        for policy in RateLimit.objects.order_by("key", "period"):
            _page.policies.setdefault(policy.key, []).append(policy)
        # A free slot sends nothing while no dispenser runs: say so where the slot is read.
        _page.free_now = "now, but no dispenser runs" if liveness.read().problem(liveness.DISPENSER) else "now"
        try:
            response = super().changelist_view(request, {"title": "Rate limits", **(extra_context or {})})
            if hasattr(response, "render"):
                response.render()  # while the statuses are set: the columns read them
            return response
        finally:
            _page.statuses, _page.policies, _page.free_now = {}, {}, "now"

    def changeform_view(self, request: HttpRequest, object_id: str | None = None, form_url: str = "", extra_context: dict[str, Any] | None = None) -> HttpResponse:
        policy = RateLimit.objects.filter(pk=object_id).first() if object_id and object_id.isdigit() and len(object_id) < 19 else None
        extra: dict[str, Any] = {"title": f"Rate limit of {policy.key}" if policy else ("Add a rate limit" if object_id is None else "Rate limit")}
        if policy is not None and request.method == "GET":
            # The live use the list shows for the key, read the same way (status.py), once.
            _page.statuses = {s.key: s for s in live.key_statuses(None if is_pattern(policy.key) else [policy.key])}
            _page.policies = {policy.key: list(RateLimit.objects.filter(key=policy.key).order_by("period"))}
            _page.free_now = "now, but no dispenser runs" if liveness.read().problem(liveness.DISPENSER) else "now"
            paused = self.paused_until(policy)
            extra.update(paused=paused != "-", live=[
                ("policies: used now", self.policy_label(policy)), ("in flight", self.in_flight(policy)),
                ("waiting", self.waiting(policy)), ("oldest wait", self.oldest_wait(policy)),
                ("paused until (by whom)", paused), ("next free slot", self.next_free_slot(policy)),
            ])
        try:
            response = super().changeform_view(request, object_id, form_url, {**extra, **(extra_context or {})})
            if hasattr(response, "render"):
                response.render()
            return response
        finally:
            _page.statuses, _page.policies, _page.free_now = {}, {}, "now"

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type:
        return KeyChangeList

    def get_actions(self, request: HttpRequest, action_location: Any = None) -> dict[str, Any]:
        # A row stands for every policy of its key: deleting "the selected" would delete one of
        # them. A policy is deleted from its own page. (``action_location``: Django 6.1 passes
        # where the actions show, and warns of an override without it; earlier versions do not.)
        if action_location is None:
            actions = super().get_actions(request)
        else:
            actions = super().get_actions(request, action_location=action_location)  # type: ignore[call-arg]
        actions.pop("delete_selected", None)
        return actions

    def save_model(self, request: HttpRequest, obj: RateLimit, form: forms.Form, change: bool) -> None:
        # The manager's edits lock the key and wake the dispensers, as the command's do.
        saved = edit.set_policy(
            obj.key, obj.limit, obj.period, obj.concurrency, burst=obj.burst, replacing=obj.pk if change else None
        )
        obj.pk = saved.pk

    def delete_model(self, request: HttpRequest, obj: RateLimit) -> None:
        edit.delete_policies(obj.key, obj.period)

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[RateLimit]) -> None:
        for key, period in queryset.values_list("key", "period"):
            edit.delete_policies(key, period)

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
    def pause(self, request: HttpRequest, queryset: QuerySet[Any]) -> None:
        duration = self._duration(request)
        if duration is None:
            return
        keys = sorted(set(queryset.values_list("key", flat=True)))
        for key in keys:
            until = edit.pause_key(key, duration)
        _log_change(request, queryset, f"Paused for {format_duration(duration)}")
        self.message_user(
            request,
            ngettext("%(n)d key paused until %(until)s.", "%(n)d keys paused until %(until)s.", len(keys))
            % {"n": len(keys), "until": format_moment(until, db_now())},
        )

    @admin.action(description="Resume the selected keys", permissions=["change"])
    def resume(self, request: HttpRequest, queryset: QuerySet[Any]) -> None:
        lifted = sum(edit.resume_key(k) for k in set(queryset.values_list("key", flat=True)))
        if lifted:
            _log_change(request, queryset, "Resumed")
        self.message_user(request, ngettext("%d pause lifted.", "%d pauses lifted.", lifted) % lifted)


@admin.register(LearntLimit)
class LearntLimitAdmin(RefuseUnstorableMixin, ModelAdmin):
    """Limits the APIs announced in their answers; the dispatcher writes them, nobody edits them."""

    list_display = ("key", "limit", "period", "expires_at", "source", "signal", "observed_at")
    search_fields = ("key",)
    readonly_fields = list_display

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False
