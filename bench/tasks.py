"""A plain Celery task: the baseline of what the workers do without the dispatcher."""
from __future__ import annotations

import os

from celery import shared_task
from celery.signals import worker_ready, worker_shutdown

from bench import helper, phases

_client = None

if os.environ.get(phases.ENV):  # the worker_phases benchmark's worker times its calls' steps
    worker_ready.connect(phases.install, weak=False)
    worker_shutdown.connect(phases.flush, weak=False)
if os.environ.get(helper.ENV):  # the http_threads_helper experiment's worker
    worker_ready.connect(helper.install, weak=False)


@shared_task(name="bench.count", ignore_result=True)
def count(counter: str) -> None:
    """Increment a Redis counter (the baseline of a no-op call)."""
    global _client
    import redis

    if _client is None:
        _client = redis.Redis.from_url(os.environ["BENCH_REDIS_URL"])
    _client.incr(counter)


_http = None


@shared_task(name="bench.http_get", ignore_result=True)
def http_get(url: str, counter: str) -> None:
    """GET a URL with one pooled client per process, then count it (the baseline of an http call)."""
    global _client, _http
    import httpx
    import redis

    if _http is None:
        _http = httpx.Client(timeout=30, limits=httpx.Limits(max_connections=64, max_keepalive_connections=64))
    if _client is None:
        _client = redis.Redis.from_url(os.environ["BENCH_REDIS_URL"])
    _http.get(url).raise_for_status()
    _client.incr(counter)
