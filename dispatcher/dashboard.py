"""The admin dashboard: per key, starts per minute over the last hour against its limits, and the backlog.

Scales to hundreds of keys: keys are sorted by pressure (blocked first, then the busiest),
filtered and paginated; the live status is read for every key in one pass (``key_statuses``),
but charts are laid out only for the keys of the page shown, from two grouped queries (starts
per key and minute; attempts per key set, minute and outcome), with the SVG bars written here
rather than by a template loop.
"""
from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any
from urllib.parse import urlencode

from django.contrib import admin
from django.core.exceptions import PermissionDenied
from django.core.paginator import Paginator
from django.db.models import Count, Q, Sum
from django.db.models.functions import TruncMinute
from django.http import HttpRequest, HttpResponse, HttpResponseBadRequest
from django.template.response import TemplateResponse
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString

from dispatcher import liveness
from dispatcher import status as live
from dispatcher.clock import db_now
from dispatcher.durations import format_moment, humanize_duration
from dispatcher.keys import key_in_set, parse_key_set
from dispatcher.models import Attempt, StartLog

PER_PAGE = 20
MINUTES = 60
DEFAULT_REFRESH = 30
# How attempt outcomes are drawn: a bar's segments from the bottom, and their legend.
SEGMENTS = (("done", "done"), ("error", "error"), ("429", "429 deferred"), ("running", "running"))
OUTCOME_SEGMENT = {"done": "done", "error": "error", "failed": "error", "lost": "error",
                   "rate_limited": "429", "running": "running"}

CHART_WIDTH, CHART_HEIGHT, CHART_PAD = 600, 160, 30


def chart(status: live.KeyStatus, minutes: list[tuple[datetime, int, dict[str, int]]] | None = None) -> dict[str, Any]:
    """Lay out one key's bar chart of starts per minute (last hour) with its limit line, as SVG numbers.

    ``minutes`` is (minute, starts, attempts by segment) per minute, oldest first; a bar is as
    tall as the starts the limiter counted, its segments the outcomes of the attempts started.
    """
    if minutes is None:
        minutes = [(m, n, {}) for m, n in live.starts_per_minute(status.key, now=status.now, minutes=MINUTES)]
    series = [(m, max(n, sum(parts.values()))) for m, n, parts in minutes]
    peak = max([n for _, n in series] + [1])
    # Only a policy that bounds a minute is drawn against starts per minute (a window of at most
    # a minute, a bucket's sustained rate); a longer window gets its own panel (policy_panels).
    limit_line = min((p.per_minute for p in status.policies if on_bar_chart(p)), default=None)
    top = max(peak, limit_line or 0) * 1.15
    inner_w, inner_h = CHART_WIDTH - CHART_PAD, CHART_HEIGHT - CHART_PAD
    slot = inner_w / len(series)
    bars = []
    for i, ((minute, n), (_, _, parts)) in enumerate(zip(series, minutes, strict=True)):
        height = inner_h * n / top
        x, w = round(CHART_PAD + i * slot + 1, 1), round(max(slot - 2, 1), 1)
        segments: list[tuple[str, float, float, float, float, int]] = []
        base: float = inner_h + 5
        for name, _label in SEGMENTS:
            count = parts.get(name, 0)
            if count:
                h = inner_h * count / top
                base -= h
                segments.append((name, x, round(base, 1), w, round(h, 1), count))
        bars.append({
            "x": x, "y": round(inner_h - height + 5, 1), "w": w, "h": round(height, 1), "n": n,
            "minute": f"{minute:%H:%M}", "segments": segments,
        })
    line_y = round(inner_h - inner_h * limit_line / top + 5, 1) if limit_line else None
    return {
        "width": CHART_WIDTH, "height": CHART_HEIGHT, "pad": CHART_PAD, "bars": bars, "peak": peak,
        "total": sum(n for _, n in series), "limit_per_minute": round(limit_line, 2) if limit_line else None,
        "line_y": line_y, "axis_y": inner_h + 5, "top_label": round(top), "first": bars[0]["minute"], "last": bars[-1]["minute"],
        "svg_bars": _svg_bars(bars),
        "outcomes": {name: sum(parts.get(name, 0) for _, _, parts in minutes) for name, _ in SEGMENTS},
    }


def on_bar_chart(use: live.PolicyUse) -> bool:
    """Whether a policy is drawn as a per-minute line over the starts: a bucket, or a window of at most a minute."""
    return use.policy.shape == "bucket" or use.policy.period <= timedelta(minutes=1)


PANEL_WIDTH, PANEL_HEIGHT = 600, 56
# A window longer than this is shown by its gauge only (its series would read days of starts).
LONGEST_SERIES = timedelta(days=1)


