"""Liveness: dispensers and workers write heartbeats; the admin, status and metrics read them.

A process writes its heartbeat row at most once per quarter of ``DISPATCHER_HEARTBEAT_TIMEOUT``
(two small statements), so the write rate is bounded whatever its pace: a dispenser from its
passes, a worker from a thread in its main process, started and stopped by Celery's
``worker_ready``/``worker_shutdown`` signals. A process silent for the whole timeout, or one
that stopped cleanly, is not running. Times are the database's (``Now()`` on write,
``db_now()`` on read), like every other time the dispatcher compares.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from celery.concurrency import get_implementation
from celery.concurrency.prefork import TaskPool as PreforkPool
from celery.signals import worker_ready, worker_shutdown
from django.db import DatabaseError, IntegrityError, connection
from django.db.models import DateTimeField, ExpressionWrapper, Sum, Value
from django.db.models.functions import Now
from django.utils import timezone

from dispatcher.clock import db_now
from dispatcher.conf import dispatcher_settings
from dispatcher.durations import format_moment, humanize, humanize_duration
from dispatcher.models import CallQueue, Heartbeat

log = logging.getLogger("dispatcher")

DISPENSER, WORKER, BEAT_TASK = "dispenser", "worker", "beat_task"
# Rows of processes gone this long are deleted when a new process first reports.
FORGET_AFTER = timedelta(days=1)

_last_beat: dict[str, float] = {}


def interval() -> float:
    """Seconds between two heartbeats of one process: a quarter of the timeout."""
    return max(dispatcher_settings.HEARTBEAT_TIMEOUT.total_seconds() / 4, 0.25)


def process_name(kind: str, label: str = "", *, pid: bool = True) -> str:
    """Name this process: kind, then the given label or host, and the pid (or only the host)."""
    name = f"{kind} {label or socket.gethostname()}"
    return f"{name} pid {os.getpid()}" if pid else f"{name} on {socket.gethostname()}"


def beat(kind: str, name: str | None = None, *, force: bool = False, slots: int | None = None) -> bool:
    """Record that this process is alive, at most once per interval; return whether it wrote.

    A worker says its pool's size (``slots``): dispensers size their messages by it."""
    name = name or process_name(kind)
    moment = time.monotonic()
    last = _last_beat.get(name)
    if not force and last is not None and moment - last < interval():
        return False
    _last_beat[name] = moment
    try:
        if not Heartbeat.objects.filter(name=name).update(seen_at=Now(), stopped_at=None, slots=slots):
            Heartbeat.objects.filter(seen_at__lt=timezone.now() - FORGET_AFTER).delete()
            try:
                Heartbeat.objects.create(name=name, kind=kind, slots=slots)
            except IntegrityError:
                pass  # another thread of this process wrote it first
    except DatabaseError as exc:
        # A heartbeat must never stop a pass or a worker; the silence is what readers see.
        log.warning("heartbeat_failed name=%r error=%r", name, exc)
        return False
    return True


def stopped(name: str) -> None:
    """Mark a process as stopped cleanly, so readers do not wait for its timeout."""
    try:
        Heartbeat.objects.filter(name=name).update(stopped_at=Now())
    except DatabaseError as exc:
        log.warning("heartbeat_stop_failed name=%r error=%r", name, exc)
    _last_beat.pop(name, None)


@dataclass
class Liveness:
    """Which dispensers and workers reported within the timeout, read at one instant."""

    now: datetime
    timeout: timedelta
    heartbeats: list[Heartbeat] = field(default_factory=list)

    def is_alive(self, beat: Heartbeat) -> bool:
        return beat.stopped_at is None and beat.seen_at >= self.now - self.timeout

    def alive(self, kind: str) -> list[Heartbeat]:
        return [b for b in self.heartbeats if b.kind == kind and self.is_alive(b)]

    def last_seen(self, kind: str) -> datetime | None:
        seen = [b.stopped_at or b.seen_at for b in self.heartbeats if b.kind == kind]
        return max(seen) if seen else None

    def problem(self, kind: str) -> str:
        """Say "no dispenser has run since …" when none is alive (nor, for dispensers, beat's dispense task), else ''."""
        if self.alive(kind) or (kind == DISPENSER and self.alive(BEAT_TASK)):
            return ""
        verb = "run" if kind == DISPENSER else "reported"
        seen = [t for t in (self.last_seen(kind), self.last_seen(BEAT_TASK) if kind == DISPENSER else None) if t]
        last = max(seen) if seen else None
        if last is None:
            return f"no {kind} has {verb} yet"
        return f"no {kind} has {verb} since {format_moment(last, self.now)}"

    def summary(self, kind: str) -> str:
        """Say how many processes of a kind run (beat's dispense task apart: it is no process), or what is wrong."""
        alive = self.alive(kind)
        tasks = self.alive(BEAT_TASK) if kind == DISPENSER else []
        if not alive and not tasks:
            return self.problem(kind)
        if not alive:
            latest = max(b.seen_at for b in tasks)
            return f"no dispenser process; beat's dispense task dispenses (last ran {humanize(latest, self.now)})"
        latest = max(b.seen_at for b in alive)
        text = f"{len(alive)} {kind}{'s' if len(alive) != 1 else ''} running (last heartbeat {humanize(latest, self.now)})"
        return text + (", and beat's dispense task" if tasks else "")

    def as_dict(self) -> dict[str, Any]:
        """Return the liveness as JSON-ready data."""
        result: dict[str, Any] = {"timeout_seconds": self.timeout.total_seconds()}
        for kind in (DISPENSER, WORKER, BEAT_TASK):
            last = self.last_seen(kind)
            result[f"{kind}s"] = {
                "alive": len(self.alive(kind)),
                "last_seen": last.isoformat() if last else None,
                "problem": self.problem(kind) or None,
                "processes": [
                    {"name": b.name, "alive": self.is_alive(b), "started_at": b.started_at.isoformat(),
                     "seen_at": b.seen_at.isoformat(), "stopped_at": b.stopped_at.isoformat() if b.stopped_at else None}
                    for b in self.heartbeats if b.kind == kind
                ],
            }
        return result


