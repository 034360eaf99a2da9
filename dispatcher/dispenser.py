"""The dispenser: claims due calls under the rate policies and publishes them to Celery."""
from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import threading
import time
import uuid
import weakref
from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from celery import current_app
from django.db import DatabaseError, close_old_connections, connections

from dispatcher import liveness
from dispatcher.calls import dispense
from dispatcher.calls.dispense import DISPATCH_AHEAD
from dispatcher.clock import db_now
from dispatcher.conf import dispatcher_settings
from dispatcher.keys import parse_key_set
from dispatcher.limits import catalog, ledger, locks
from dispatcher.managers import BatchClaim, Claimed
from dispatcher.models import CallQueue
from dispatcher.store import schema

# The Celery tasks that run claimed calls (dispatcher.tasks): one call, or several of one queue.
RUN_CALL, RUN_CALLS = "dispatcher.run_call", "dispatcher.run_calls"

if TYPE_CHECKING:
    import psycopg
    from celery.app.amqp import task_message

log = logging.getLogger("dispatcher")

# Most calls one pass moves: a pass stays a short transaction, and the next one starts at once
# when this one was full.
DISPENSE_BATCH = 500
# The pool size a dispenser assumes when no live worker said its own (see liveness.worker_slots):
# prefork's processes or a small thread pool.
UNKNOWN_SLOTS = 8
# How long a dispenser keeps the workers' slots it read, in seconds: they change only as workers
# come and go, and one read a second costs nothing beside the passes.
SLOTS_FOR = 1.0


