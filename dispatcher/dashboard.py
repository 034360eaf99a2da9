"""The admin dashboard: an overview of every key first, then each key's full panel on a page of its own.

The overview (``dashboard_view``) reads its figures from ``overview`` in a fixed number of
queries whatever the number of keys, one compact row per key, sorted (errors first by default)
and paginated. A key's page (``key_view``) draws its starts per minute over the last hour against
its limits, each policy's use and the backlog, from grouped queries, with the SVG bars written
here rather than by a template loop.
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
from django.urls import NoReverseMatch, reverse
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString

from dispatcher import liveness, overview
from dispatcher import status as live
from dispatcher.clock import db_now
from dispatcher.durations import format_moment, humanize, humanize_duration
from dispatcher.exceptions import InvalidKey
from dispatcher.keys import key_in_set, parse_key_set, validate_key
from dispatcher.models import Attempt, StartLog
from dispatcher.states import CallStatus

PER_PAGE = 50
MINUTES = 60
DEFAULT_REFRESH = 30
# How attempt outcomes are drawn: a bar's segments from the bottom, and their legend.
SEGMENTS = (("done", "done"), ("error", "error"), ("429", "429 deferred"), ("missed", "missed its send moment"),
            ("running", "running"))
OUTCOME_SEGMENT = {"done": "done", "error": "error", "failed": "error", "lost": "error",
                   "rate_limited": "429", "missed": "missed", "running": "running"}

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


def _may_view(request: HttpRequest) -> None:
    if not (request.user.has_perm("dispatcher.view_callqueue") or request.user.has_perm("dispatcher.view_ratelimit")):
        raise PermissionDenied


def _refresh(request: HttpRequest) -> int:
    """The page's refresh period in seconds (0: never); ValueError with what it takes."""
    try:
        refresh = int(request.GET.get("refresh", DEFAULT_REFRESH))
    except ValueError:
        raise ValueError("refresh= takes a whole number of seconds (0: never)") from None
    if not 0 <= refresh <= 3600:
        raise ValueError("refresh= takes 0 to 3600 seconds")
    return refresh


def dashboard_view(request: HttpRequest) -> HttpResponse:
    """The overview: totals, the last hour, failures, processes, then one row per key (``overview``)."""
    _may_view(request)
    query = request.GET.get("q", "").strip()
    only = request.GET.get("only", "")
    sort = request.GET.get("sort", overview.DEFAULT_SORT)
    if only not in ONLY:
        return HttpResponseBadRequest(f"only= takes {', '.join(o for o in ONLY if o)}")
    try:
        refresh = _refresh(request)
        view = overview.read(db_now())
        shown = overview.sort_rows([row for row in view.rows if _matches(row, query, only)], sort)
    except ValueError as exc:
        return HttpResponseBadRequest(str(exc))
    page = Paginator(shown, PER_PAGE).get_page(request.GET.get("page"))
    keep = {k: v for k, v in (("q", query), ("only", only)) if v}
    if refresh != DEFAULT_REFRESH:
        keep["refresh"] = str(refresh)
    if sort != overview.DEFAULT_SORT:
        keep["sort"] = sort
    calls = _calls_list()
    oldest = view.oldest
    context = {
        **admin.site.each_context(request), "title": "Dispatcher dashboard", "page": page,
        "rows": [_row(row, view.now) for row in page.object_list], "columns": _columns(sort, keep),
        "query": query, "only": only, "refresh": refresh, "keep": urlencode(keep), "sort": sort,
        "total_keys": len(view.rows), "matching": len(shown), "now": format_moment(view.now, view.now),
        "states": [
            {"value": value, "label": label, "n": view.totals.get(value, 0),
             "url": f"{calls}?state={value}" if calls and value != CallStatus.PENDING else ""}
            for value, label in CallStatus.choices
        ],
        "chart": activity_chart(view.minutes), "hour": view.hour_totals(), "errors": view.errors, "gave_up": view.gave_up,
        "failed_url": f"{calls}?state={CallStatus.FAILED}" if calls else "",
        "oldest": {"wait": humanize_duration(oldest.status.oldest_wait), "key": oldest.key, "url": _key_url(oldest.key)} if oldest else None,
        "processes": [
            {"kind": kind, "text": view.processes.summary(kind), "problem": bool(view.processes.problem(kind))}
            for kind in (liveness.DISPENSER, liveness.WORKER)
        ],
        "silent": [
            {"name": b.name, "kind": b.kind, "since": humanize(b.seen_at, view.now)} for b in view.silent()
        ],
    }
    return TemplateResponse(request, "admin/dispatcher/dashboard.html", context)