def policy_panels(status: live.KeyStatus, units: dict[datetime, int] | None = None) -> list[dict[str, Any]]:
    """Lay out one panel per policy: its use now against its own limit, in the policy's own terms.

    A window: units started in the window (dispatched-not-started included) against the limit,
    and, for a window longer than a minute, used-in-window at the end of each minute of the last
    hour (per-minute resolution) against the limit. A bucket: tokens spent against the burst.
    ``units`` is units started per minute, reaching back one longest window before the hour.
    """
    panels = []
    end = status.now.replace(second=0, microsecond=0)
    grid = [end - timedelta(minutes=MINUTES - 1 - i) for i in range(MINUTES)]
    for use in status.policies:
        capacity = use.policy.limit if use.policy.shape == "window" else use.policy.capacity()
        panel: dict[str, Any] = {
            "shape": "token bucket" if use.policy.shape == "bucket" else "sliding window",
            "label": use.label(), "learnt": use.learnt, "usage": use.usage_text(), "used": use.committed,
            "limit": capacity, "on_bar_chart": on_bar_chart(use), "width": PANEL_WIDTH, "height": PANEL_HEIGHT,
            "gauge": round(PANEL_WIDTH * min(use.committed / capacity, 1), 1) if capacity else 0,
            "full": use.committed >= capacity, "series": None,
        }
        if units is not None and not panel["on_bar_chart"] and use.policy.period <= LONGEST_SERIES:
            span = -(-use.policy.period // timedelta(minutes=1))  # minutes, rounded up
            # Running totals over the minutes from ``span`` before the hour: a window is a difference.
            totals = [0]
            for i in range(span + MINUTES - 1):
                totals.append(totals[-1] + units.get(grid[0] - timedelta(minutes=span - 1 - i), 0))
            values = [totals[i + span] - totals[i] for i in range(MINUTES)]
            top = max(values + [capacity]) * 1.15
            def y(v: float, top: float = top) -> float:
                return round(PANEL_HEIGHT - 4 - (PANEL_HEIGHT - 8) * v / top, 1)
            step = (PANEL_WIDTH - CHART_PAD) / (MINUTES - 1)
            panel["series"] = {
                "points": " ".join(f"{round(CHART_PAD + i * step, 1)},{y(v)}" for i, v in enumerate(values)),
                "limit_y": y(capacity), "peak": max(values), "now": values[-1],
            }
        panels.append(panel)
    return panels


def window_units(statuses: list[live.KeyStatus], now: datetime) -> dict[str, dict[datetime, int]]:
    """Return units started per key and minute, as far back as each key's longest window before the hour."""
    reach: dict[str, timedelta] = {}
    for status in statuses:
        longest = [u.policy.period for u in status.policies if not on_bar_chart(u) and u.policy.period <= LONGEST_SERIES]
        if longest:
            reach[status.key] = max(longest)
    if not reach:
        return {}
    start = now.replace(second=0, microsecond=0) - timedelta(minutes=MINUTES) - max(reach.values())
    found: dict[str, dict[datetime, int]] = {key: {} for key in reach}
    rows = (
        StartLog.objects.filter(key__in=list(reach), started_at__gte=start)
        .annotate(minute=TruncMinute("started_at")).values("key", "minute").annotate(n=Sum("units")).order_by()
    )
    for row in rows:
        found[row["key"]][row["minute"]] = row["n"]
    return found


def _svg_bars(bars: list[dict[str, Any]]) -> SafeString:
    """Write the bars and their outcome segments as SVG (a template loop is ten times slower)."""
    rects = []
    for b in bars:
        rects.append(format_html(
            '<rect class="bar" x="{}" y="{}" width="{}" height="{}" data-starts="{}"><title>{}: {} started</title></rect>',
            b["x"], b["y"], b["w"], b["h"], b["n"], b["minute"], b["n"],
        ))
        rects.extend(
            format_html('<rect class="seg seg-{}" x="{}" y="{}" width="{}" height="{}" data-n="{}"><title>{}: {} {}</title></rect>',
                        name, x, y, w, h, n, b["minute"], n, name)
            for name, x, y, w, h, n in b["segments"]
        )
    return format_html_join("", "{}", ((r,) for r in rects))


def minutes_by_key(keys: list[str], now: datetime) -> dict[str, list[tuple[datetime, int, dict[str, int]]]]:
    """Return per key the last hour per minute: starts counted by the limiter and attempts by outcome."""
    end = now.replace(second=0, microsecond=0)
    start = end - timedelta(minutes=MINUTES - 1)
    starts: dict[tuple[str, datetime], int] = {}
    parts: dict[tuple[str, datetime], dict[str, int]] = {}
    if keys:
        rows = (
            StartLog.objects.filter(key__in=keys, started_at__gte=start)
            .annotate(minute=TruncMinute("started_at")).values("key", "minute").annotate(n=Count("id")).order_by()
        )
        for row in rows:
            starts[(row["key"], row["minute"])] = row["n"]
        wanted = set(keys)
        # key_set holds the sorted keys as JSON text: a quoted key matches one element exactly.
        matches = Q()
        for key in keys:
            matches |= Q(call__key_set__contains=key_in_set(key))
        attempts = (
            Attempt.objects.filter(matches, started_at__gte=start)
            .annotate(minute=TruncMinute("started_at")).values("call__key_set", "minute", "outcome")
            .annotate(n=Count("id")).order_by()
        )
        for row in attempts:
            segment = OUTCOME_SEGMENT.get(row["outcome"], "error")
            for key in parse_key_set(row["call__key_set"]):
                if key in wanted:
                    counts = parts.setdefault((key, row["minute"]), {})
                    counts[segment] = counts.get(segment, 0) + row["n"]
    grid = [start + timedelta(minutes=i) for i in range(MINUTES)]
    return {key: [(m, starts.get((key, m), 0), parts.get((key, m), {})) for m in grid] for key in keys}


def starts_last_hour(now: datetime) -> dict[str, int]:
    """Return starts in the last hour per key: how busy each key is."""
    rows = StartLog.objects.filter(started_at__gte=now - timedelta(hours=1)).values("key").annotate(n=Count("id")).order_by()
    return {row["key"]: row["n"] for row in rows}


def pressure(status: live.KeyStatus, busy: int) -> tuple[Any, ...]:
    """Sort key: blocked keys first, then by backlog, calls in flight and starts in the last hour."""
    return (not status.blocked, -status.waiting, -status.in_flight, -busy, status.key)


def dashboard_view(request: HttpRequest) -> HttpResponse:
    """Per key: starts per minute over the last hour against the limit, backlog and drain estimate."""
    if not (request.user.has_perm("dispatcher.view_callqueue") or request.user.has_perm("dispatcher.view_ratelimit")):
        raise PermissionDenied
    query = request.GET.get("q", "").strip()
    only = request.GET.get("only", "")
    if only not in ("", "blocked", "waiting"):
        return HttpResponseBadRequest("only= takes blocked or waiting")
    try:
        refresh = int(request.GET.get("refresh", DEFAULT_REFRESH))
    except ValueError:
        return HttpResponseBadRequest("refresh= takes a whole number of seconds (0: never)")
    if not 0 <= refresh <= 3600:
        return HttpResponseBadRequest("refresh= takes 0 to 3600 seconds")
    statuses = live.key_statuses()
    # A free slot sends nothing while no dispenser runs: say so where the slot is read.
    free_now = "now, but no dispenser runs" if liveness.read().problem(liveness.DISPENSER) else "now"
    now = statuses[0].now if statuses else db_now()
    busy = starts_last_hour(now)
    shown = [
        s for s in statuses
        if (not query or query.lower() in s.key.lower())
        and (only != "blocked" or s.blocked)
        and (only != "waiting" or s.waiting)
    ]
    shown.sort(key=lambda s: pressure(s, busy.get(s.key, 0)))
    page = Paginator(shown, PER_PAGE).get_page(request.GET.get("page"))
    series = minutes_by_key([s.key for s in page.object_list], now)
    units = window_units(list(page.object_list), now)
    rows = []
    for status in page.object_list:
        rows.append({
            "status": status,
            "chart": chart(status, series[status.key]),
            "panels": policy_panels(status, units.get(status.key, {})),
            "policies": ", ".join(p.label() for p in status.policies) or "no limit",
            "oldest_wait": humanize_duration(status.oldest_wait),
            "drain": status.drain_text(humanize_duration),
            "next_free": status.next_free_text(format_moment) if status.blocked or status.held_by else free_now,
            "paused": format_moment(status.paused_until, status.now) if status.paused_until else "",
            "shares": _shares(status),
        })
    keep = {k: v for k, v in (("q", query), ("only", only)) if v}
    if refresh != DEFAULT_REFRESH:
        keep["refresh"] = str(refresh)
    context = {
        **admin.site.each_context(request), "title": "Dispatcher dashboard", "rows": rows, "page": page,
        "query": query, "only": only, "refresh": refresh, "keep": urlencode(keep),
        "total_keys": len(statuses), "matching": len(shown), "blocked": sum(1 for s in statuses if s.blocked),
        "segments": SEGMENTS, "now": format_moment(now, now),
    }
    return TemplateResponse(request, "admin/dispatcher/dashboard.html", context)


def _shares(status: live.KeyStatus) -> list[dict[str, Any]]:
    """Each key set's share of a key several share, over the key's longest window (``status.shares_of``)."""
    if status.competing < 2:
        return []
    window = max((p.policy.period for p in status.policies), default=timedelta(minutes=1))
    shares = live.shares_of(status.key, status.now, window)
    total = sum(share.units for share in shares) or 1
    return [
        {
            "keys": ", ".join(k for k in parse_key_set(share.key_set) if k != status.key) or "(this key alone)",
            "units": share.units, "percent": round(100 * share.units / total), "waiting": share.waiting,
            "oldest_wait": humanize_duration(share.oldest_wait),
        }
        for share in shares
    ]
