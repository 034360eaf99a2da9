"""Prometheus metrics at /metrics, read from the database at scrape time.

Why a custom collector over the tables rather than counters incremented in code: calls start
and finish in Celery workers and dispensers spread over many processes and machines, while
/metrics is served by a web process. In-process counters would only count what that web
process did; prometheus_client's multiprocess mode shares counters only between processes of
one machine (through files in one directory). The database is the one place that sees every
start of every process, so each scrape counts there: gauges from the live rows, counters from
the append-only Attempt history. Any web process answers with the same numbers.

The trade-off: those counters count the history still stored. When ``prune_calls`` deletes
old attempts a counter goes down, which Prometheus reads as a counter reset (``rate()`` and
``increase()`` treat it as a restart); with the default daily prune this is one reset a day.
Each scrape runs a handful of aggregate queries; the wait-time histogram scans the attempts
kept by the retention, so keep the retention short on very busy installations.
"""
from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

from django.db.models import Count, DurationField, ExpressionWrapper, F, Q, Sum
from django.http import HttpRequest, HttpResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from dispatcher import liveness
from dispatcher import status as live
from dispatcher.auth import bearer_token_ok
from dispatcher.clock import db_now
from dispatcher.conf import dispatcher_settings
from dispatcher.keys import parse_key_set
from dispatcher.limits.shapes import TokenBucket
from dispatcher.models import Attempt, CallQueue
from dispatcher.redact import redact_text

WAIT_BUCKETS = (0.1, 0.5, 1.0, 5.0, 15.0, 60.0, 300.0, 900.0, 3600.0, 21600.0, 86400.0)