ONLY = ("", "errors", "blocked", "waiting")


def _matches(row: overview.KeyRow, query: str, only: str) -> bool:
    return (
        (not query or query.lower() in row.key.lower())
        and (only != "errors" or bool(row.errors or row.failed))
        and (only != "blocked" or row.status.blocked)
        and (only != "waiting" or bool(row.status.waiting))
    )


def _key_url(key: str) -> str:
    return reverse("dispatcher:dashboard-key", args=[key])


def _calls_list() -> str:
    try:
        return reverse("admin:dispatcher_callqueue_changelist")
    except NoReverseMatch:
        return ""


COLUMNS = (
    ("key", "key"), ("", "policies"), ("use", "use"), ("waiting", "waiting"), ("oldest", "oldest wait"),
    ("errors", "errors, last hour"), ("paused", "paused"), ("drain", "drains in"),
)


def _columns(sort: str, keep: dict[str, str]) -> list[dict[str, str]]:
    """The table's headers, each sortable one linking to its order (largest first, then the reverse)."""
    others = {k: v for k, v in keep.items() if k != "sort"}
    found = []
    for name, label in COLUMNS:
        item = {"name": name, "label": label, "url": "", "aria": ""}
        if name:
            first = name if name == "key" else f"-{name}"
            target = (first.removeprefix("-") if first.startswith("-") else f"-{name}") if sort == first else first
            item["url"] = "?" + urlencode({**others, "sort": target})
            if sort.removeprefix("-") == name:
                item["aria"] = "descending" if sort.startswith("-") else "ascending"
        found.append(item)
    return found


def _row(row: overview.KeyRow, now: datetime) -> dict[str, Any]:
    """One key's compact row: its texts, and its HTML written here (a template loop over 50 rows of
    eight cells took most of the page's time), every text escaped by ``format_html``."""
    status = row.status
    use = row.use
    starved = row.starved
    r: dict[str, Any] = {
        "key": row.key, "url": _key_url(row.key), "blocked": status.blocked, "reason": status.blocked_reason,
        "policies": ", ".join(p.label() for p in status.policies) or "no limit",
        "governed_by": status.governed_by if status.governed_by and status.governed_by != row.key else "",
        "use": f"{round(100 * use)}%" if use is not None else "-", "use_width": round(min(use, 1) * 40) if use is not None else 0,
        "use_title": "; ".join(p.usage_text() for p in status.policies),
        "in_flight": status.in_flight, "concurrency": status.concurrency,
        "waiting": status.waiting, "due": status.due, "shared": status.competing,
        "oldest_wait": humanize_duration(status.oldest_wait) if status.waiting else "-",
        "errors": row.errors, "failed": row.failed, "latest_error": row.latest_error,
        "paused": format_moment(status.paused_until, now) if status.paused_until else "",
        "paused_for": humanize_duration(status.paused_until - now) if status.paused_until else "",
        "pause_reason": status.pause_reason, "drain": status.drain_text(humanize_duration),
        "starved": {"keys": starved[0], "wait": humanize_duration(starved[1])} if starved else None,
    }
    r["html"] = _row_html(r)
    return r


