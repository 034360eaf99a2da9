"""Failed calls and calls waiting for a retry, grouped in SQL by key set, state and error class.

The error class is computed by the database from the stored error (``error_class``), so that a
group is one ``GROUP BY`` row and a bulk action selects the same calls the group counted.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import datetime

from django.db.models import Case, CharField, Count, Max, Min, Q, QuerySet, Value, When, Window
from django.db.models.functions import Coalesce, StrIndex, Substr
from django.db.models.lookups import Contains, LessThanOrEqual, StartsWith

from dispatcher.keys import key_in_set, parse_key_set
from dispatcher.models import CallQueue
from dispatcher.neterrors import KINDS, TOO_LARGE
from dispatcher.redact import redact_text
from dispatcher.states import CallStatus

# The two states the view shows, in the calls' own vocabulary (CallStatus labels).
FAILED = "failed"
RETRYING = "retrying"
STATES = {FAILED: CallStatus.FAILED.label, RETRYING: f"{CallStatus.PENDING.label} for a retry"}
# Groups on one page; the view pages beyond.
PER_PAGE = 50
# The farthest page a query string may ask for: groups are key sets times classes, rarely thousands.
MAX_PAGE = 1000
# Calls one bulk retry or cancel acts on (oldest first); a larger group takes another click.
BULK_MAX = 10_000
# The longest class kept: an exception's dotted path fits; a stored text without one is cut.
CLASS_CHARS = 120

# The stored error starts with the exception's dotted class path and ": " (worker._class_path);
# the message follows.
NETWORK_KINDS = [kind for _, kind in KINDS] + [TOO_LARGE]
NO_KIND = "network failure (kind not shown)"
UNCLASSIFIED = "(unclassified)"


def error_class() -> Case:
    """Return the SQL expression of a call's error class, the one definition the failures view groups by.

    From the stored ``last_error`` ("<exception class>: <message>"), first match wins:

    - ``HTTP 5xx`` (``4xx``, ``3xx``): the message starts with the http handler's "HTTP 503";
    - a network failure's kind (``connection refused``, ``timeout``, ``TLS``, ``too large``...)
      where the http handler's message names it ("http: api.example.com: connection refused": an
      endpoint the allow-list names exactly, docs/http.md), and ``network failure (kind not
      shown)`` where it reads "no usable answer";
    - ``HTTP 429 (rate limited)``, ``lost (no result in time)``, ``unreadable row``;
    - else the exception's class as the worker stored it (the text before the first ": "), cut to
      ``CLASS_CHARS``, if it reads like one (no space, at most ``CLASS_CHARS``); ``(unclassified)``
      for any other text (a row not written by a worker: its text is never shown as a class),
      ``(no error text)`` for an empty error.

    Prefix and substring tests only (no regular expression): the database runs them on every
    failing call of every page.
    """
    split = StrIndex("last_error", Value(": "))
    message = Substr("last_error", split + 2)  # worked out only for errors the outer tests let through
    prefix = Substr("last_error", 1, split - 1)
    class_path = Case(
        When(Q(LessThanOrEqual(split, CLASS_CHARS + 1)) & ~Q(Contains(prefix, " ")), then=prefix),
        default=Value(UNCLASSIFIED),
    )
    http_status = Case(
        *(When(StartsWith(message, f"HTTP {family}"), then=Value(f"HTTP {family}xx")) for family in "543"),
        default=class_path,
    )
    network = Case(
        When(~Q(StartsWith(message, "http: ")), then=class_path),
        *(When(Contains(message, f": {kind}"), then=Value(kind)) for kind in NETWORK_KINDS),
        When(StartsWith(message, "http: no usable answer from "), then=Value(NO_KIND)),
        default=class_path,
    )
    # Cheap tests on the whole text first, so that most errors never reach the inner cases.
    whens = [
        When(last_error="", then=Value("(no error text)")),
        When(last_error__startswith="RateLimited: ", then=Value("HTTP 429 (rate limited)")),
        When(last_error__startswith="lost: ", then=Value("lost (no result in time)")),
        When(last_error__startswith="unreadable row", then=Value("unreadable row")),
        When(last_error__contains=": HTTP ", then=http_status),
        When(last_error__contains=": http: ", then=network),
        When(last_error__contains=": ", then=class_path),
    ]
    return Case(*whens, default=Value(UNCLASSIFIED), output_field=CharField())


def _state() -> Case:
    return Case(When(status=CallStatus.FAILED, then=Value(FAILED)), default=Value(RETRYING), output_field=CharField())


def failing(state: str = "") -> QuerySet[CallQueue]:
    """Return failed calls and waiting calls that failed before (attempts > 0, an error stored)."""
    retrying = Q(status=CallStatus.PENDING, attempts__gt=0) & ~Q(last_error="")
    condition = {FAILED: Q(status=CallStatus.FAILED), RETRYING: retrying}.get(state, Q(status=CallStatus.FAILED) | retrying)
    return CallQueue.objects.filter(condition)


@dataclass(frozen=True)
class Group:
    """One key set's calls in one state with one error class."""

    key_set: str
    state: str
    error_class: str
    count: int
    first_seen: datetime | None
    last_seen: datetime | None
    example: int
    example_error: str = ""

    @property
    def keys(self) -> list[str]:
        return parse_key_set(self.key_set)

    @property
    def state_label(self) -> str:
        return STATES[self.state]


