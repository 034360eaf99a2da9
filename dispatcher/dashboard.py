"""The admin dashboard: per key, starts per minute over the last hour against its limits, and the backlog."""
from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse

from dispatcher import status as live

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

