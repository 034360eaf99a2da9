"""Calls the end-to-end tests send to a fake API, and what they read back: one home for every module."""
from __future__ import annotations

from typing import Any

from dispatcher.models import CallQueue, StartLog
from support.fakeapi import FakeAPI


def http_call(
    api: FakeAPI, path: str, *, call: str = "", tenant: str = "", keys: list[str] | None = None, **options: Any,
) -> CallQueue:
    """Send a GET of ``path`` on the fake API; ``call`` and ``tenant`` travel as X-Call and X-Tenant."""
    headers = {"x-call": call, **({"x-tenant": tenant} if tenant else {})}
    params = {"method": "GET", "url": f"{api.url}{path}", "headers": headers}
    return CallQueue.objects.send("http", params, keys=["api"] if keys is None else keys, **options)


def partner_call(api: FakeAPI, path: str, tenant: str, n: int, **options: Any) -> CallQueue:
    """Send call number ``n`` of a tenant, under the partner's key and the tenant's own."""
    return http_call(api, path, call=str(n), tenant=tenant, keys=["partner", f"tenant:{tenant}"], **options)


def statuses(ids: list[int] | None = None) -> dict[str, int]:
    """Count the calls (these, or all) by status."""
    calls = CallQueue.objects.all() if ids is None else CallQueue.objects.filter(id__in=ids)
    counts: dict[str, int] = {}
    for status in calls.values_list("status", flat=True):
        counts[status] = counts.get(status, 0) + 1
    return counts


def all_finished(ids: list[int] | None = None) -> bool:
    """Whether every call (of these, or all) is done, failed or cancelled."""
    calls = CallQueue.objects.all() if ids is None else CallQueue.objects.filter(id__in=ids)
    return not calls.exclude(status__in=CallQueue.FINISHED).exists()


def start_times(key: str) -> list[float]:
    """Every start the limiter logged under a key, as epoch seconds."""
    return [t.timestamp() for t in StartLog.objects.filter(key=key).values_list("started_at", flat=True)]


def latency_spread(api: FakeAPI, starts_by_call: dict[str, float]) -> float:
    """Return how much the start-to-arrival latency varied across calls.

    Arrivals at the API trail the recorded start by each request's own latency; two starts
    exactly one period apart can arrive up to this much closer together.
    """
    latencies = [a.at - starts_by_call[a.call] for a in api.arrivals if a.call in starts_by_call]
    return max(latencies) - min(latencies) if latencies else 0.0
