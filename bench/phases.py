"""Where a worker's call spends its time, step by step: a measuring wrapper for benchmarks only.

A worker started with ``BENCH_PHASES_FILE`` set (``bench.tasks`` installs it when the worker
starts) times each call of ``dispatcher.worker.execute`` at three points: its start returned,
its handler returned, its end. At each it reads the wall clock, the thread's CPU time and the
thread's context switches (voluntary: the thread waited, for I/O, a lock or the GIL;
involuntary: the kernel took the core away). It also notes whether the thread led its start
group (``dispatcher.combiner``) and how many starts that group held. Rows go to the file as
the worker runs; ``summary()`` reads them back. Nothing here runs unless the variable is set.
"""
from __future__ import annotations

import json
import os
import resource
import statistics
import threading
import time
from pathlib import Path
from typing import Any

ENV = "BENCH_PHASES_FILE"
_state = threading.local()
_rows: list[list[Any]] = []
_lock = threading.Lock()


def _stamp() -> tuple[float, float, int, int]:
    usage = resource.getrusage(resource.RUSAGE_THREAD)
    return time.perf_counter(), time.thread_time(), usage.ru_nvcsw, usage.ru_nivcsw


def install(**_: Any) -> None:
    """Wrap the worker's steps (connected to Celery's ``worker_init`` when ``BENCH_PHASES_FILE`` is set)."""
    from dispatcher import combiner, tasks, worker

    execute, start, handler, lead = worker.execute, worker._combined_start, worker._call_handler, combiner.StartCombiner._lead

    def timed_execute(call_id: int, dispatch_no: int) -> str:
        _state.marks = [_stamp()]
        _state.led, _state.group = False, 0
        try:
            return execute(call_id, dispatch_no)
        finally:
            marks = [*_state.marks, _stamp()]
            if len(marks) == 4:  # started, ran and recorded (a skipped delivery has two)
                _keep([list(m) for m in marks] + [_state.led, _state.group])

    def timed_start(*args: Any, **kwargs: Any) -> Any:
        started = start(*args, **kwargs)
        if started.state == "started":
            _state.marks.append(_stamp())
        return started

    def timed_handler(call: Any) -> Any:
        outcome = handler(call)
        _state.marks.append(_stamp())
        return outcome

    def timed_lead(self: Any, worker_name: str) -> None:
        with self._lock:
            size = min(len(self._waiting), combiner.MAX_GROUP)
        _state.led, _state.group = True, size
        lead(self, worker_name)

    worker.execute = tasks.execute = timed_execute  # tasks.run_call calls the name it imported
    worker._combined_start = timed_start
    worker._call_handler = timed_handler
    combiner.StartCombiner._lead = timed_lead  # type: ignore[method-assign]


def _keep(row: list[Any]) -> None:
    with _lock:
        _rows.append(row)
        if len(_rows) >= 50:
            _flush()


def _flush() -> None:
    rows, _rows[:] = list(_rows), []
    with open(os.environ[ENV], "a") as out:
        for row in rows:
            out.write(json.dumps(row) + "\n")


def flush(**_: Any) -> None:
    """Write what is left (connected to Celery's ``worker_shutdown``)."""
    with _lock:
        _flush()


STEPS = ("start", "handler", "finish")


def summary(path: Path) -> dict[str, Any]:
    """Mean per call of each step (wall ms, CPU ms, voluntary and involuntary switches) and the start groups."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line] if path.exists() else []
    if not rows:
        return {"calls": 0, "steps": {}, "groups": 0, "calls_per_group": 0.0}
    steps: dict[str, dict[str, float]] = {}
    for index, step in enumerate(STEPS):
        deltas = [[b - a for a, b in zip(row[index], row[index + 1], strict=True)] for row in rows]
        wall, cpu, voluntary, involuntary = (statistics.fmean(column) for column in zip(*deltas, strict=True))
        steps[step] = {"wall_ms": wall * 1000, "cpu_ms": cpu * 1000, "voluntary": voluntary, "involuntary": involuntary}
    groups = [row[5] for row in rows if row[4]]
    return {
        "calls": len(rows), "steps": steps, "groups": len(groups),
        "calls_per_group": statistics.fmean(groups) if groups else 0.0,
    }
