"""Template tags of the dispatcher's admin pages: the liveness box on the index and dashboard."""
from __future__ import annotations

from typing import Any

from django import template
from django.urls import NoReverseMatch, reverse

from dispatcher import liveness

register = template.Library()


@register.inclusion_tag("admin/dispatcher/liveness.html", takes_context=True)
def dispatcher_liveness(context: dict[str, Any], problems_only: bool = False, link: bool = True) -> dict[str, Any]:
    """Show whether dispensers and workers run (or only what is wrong), to staff who may see calls or limits."""
    request = context.get("request")
    user = getattr(request, "user", None)
    if user is None or not (user.has_perm("dispatcher.view_callqueue") or user.has_perm("dispatcher.view_ratelimit")):
        return {"show": False}
    state = liveness.read()
    try:
        dashboard = reverse("dispatcher:dashboard") if link else ""
    except NoReverseMatch:
        dashboard = ""
    rows = [
        {"kind": kind, "text": state.summary(kind), "problem": bool(state.problem(kind))}
        for kind in (liveness.DISPENSER, liveness.WORKER)
    ]
    if problems_only:
        rows = [row for row in rows if row["problem"]]
    return {"show": bool(rows), "rows": rows, "dashboard_url": dashboard}