def worker_slots() -> int | None:
    """The messages the live workers run at once, as their heartbeats say (None: none says)."""
    timeout = dispatcher_settings.HEARTBEAT_TIMEOUT
    alive = Heartbeat.objects.filter(
        kind=WORKER, stopped_at__isnull=True, slots__isnull=False,
        seen_at__gte=ExpressionWrapper(Now() - Value(timeout), output_field=DateTimeField()),
    )
    total = alive.aggregate(total=Sum("slots"))["total"]
    return int(total) if total else None


def read(now: datetime | None = None) -> Liveness:
    """Read every heartbeat (the table holds one row per process seen in the last day)."""
    return Liveness(
        now=now or db_now(),
        timeout=dispatcher_settings.HEARTBEAT_TIMEOUT,
        heartbeats=list(Heartbeat.objects.order_by("kind", "-seen_at")),
    )


def stall(call: CallQueue, state: Liveness) -> str:
    """Say what keeps a waiting or dispatched call from moving when a process is missing, or ''."""
    if call.status == CallQueue.Status.PENDING:
        return state.problem(DISPENSER)
    if call.status == CallQueue.Status.DISPATCHED and call.dispatched_at is not None:
        age = state.now - call.dispatched_at
        if age < state.timeout:
            return ""
        text = f"dispatched {humanize_duration(age)} ago, no worker has picked it up"
        problem = state.problem(WORKER)
        return f"{text}; {problem}" if problem else text
    if call.status == CallQueue.Status.RUNNING:
        problem = state.problem(WORKER)
        return f"running, but {problem}" if problem else ""
    return ""


# --- workers: a heartbeat thread in the worker's main process -------------------------------


class WorkerHeartbeat:
    """Beats for one Celery worker from a daemon thread until the worker shuts down."""

    def __init__(self, hostname: str, slots: int | None = None) -> None:
        self.name = process_name(WORKER, hostname)
        self.slots = slots
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, name="dispatcher-heartbeat", daemon=True)

    def run(self) -> None:
        try:
            while True:
                beat(WORKER, self.name, force=True, slots=self.slots)
                if self.stop.wait(interval()):
                    break
            stopped(self.name)
        finally:
            connection.close()


_worker: WorkerHeartbeat | None = None
# The pool size of the worker whose main process this is, with that process's pid.
_main_slots: tuple[int, int] | None = None


def process_slots() -> int | None:
    """How many tasks this process runs at once, when it is a worker's main process (threads,
    gevent, eventlet or solo pool: the pool's size); None in a prefork child, which runs one
    task at a time, and in any other process."""
    if _main_slots is None or _main_slots[0] != os.getpid():
        return None
    return _main_slots[1]


def _forks(pool_cls: Any) -> bool:
    """Whether a worker's pool class (or its alias) runs tasks in child processes (prefork)."""
    if isinstance(pool_cls, str):
        try:
            pool_cls = get_implementation(pool_cls)
        except (ImportError, AttributeError, KeyError):
            return True  # unknown: assume the worst, no process-wide size
    return isinstance(pool_cls, type) and issubclass(pool_cls, PreforkPool)


def on_worker_ready(sender: Any = None, **kwargs: Any) -> None:
    global _worker, _main_slots
    if _worker is None:
        # The consumer's controller is the WorkController: its concurrency is the pool's size.
        slots = getattr(getattr(sender, "controller", None), "concurrency", None)
        slots = slots if isinstance(slots, int) and slots > 0 else None
        # A prefork pool's tasks run in its children (forked before this signal, or later with
        # the parent's memory): the size is theirs together, never one process's.
        if slots is not None and not _forks(getattr(getattr(sender, "controller", None), "pool_cls", None)):
            _main_slots = (os.getpid(), slots)
        _worker = WorkerHeartbeat(getattr(sender, "hostname", "") or socket.gethostname(), slots)
        _worker.thread.start()


def on_worker_shutdown(sender: Any = None, **kwargs: Any) -> None:
    global _worker
    if _worker is not None:
        _worker.stop.set()
        _worker.thread.join(timeout=5)
        _worker = None


def connect_worker_signals() -> None:
    """Start a worker's heartbeat with the worker, whatever project defines the Celery app."""
    worker_ready.connect(on_worker_ready, weak=False, dispatch_uid="dispatcher.liveness.ready")
    worker_shutdown.connect(on_worker_shutdown, weak=False, dispatch_uid="dispatcher.liveness.shutdown")