def calls_per_message(backlog: int, slots: int | None, most: int) -> int:
    """How many calls go into one message: the backlog spread over the workers' slots.

    While the backlog fits the slots, one call per message: each goes to its own slot, the
    lowest latency. Beyond, as few calls per message as still gives every slot one message
    (their handlers run at once in the message's threads), never more than ``most``
    (``DISPATCHER_CALLS_PER_MESSAGE``): fewer messages, one start transaction and fewer finish
    statements per group, where a deep backlog needs them.
    """
    if most <= 1 or backlog <= 1:
        return 1
    spread = max(1, slots or UNKNOWN_SLOTS)
    return max(1, min(most, -(-backlog // spread)))


@dataclass
class PassReport:
    """What one dispense pass did, and when the next one is worth running."""

    moved: int = 0
    published: int = 0
    put_back: int = 0
    key_sets: int = 0
    next_at: datetime | None = None
    full: bool = False
    # Calls per message this pass chose (calls_per_message).
    per_message: int = 1


class Dispenser:
    """Runs dispense passes; keeps a round-robin cursor so that every key set gets its turn."""

    def __init__(self, batch: int | None = None) -> None:
        self.batch = batch or dispatcher_settings.tuned("DISPENSE_BATCH", DISPENSE_BATCH)
        self.cursor: str | None = None
        # The workers' slots this dispenser read, and when (time.monotonic()).
        self._slots: tuple[float, int | None] | None = None

    def run_once(self) -> PassReport:
        """Claim and publish one batch; return what moved."""
        report = PassReport()
        key_sets, policies = dispense.waiting_key_sets_and_policies(CallQueue.objects)
        if self.cursor is not None:
            # Start after the key set this dispenser served last: round-robin across passes.
            split = next((i for i, k in enumerate(key_sets) if k > self.cursor), 0)
            key_sets = key_sets[split:] + key_sets[:split]
        # A pass serves at most one key set per call of its batch; the rest wait their turn.
        key_sets = key_sets[: self.batch]
        report.key_sets = len(key_sets)
        waits: list[datetime] = []
        if key_sets:
            claimed = self._claim(key_sets, policies)
            report.moved = len(claimed.calls)
            if claimed.calls:
                self._publish(claimed.calls, report)
                served = {call.key_set for call in claimed.calls}
                self.cursor = [k for k in key_sets if k in served][-1]
            # Claims judge the policies DISPATCHER_DISPATCH_AHEAD ahead (the worker waits for the
            # slot), so look again that much before room returns: a call then reaches its worker
            # as its slot frees rather than a claim, a publish and a delivery after it.
            ahead = dispatcher_settings.tuned("DISPATCH_AHEAD", DISPATCH_AHEAD)
            waits = [v.until - ahead for v in claimed.verdicts.values() if v.blocked and v.until is not None]
        report.full = report.moved >= self.batch
        if not report.full:
            # A full pass is followed by another at once; only a partial one needs to know
            # when to look again.
            upcoming = CallQueue.objects.next_due_at()
            if upcoming is not None:
                waits.append(upcoming)
            report.next_at = min(waits) if waits else None
        if report.moved or report.put_back:
            log.info(
                "dispense moved=%s published=%s put_back=%s key_sets=%s per_message=%s",
                report.moved, report.published, report.put_back, report.key_sets, report.per_message,
            )
        return report

    def _claim(self, key_sets: list[str], policies: catalog.Policies) -> BatchClaim:
        """Claim the pass's batch; if that fails, claim each key set on its own and skip the ones
        that fail, so one key's trouble (a stored value, an API's lesson) never stops the others."""
        try:
            return CallQueue.objects.claim_batch(key_sets, self.batch, policies)
        except DatabaseError as exc:
            log.error("dispense_batch_failed key_sets=%s error=%r; claiming each key set alone", len(key_sets), exc)
        claimed = BatchClaim([], {})
        budget = self.batch
        for key_set in key_sets:
            if budget <= 0:
                break
            try:
                one = CallQueue.objects.claim_batch([key_set], budget, policies)
            except DatabaseError as exc:
                log.error("dispense_key_set_skipped key_set=%s error=%r", key_set[:200], exc)
                continue
            claimed.calls.extend(one.calls)
            claimed.verdicts.update(one.verdicts)
            budget -= len(one.calls)
        return claimed

    def _publish(self, calls: list[Claimed], report: PassReport) -> None:
        """Publish claimed calls; put back at once whatever the broker did not take."""
        published = 0
        report.per_message = self.per_message(len(calls))
        alone = self.unanswered_key_sets(calls) if report.per_message > 1 else set()
        try:
            publish_run_calls(calls, report.per_message, alone=alone)
            published = len(calls)
        except Exception as exc:  # the broker is down or refused: fail closed
            log.error("publish_failed error=%r published=%s put_back=%s", exc, published, len(calls) - published)
        report.published += published
        if published < len(calls):
            report.put_back += CallQueue.objects.put_back(calls[published:])

    def per_message(self, claimed: int) -> int:
        """Choose the calls per message for a pass that claimed ``claimed`` calls: its backlog is
        these and the calls still waiting for a worker (dispatched, not started: how far the
        workers lag), spread over the live workers' slots (``calls_per_message``)."""
        most = dispatcher_settings.CALLS_PER_MESSAGE
        if most <= 1 or claimed <= 1:
            return 1  # no read at all: a lone call goes out at once
        slots = self._worker_slots()
        backlog = claimed
        try:
            # The count includes this pass's calls; bounded where more would not change the answer.
            backlog = max(claimed, CallQueue.objects.at_workers((slots or UNKNOWN_SLOTS) * most + 1))
        except DatabaseError as exc:
            log.warning("backlog_count_failed error=%r; sizing messages by this pass alone", exc)
        return calls_per_message(backlog, slots, most)

    def unanswered_key_sets(self, calls: list[Claimed]) -> set[str]:
        """The key sets of these calls with a key no call has finished under yet: their calls go
        one per message. A group starts all its calls at once, before the API's first answer
        could teach its limit (learning.py); one call per message lets the first answers arrive
        while the others wait their turn, as the workers' slots take them."""
        key_sets = {call.key_set for call in calls}
        keys = {key for key_set in key_sets for key in parse_key_set(key_set)}
        try:
            fresh = ledger.unanswered(sorted(keys))
        except DatabaseError as exc:
            log.warning("answered_read_failed error=%r; one call per message this pass", exc)
            fresh = keys
        return {key_set for key_set in key_sets if fresh.intersection(parse_key_set(key_set))}

    def _worker_slots(self) -> int | None:
        """The live workers' slots, read at most once per SLOTS_FOR (None: no worker said)."""
        moment = time.monotonic()
        if self._slots is None or moment - self._slots[0] >= SLOTS_FOR:
            try:
                self._slots = (moment, liveness.worker_slots())
            except DatabaseError as exc:
                log.warning("worker_slots_failed error=%r", exc)
                self._slots = (moment, None)
        return self._slots[1]

    def loop(self, stop: threading.Event, max_passes: int | None = None) -> int:
        """Run passes until ``stop`` is set; sleep until the next slot or a wake-up."""
        waiter = Waiter()
        passes = 0
        name = liveness.process_name(liveness.DISPENSER)
        try:
            while not stop.is_set() and (max_passes is None or passes < max_passes):
                passes += 1
                liveness.beat(liveness.DISPENSER, name)  # at most once per heartbeat interval
                try:
                    report = self.run_once()
                except Exception:
                    log.exception("dispense_pass_failed; retrying after a pause")
                    close_old_connections()
                    connections[CallQueue.objects.db].close()
                    waiter.reset()
                    stop.wait(min(1.0, dispatcher_settings.POLL_INTERVAL.total_seconds()))
                    continue
                if report.full:
                    continue
                timeout = dispatcher_settings.POLL_INTERVAL.total_seconds()
                if report.next_at is not None:
                    try:
                        timeout = min(timeout, max(0.0, (report.next_at - db_now(CallQueue.objects.db)).total_seconds()))
                    except Exception:
                        pass
                waiter.wait(timeout, stop)
        finally:
            waiter.close()
            liveness.stopped(name)
        return passes


class Waiter:
    """Sleeps until a timeout, a stop, or (on PostgreSQL) a NOTIFY from send() or a worker."""

    def __init__(self) -> None:
        self.conn: psycopg.Connection | None = None

    def _listen(self) -> psycopg.Connection | None:
        # LISTEN where the calls are: the database of CallQueue's manager.
        connection = connections[CallQueue.objects.db]
        if connection.vendor != "postgresql":
            return None
        if self.conn is None:
            import psycopg

            params = connection.get_connection_params()
            params.pop("cursor_factory", None)
            params.pop("context", None)
            self.conn = psycopg.connect(**params, autocommit=True)
            self.conn.execute(schema.listen(locks.WAKE_CHANNEL))
        return self.conn

    def wait(self, timeout: float, stop: threading.Event) -> None:
        try:
            conn = self._listen()
        except Exception as exc:
            log.warning("listen_failed error=%r; polling instead", exc)
            self.reset()
            conn = None
        if conn is None or timeout <= 0:
            stop.wait(max(0.0, timeout) if conn is None else 0)
            return
        deadline = time.monotonic() + timeout
        while not stop.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            try:
                # Wake at least every 0.5 s to notice a stop request.
                ready, _, _ = select.select([conn.fileno()], [], [], min(left, 0.5))
                if ready:
                    got = list(conn.notifies(timeout=0, stop_after=1000))
                    if got:
                        return
            except Exception as exc:
                log.warning("listen_lost error=%r", exc)
                self.reset()
                return

    def reset(self) -> None:
        if self.conn is not None:
            try:
                self.conn.close()
            except Exception:
                pass
        self.conn = None

    def close(self) -> None:
        self.reset()


def plan_messages(
    calls: list[Claimed], per_message: int, alone: Collection[str] = ()
) -> list[tuple[str, str, tuple[Any, ...]]]:
    """Return the messages (queue, task, args) that carry these calls: up to ``per_message`` calls
    of one queue each, in their order, and the calls of the key sets in ``alone`` one each."""
    by_queue: dict[str, list[Claimed]] = {}
    messages: list[tuple[str, str, tuple[Any, ...]]] = []
    for call in calls:
        if per_message > 1 and call.key_set in alone:
            messages.append((call.queue, RUN_CALL, (call.id, call.dispatch_no)))
        else:
            by_queue.setdefault(call.queue, []).append(call)
    for queue_name, group in by_queue.items():
        for start in range(0, len(group), per_message):
            chunk = group[start : start + per_message]
            if len(chunk) == 1:
                messages.append((queue_name, RUN_CALL, (chunk[0].id, chunk[0].dispatch_no)))
            else:
                messages.append((queue_name, RUN_CALLS, ([[c.id, c.dispatch_no] for c in chunk],)))
    return messages


def publish_run_calls(calls: list[Claimed], per_message: int | None = None, alone: Collection[str] = ()) -> None:
    """Publish the claimed calls, as ``apply_async`` would, in one write.

    Each message carries one call (``dispatcher.run_call``) or up to ``per_message`` calls of
    one queue (``dispatcher.run_calls``, started together and run at once by one worker slot;
    ``Dispenser.per_message`` chooses it per pass, at most ``DISPATCHER_CALLS_PER_MESSAGE``,
    the default here); the calls of the key sets in ``alone`` go one per message. The Celery
    message is built once per task and copied per message (``apply_async`` rebuilds it and
    re-reads the app's configuration every time); one producer and broker connection serve
    the batch, and ``producer.batch()`` pipelines the writes on Redis (a lone message goes as it
    is). Either the whole batch is written or this raises: a caller puts every call of the batch
    back, and any message that did reach the broker is stale (put back and the next claim change
    what it expects) and does nothing. Celery's task_publish signals are not sent for these
    messages.
    """
    if not calls:
        return
    messages = plan_messages(calls, max(1, per_message or dispatcher_settings.CALLS_PER_MESSAGE), alone)
    # The tasks are named, not imported: dispatcher.tasks imports this module.
    app = current_app._get_current_object()  # type: ignore[attr-defined]  # the app, not its proxy: a cache key
    amqp = app.amqp
    routes: dict[tuple[str, str], tuple[str, int]] = {}
    with app.producer_or_acquire() as producer, _batch(producer, len(messages)):
        for queue_name, task_name, args in messages:
            template = _template(app, task_name, args)
            route = routes.get((queue_name, task_name))
            if route is None:
                options = amqp.router.route({"queue": queue_name} if queue_name else {}, task_name, args, {})
                queue = options["queue"]
                producer.maybe_declare(queue)
                mode = getattr(queue.exchange, "delivery_mode", None) or app.conf.task_default_delivery_mode
                route = routes[(queue_name, task_name)] = (queue.name, mode)
            task_id = str(uuid.uuid4())
            headers = {**template.headers, "id": task_id, "root_id": task_id, "argsrepr": repr(args)}
            producer.publish(
                json.dumps([list(args), {}, template.body[2]]),
                exchange="", routing_key=route[0], delivery_mode=route[1], headers=headers,
                content_type="application/json", content_encoding="utf-8", retry=False,
                correlation_id=task_id, reply_to="",
            )


# Each task's message as ``as_task_v2`` builds it, per app and process (its origin names the
# process): built once, not at every pass (a fifth of a millisecond for a lone call's pass).
_TEMPLATES: weakref.WeakKeyDictionary[Any, dict[tuple[int, str], task_message]] = weakref.WeakKeyDictionary()


def _template(app: Any, task_name: str, args: tuple[Any, ...]) -> task_message:
    """Return the message template of ``task_name`` (its id, root id and args replaced per message)."""
    kept = _TEMPLATES.setdefault(app, {})
    key = (os.getpid(), task_name)
    template = kept.get(key)
    if template is None:
        template = kept[key] = app.amqp.as_task_v2("0", task_name, args, {}, ignore_result=True)
    return template


def _batch(producer: Any, size: int) -> contextlib.AbstractContextManager[Any]:
    """Pipeline a pass's messages (``producer.batch``); a lone message goes as it is: on Redis a
    pipeline costs a client of its own (a third of a millisecond) for the same one round trip."""
    return producer.batch(max_size=size) if size > 1 else contextlib.nullcontext()