def _row_html(r: dict[str, Any]) -> SafeString:
    classes = "key-row" + (" has-errors" if r["errors"] or r["failed"] else "")
    classes += " is-paused" if r["paused"] else " is-blocked" if r["blocked"] else ""
    classes += " has-starved" if r["starved"] else ""
    if r["concurrency"]:
        flight = f" · {r['in_flight']}/{r['concurrency']} in flight"
    else:
        flight = f" · {r['in_flight']} in flight" if r["in_flight"] else ""
    waiting = str(r["waiting"]) + (f" ({r['due']} due)" if r["waiting"] and r["due"] != r["waiting"] else "")
    waiting += f" · {r['shared']} key sets" if r["shared"] > 1 else ""
    starved = format_html(
        ' <span class="starved" title="its oldest call waits far longer than the other key sets\' of this key">starved: {} ({})</span>',
        r["starved"]["keys"], r["starved"]["wait"],
    ) if r["starved"] else ""
    errors = (f"{r['errors']}" + (f", {r['failed']} gave up" if r["failed"] else "")) if r["errors"] or r["failed"] else "0"
    if r["paused"]:
        paused = format_html('<td class="paused" title="until {}">for {}{}</td>', r["paused"], r["paused_for"],
                             f" ({r['pause_reason']})" if r["pause_reason"] else "")
    else:
        paused = format_html('<td class="paused">{}</td>', f"blocked: {r['reason']}" if r["blocked"] else "no")
    return format_html(
        '<tr class="{}" data-key="{}">\n'
        '        <td class="key"><a href="{}" title="{}">{}</a></td>\n'
        '        <td class="policies" title="{}{}">{}</td>\n'
        '        <td class="use" title="{}"><span class="usebar"><span style="width: {}px"></span></span> {}{}</td>\n'
        '        <td class="waiting">{}</td>\n'
        '        <td class="oldest">{}{}</td>\n'
        '        <td class="errors"{}>{}</td>\n'
        "        {}\n"
        '        <td class="drain">{}</td>\n'
        "      </tr>",
        classes, r["key"], r["url"], r["key"], r["key"],
        r["policies"], f" (from {r['governed_by']})" if r["governed_by"] else "", r["policies"],
        r["use_title"], r["use_width"], r["use"], flight, waiting, r["oldest_wait"], starved,
        format_html(' title="latest: {}"', r["latest_error"]) if r["latest_error"] else "", errors, paused, r["drain"],
    )


ACTIVITY_WIDTH, ACTIVITY_HEIGHT = 240, 48


def activity_chart(minutes: list[tuple[datetime, dict[str, int]]]) -> dict[str, Any]:
    """Attempts finished per minute over the last hour as stacked SVG bars (done, error, 429, missed), written here."""
    peak = max([sum(counts.values()) for _, counts in minutes] + [1])
    slot = ACTIVITY_WIDTH / len(minutes)
    rects = []
    for i, (minute, counts) in enumerate(minutes):
        base = float(ACTIVITY_HEIGHT)
        for kind, label in overview.KINDS:
            n = counts.get(kind, 0)
            if n:
                h = ACTIVITY_HEIGHT * n / peak
                base -= h
                rects.append(format_html(
                    '<rect class="seg-{}" x="{}" y="{}" width="{}" height="{}" data-n="{}"><title>{}: {} {}</title></rect>',
                    kind, round(i * slot, 1), round(base, 1), round(max(slot - 1, 1), 1), round(h, 1), n, f"{minute:%H:%M}", n, label,
                ))
    return {
        "width": ACTIVITY_WIDTH, "height": ACTIVITY_HEIGHT, "peak": peak, "bars": format_html_join("", "{}", ((r,) for r in rects)),
        "first": f"{minutes[0][0]:%H:%M}", "last": f"{minutes[-1][0]:%H:%M}",
    }


def key_view(request: HttpRequest, key: str) -> HttpResponse:
    """One key's full panel: starts per minute against its limits, each policy's use, backlog, shares."""
    _may_view(request)
    try:
        refresh = _refresh(request)
        validate_key(key)
    except (ValueError, InvalidKey) as exc:
        return HttpResponseBadRequest(str(exc))
    status = live.key_statuses([key])[0]
    now = status.now
    # A free slot sends nothing while no dispenser runs: say so where the slot is read.
    free_now = "now, but no dispenser runs" if liveness.read(now).problem(liveness.DISPENSER) else "now"
    row = {
        "status": status,
        "chart": chart(status, minutes_by_key([key], now)[key]),
        "panels": policy_panels(status, window_units([status], now).get(key, {})),
        "policies": ", ".join(p.label() for p in status.policies) or "no limit",
        "oldest_wait": humanize_duration(status.oldest_wait),
        "drain": status.drain_text(humanize_duration),
        "next_free": status.next_free_text(format_moment) if status.blocked or status.held_by else free_now,
        "paused": format_moment(status.paused_until, status.now) if status.paused_until else "",
        "shares": _shares(status),
    }
    calls = _calls_list()
    context = {
        **admin.site.each_context(request), "title": f"Key {key}", "row": row, "refresh": refresh,
        "segments": SEGMENTS, "now": format_moment(now, now), "overview_url": reverse("dispatcher:dashboard"),
        "calls_url": f"{calls}?{urlencode({'key': key})}" if calls else "",
    }
    return TemplateResponse(request, "admin/dispatcher/dashboard_key.html", context)


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
