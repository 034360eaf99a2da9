"""What the app's admin pages share: read-only and button mixins, refusing lookups a page does not offer, key suggestions."""
from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from django import forms
from django.contrib import admin
from django.contrib.admin import helpers
from django.contrib.admin.models import CHANGE, LogEntry
from django.contrib.admin.utils import flatten
from django.contrib.admin.views.main import SEARCH_VAR
from django.core.exceptions import PermissionDenied
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseBadRequest, HttpResponseRedirect
from django.shortcuts import get_object_or_404
from django.urls import reverse
from django.utils.html import format_html

from dispatcher.keys import is_pattern, parse_key_set
from dispatcher.models import CallQueue, KeyState, RateLimit
from dispatcher.redact import redact

if TYPE_CHECKING:
    pass


if TYPE_CHECKING:
    # Generic in the type stubs only: Django's classes take no parameters at run time.
    ModelAdmin = admin.ModelAdmin[Any]
    ModelForm = forms.ModelForm[Any]
else:
    ModelAdmin = admin.ModelAdmin
    ModelForm = forms.ModelForm

MAX_ID = 2**63 - 1
# The longest search a list takes: SQLite refuses a LIKE pattern past 50,000 bytes (a 500); 5,000
# characters stay under it however they are written (4 bytes each at most, or 2 once escaped).
MAX_SEARCH = 5000


def _log_change(request: HttpRequest, queryset: QuerySet[Any], message: str) -> None:
    """Leave admin history: who did what to which calls or policies, one entry per row."""
    user_id = request.user.pk
    if user_id is None:  # the admin's views let only a logged-in staff user this far
        raise PermissionDenied
    LogEntry.objects.log_actions(user_id, queryset, CHANGE, message)


def _pretty_json(value: Any) -> str:
    return format_html("<pre>{}</pre>", json.dumps(redact(value), indent=2, sort_keys=True, default=str))


class RefuseUnstorableMixin(ModelAdmin):
    """Apply only the filters a list offers; answer 400 to a NUL, a selected id past bigint, or a
    search or filter value longer than ``MAX_SEARCH`` characters.

    Django's ``lookup_allowed`` accepts any lookup on a local field from the query string
    (``?params__json__password__startswith=h``, ``?last_error__regex=``, ``?run_at__year=99999``):
    a view-only user could read a redacted value one character at a time, or make a 500. Here
    a list takes exactly the parameters of its ``list_filter`` (and ``date_hierarchy``); any other
    lookup is refused with a 400 (Django's ``DisallowedModelAdminLookup``) before a query runs.
    Django passes filter values and selected ids to the database as they come; PostgreSQL
    refuses a NUL in text, SQLite an integer past 64 bits, and either would answer 500.
    """

    def offered_lookups(self, request: HttpRequest | None) -> set[str]:
        """Return the query-string parameters this list's filters read, and no other."""
        offered: set[str] = set()
        for item in self.get_list_filter(request) if request is not None else self.list_filter:
            if isinstance(item, type) and issubclass(item, admin.SimpleListFilter):
                offered.add(str(item.parameter_name))
            else:
                name = str(item[0] if isinstance(item, (list, tuple)) else item)
                offered.update({name, f"{name}__exact", f"{name}__isnull"})  # the bare name is __exact
        if self.date_hierarchy:
            offered.update(f"{self.date_hierarchy}__{part}" for part in ("year", "month", "day"))
        return offered

    def lookup_allowed(self, lookup: str, value: str, request: HttpRequest | None = None) -> bool:
        return lookup in self.offered_lookups(request)

    def changelist_view(self, request: HttpRequest, extra_context: dict[str, Any] | None = None) -> HttpResponse:
        for params in (request.GET, request.POST):
            if any("\x00" in name or any("\x00" in value for value in values) for name, values in params.lists()):
                return HttpResponseBadRequest("A query or form value holds a NUL character.", content_type="text/plain")
        # Every value, not only the search: a filter's value becomes a LIKE pattern too (?key=).
        for name, values in request.GET.lists():
            if any(len(value) > MAX_SEARCH for value in values):
                what = "A search" if name == SEARCH_VAR else f"The value of {name[:100]!r}"
                return HttpResponseBadRequest(f"{what} is at most {MAX_SEARCH} characters.", content_type="text/plain")
        for value in request.POST.getlist(helpers.ACTION_CHECKBOX_NAME):
            if not (value.isascii() and value.isdigit() and len(value) <= 19 and int(value) <= MAX_ID):
                return HttpResponseBadRequest("Selected ids must be whole numbers of a row.", content_type="text/plain")
        return super().changelist_view(request, extra_context)


def known_keys(term: str, limit: int = 20) -> list[str]:
    """Return up to ``limit`` keys containing ``term``: keys with a policy, limiter state or waiting calls."""
    found = set(KeyState.objects.filter(key__icontains=term).exclude(key__endswith="*").values_list("key", flat=True)[:limit])
    found.update(k for k in RateLimit.objects.filter(key__icontains=term).values_list("key", flat=True) if not is_pattern(k))
    if len(found) < limit:
        for text in CallQueue.objects.pending().filter(key_set__icontains=term).values_list("key_set", flat=True)[:200]:
            found.update(k for k in parse_key_set(text) if term.lower() in k.lower())
    return sorted(found)[:limit]


class ButtonsMixin(ModelAdmin):
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


class ReadOnlyAdminMixin(ModelAdmin):
    """Calls are changed only by the dispatcher and by the actions, never by hand."""

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        return flatten(self.fields or [])
