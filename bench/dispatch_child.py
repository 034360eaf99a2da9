"""One dispenser process against one broker: ``python -m bench.dispatch_child BROKER_URL N``.

Publishes the waiting calls once with a per-call ``apply_async`` loop (the baseline, then
purged), then moves them with the dispenser; prints one JSON line with both rates.
"""
from __future__ import annotations

import json
import os
import sys
import time


def main() -> None:
    broker_url, expected = sys.argv[1], int(sys.argv[2])
    per_message = int(os.environ.get("DISPATCHER_CALLS_PER_MESSAGE", "1"))
    messages = -(-expected // per_message)  # at least: a pass packs each queue's calls
    os.environ["CELERY_BROKER_URL"] = broker_url
    import django

    django.setup()
    from bench.support import Broker
    from dispatcher.dispenser import Dispenser
    from dispatcher.models import CallQueue
    from dispatcher.tasks import run_call
    from project.celery import app

    broker = Broker(app, os.environ["CELERY_TASK_DEFAULT_QUEUE"])
    rows = list(CallQueue.objects.filter(status="pending").values_list("id", "dispatch_no", "queue"))
    out: dict = {"broker": broker_url.split(":", 1)[0], "calls": len(rows)}
    # Warm the connection pool and declare the queue, as a running process would have.
    run_call.apply_async((0, 0), queue=rows[0][2] or None)
    broker.wait_length(1)
    broker.purge()

    started = time.perf_counter()
    for call_id, dispatch_no, queue in rows:
        run_call.apply_async((call_id, dispatch_no + 1), queue=queue or None)
    out["baseline_seconds"] = time.perf_counter() - started
    out["baseline_in_broker"] = broker.wait_length(len(rows))
    broker.purge()

    dispenser = Dispenser()
    passes = moved = 0
    started = time.perf_counter()
    while passes < 10_000:
        passes += 1
        report = dispenser.run_once()
        moved += report.moved
        if not report.moved:
            break
    out["seconds"] = time.perf_counter() - started
    out["passes"] = passes
    out["moved"] = moved
    out["dispatched"] = CallQueue.objects.filter(status="dispatched").count()
    out["messages"] = messages
    out["in_broker"] = broker.wait_length(messages)
    broker.purge()
    broker.delete()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
