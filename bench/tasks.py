"""A plain Celery task: the baseline of what the workers do without the dispatcher."""
from __future__ import annotations

import os

from celery import shared_task

_client = None


@shared_task(name="bench.count", ignore_result=True)
def count(counter: str) -> None:
    """Increment a Redis counter (the baseline of a no-op call)."""
    global _client
    import redis

    if _client is None:
        _client = redis.Redis.from_url(os.environ["BENCH_REDIS_URL"])
    _client.incr(counter)