class DispatcherCollector(Collector):
    """Collect the dispatcher's metrics from the database at each scrape."""

    def collect(self) -> Iterator[Metric]:
        yield from self._calls()
        yield from self._attempts()
        yield self._wait_histogram()
        yield from self._limiter()
        yield from self._liveness()

    def _calls(self) -> Iterator[Metric]:
        by_status = GaugeMetricFamily("dispatcher_calls", "Calls stored, by status.", labels=["status"])
        counts = dict(CallQueue.objects.values_list("status").annotate(n=Count("id")).order_by())
        for status in CallQueue.Status.values:
            by_status.add_metric([status], counts.get(status, 0))
        yield by_status
        by_key = GaugeMetricFamily(
            "dispatcher_queue_depth", "Calls waiting or in flight, by key and status.", labels=["key", "status"]
        )
        depth: dict[tuple[str, str], int] = {}
        live_rows = (
            CallQueue.objects.filter(status__in=[*CallQueue.WAITING, *CallQueue.IN_FLIGHT])
            .values_list("key_set", "status")
            .annotate(n=Count("id"))
            .order_by()
        )
        for text, status, n in live_rows:
            for key in parse_key_set(text) or [""]:
                key = redact_text(key)  # a key may embed a credential (a URL with ?api_key=...)
                depth[(key, status)] = depth.get((key, status), 0) + n
        for (key, status), n in sorted(depth.items()):
            by_key.add_metric([key, status], n)
        yield by_key

    def _attempts(self) -> Iterator[Metric]:
        outcomes = dict(Attempt.objects.values_list("outcome").annotate(n=Count("id")).order_by())
        started = CounterMetricFamily("dispatcher_calls_started", "Attempts started (retries included).")
        started.add_metric([], sum(outcomes.values()))
        yield started
        finished = CounterMetricFamily(
            "dispatcher_attempts_finished", "Attempts finished, by outcome.", labels=["outcome"]
        )
        for outcome in Attempt.Outcome.values:
            if outcome != Attempt.Outcome.RUNNING:
                finished.add_metric([outcome], outcomes.get(outcome, 0))
        yield finished
        done = CounterMetricFamily("dispatcher_calls_done", "Calls that finished done.")
        done.add_metric([], outcomes.get(Attempt.Outcome.DONE, 0))
        yield done
        failed = CounterMetricFamily("dispatcher_calls_failed", "Calls that gave up (failed).")
        failed.add_metric([], CallQueue.objects.filter(status=CallQueue.Status.FAILED).count())
        yield failed
        rescued = CounterMetricFamily(
            "dispatcher_calls_rescued", "Attempts lost with a crashed or stuck worker and rescued."
        )
        rescued.add_metric([], outcomes.get(Attempt.Outcome.LOST, 0))
        yield rescued

    def _wait_histogram(self) -> HistogramMetricFamily:
        waits = Attempt.objects.filter(number=1).annotate(
            wait=ExpressionWrapper(F("started_at") - F("call__created_at"), output_field=DurationField())
        )
        aggregates = {f"le{i}": Count("id", filter=Q(wait__lte=timedelta(seconds=b))) for i, b in enumerate(WAIT_BUCKETS)}
        row = waits.aggregate(total=Count("id"), wait_sum=Sum("wait"), **aggregates)
        buckets = [(str(b), row[f"le{i}"]) for i, b in enumerate(WAIT_BUCKETS)]
        buckets.append(("+Inf", row["total"]))
        total_wait = row["wait_sum"]
        seconds = total_wait.total_seconds() if isinstance(total_wait, timedelta) else float(total_wait or 0) / 1e6
        return HistogramMetricFamily(
            "dispatcher_wait_seconds",
            "Time from enqueue to the first start of a call.",
            buckets=buckets,
            sum_value=max(seconds, 0.0),
        )

    def _limiter(self) -> Iterator[Metric]:
        statuses = live.key_statuses(now=db_now())
        utilisation = GaugeMetricFamily(
            "dispatcher_limiter_utilisation",
            "Share of a policy used now: a window's units over its limit, a bucket's spent tokens over its burst (1 = full).",
            labels=["key", "period_seconds"],
        )
        used = GaugeMetricFamily(
            "dispatcher_limiter_used", "Units in a window now, or tokens a bucket has spent and not yet refilled.",
            labels=["key", "period_seconds"],
        )
        limit = GaugeMetricFamily("dispatcher_limiter_limit", "The policy's limit per period.", labels=["key", "period_seconds"])
        burst = GaugeMetricFamily(
            "dispatcher_limiter_burst", "A token bucket's burst (depth); absent for windows.", labels=["key", "period_seconds"]
        )
        in_flight = GaugeMetricFamily("dispatcher_key_in_flight", "Calls dispatched or running, by key.", labels=["key"])
        paused = GaugeMetricFamily("dispatcher_key_paused", "1 while a key is paused.", labels=["key"])
        learnt = GaugeMetricFamily(
            "dispatcher_learnt_limit", "A limit an API announced for a key, applied until it expires.",
            labels=["key", "period_seconds"],
        )
        for s in statuses:
            key = redact_text(s.key)
            for p in s.policies:
                if p.learnt:
                    learnt.add_metric([key, f"{p.policy.period.total_seconds():g}"], p.policy.limit)
                    continue
                labels = [key, f"{p.policy.period.total_seconds():g}"]
                utilisation.add_metric(labels, p.utilisation)
                used.add_metric(labels, p.used)
                limit.add_metric(labels, p.policy.limit)
                if isinstance(p.policy, TokenBucket):
                    burst.add_metric(labels, p.policy.burst)
            in_flight.add_metric([key], s.in_flight)
            paused.add_metric([key], 1 if s.paused_until else 0)
        yield from (utilisation, used, limit, burst, in_flight, paused, learnt)

    def _liveness(self) -> Iterator[Metric]:
        state = liveness.read()
        alive = GaugeMetricFamily(
            "dispatcher_processes_alive", "Dispenser and worker processes (and beat's dispense task, kind beat_task) whose heartbeat is within the timeout.", labels=["kind"]
        )
        age = GaugeMetricFamily(
            "dispatcher_heartbeat_age_seconds", "Seconds since the latest heartbeat of a kind (absent: never seen).",
            labels=["kind"],
        )
        for kind in (liveness.DISPENSER, liveness.WORKER, liveness.BEAT_TASK):
            alive.add_metric([kind], len(state.alive(kind)))
            last = state.last_seen(kind)
            if last is not None:
                age.add_metric([kind], max((state.now - last).total_seconds(), 0.0))
        yield from (alive, age)


def _allowed(request: HttpRequest) -> bool:
    if dispatcher_settings.METRICS_PUBLIC:
        return True
    token = bearer_token_ok(request, dispatcher_settings.METRICS_TOKENS)
    if token is not None:
        return token
    user = request.user
    return bool(user.is_active and user.is_staff and user.has_perm("dispatcher.view_callqueue"))


def metrics_view(request: HttpRequest) -> HttpResponse:
    """Serve the metrics to a token holder, staff allowed to view calls, or anyone if public."""
    if not _allowed(request):
        response = HttpResponse("metrics need a token (Authorization: Bearer ...) or a staff login\n", status=401,
                                content_type="text/plain")
        response["WWW-Authenticate"] = 'Bearer realm="dispatcher metrics"'
        return response
    registry = CollectorRegistry(auto_describe=False)
    registry.register(DispatcherCollector())
    return HttpResponse(generate_latest(registry), content_type=CONTENT_TYPE_LATEST)