@dataclass(frozen=True)
class GroupPage:
    groups: list[Group]
    total: int
    page: int

    @property
    def pages(self) -> int:
        return max(1, -(-self.total // PER_PAGE))


def groups(key: str = "", state: str = "", page: int = 1) -> GroupPage:
    """Return one page of groups, the largest first, with each group's newest call as its example (two queries).

    One scan of the failing calls, grouped by the database: failed calls stay only as long as
    ``DISPATCHER_RETENTION`` (``prune``), which bounds it; the page shows ``PER_PAGE`` groups.
    """
    calls = failing(state)
    if key:
        calls = calls.filter(key_set__contains=key_in_set(key))
    rows = (
        calls.annotate(error_class=error_class(), state=_state(), seen=Coalesce("finished_at", "started_at", "created_at"))
        .values("key_set", "state", "error_class")
        .annotate(count=Count("id"), first_seen=Min("seen"), last_seen=Max("seen"), example=Max("id"))
        # How many groups in all, from the same grouping (counted over the groups, before the page's LIMIT).
        .annotate(groups=Window(Count(Value(1))))
        .order_by("-count", "key_set", "state", "error_class")
    )
    start = (min(max(page, 1), MAX_PAGE) - 1) * PER_PAGE
    found_rows = list(rows[start : start + PER_PAGE])
    total = found_rows[0]["groups"] if found_rows else (rows.count() if start else 0)
    found = [Group(**{k: v for k, v in row.items() if k != "groups"}) for row in found_rows]
    errors = dict(CallQueue.objects.filter(id__in=[g.example for g in found]).values_list("id", "last_error")) if found else {}
    return GroupPage([_with_error(g, errors.get(g.example, "")) for g in found], total, page)


def _with_error(group: Group, error: str) -> Group:
    lines = redact_text(error).strip().splitlines()
    text = lines[0] if lines else ""
    return replace(group, example_error=text[:160] + "…" if len(text) > 160 else text)


def group_calls(key_set: str, state: str, error: str) -> QuerySet[CallQueue]:
    """Return the calls of one group, as ``groups`` counted them."""
    return failing(state).filter(key_set=key_set).annotate(error_class=error_class()).filter(error_class=error)


def group_ids(key_set: str, state: str, error: str, limit: int = BULK_MAX) -> list[int]:
    """Return the ids of a group's oldest ``limit`` calls."""
    return list(group_calls(key_set, state, error).order_by("id").values_list("id", flat=True)[:limit])

