"""The call table, with its door ``CallQueue.objects``; the limiter's tables and the attempt history
live in ``dispatcher.tables`` and are re-exported here."""
from __future__ import annotations

from django.db import models
from django.db.models import Q
from django.db.models.functions import Now

from dispatcher.calls.once import HOLDS_UNIQUE_KEY
from dispatcher.managers import CallQueueManager
from dispatcher.states import CallStatus
from dispatcher.tables import Attempt, FairShare, Heartbeat, KeyBucket, KeyState, LearntLimit, RateLimit, StartLog
from dispatcher.validation import StoredJSONDecoder

__all__ = ["Attempt", "CallQueue", "FairShare", "Heartbeat", "KeyBucket", "KeyState", "LearntLimit", "RateLimit", "StartLog"]


class CallQueue(models.Model):
    """One call to a third-party API, from send() to done, failed or cancelled."""

    Status = CallStatus

    WAITING = (Status.PENDING,)
    IN_FLIGHT = (Status.DISPATCHED, Status.RUNNING)
    FINISHED = (Status.DONE, Status.FAILED, Status.CANCELLED)

    method = models.CharField(max_length=100)
    params = models.JSONField(default=dict, blank=True, decoder=StoredJSONDecoder)
    keys = models.JSONField(default=list, blank=True)
    key_set = models.TextField(help_text="The call's keys, sorted and JSON-encoded; calls are claimed per key set.")
    priority = models.IntegerField(default=0)
    queue = models.CharField(max_length=100, blank=True, default="")
    status = models.CharField(max_length=10, choices=Status.choices, default=Status.PENDING)
    run_at = models.DateTimeField(db_default=Now(), help_text="Earliest time of the next start.")
    attempts = models.PositiveIntegerField(default=0, help_text="Attempts started that count against max_attempts.")
    max_attempts = models.PositiveIntegerField(default=3)
    deferrals = models.PositiveIntegerField(default=0, help_text="Times a 429 sent the call back to wait.")
    dispatch_no = models.PositiveIntegerField(default=0, help_text="Increments at every claim; a message carries it.")
    created_at = models.DateTimeField(db_default=Now())
    dispatched_at = models.DateTimeField(null=True, blank=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    result = models.JSONField(null=True, blank=True, decoder=StoredJSONDecoder)
    last_error = models.TextField(blank=True, default="")
    last_traceback = models.TextField(blank=True, default="")
    cost = models.JSONField(
        null=True, blank=True, help_text="Units the call counts against each key's policies, {key: units}; empty: 1 each."
    )
    # Send once (dispatcher.calls.once): while a call holds its unique key, a send with that key
    # stores nothing and returns it.
    unique_key = models.CharField(
        max_length=255, null=True, blank=True, help_text="While this call holds it, a send with this key returns this call."
    )
    unique_until = models.DateTimeField(
        null=True, blank=True, help_text="The call holds its unique key until then, even finished (send's unique_for)."
    )
    unique_released = models.BooleanField(
        default=False, db_default=False,
        help_text="The key was let go: the call finished and its unique_until passed, and another send took the key.",
    )

    # Set on what send() and send_many() return: True for a call stored, False for the call that held the key.
    created: bool

    objects = CallQueueManager()

    class Meta:
        db_table = "dispatcher_call"
        verbose_name = "call"
        indexes = [
            # The dispenser's scan: waiting calls of one key set, most urgent first (then the
            # earliest due, as Django Tasks takes equal priorities by run_after).
            models.Index(
                fields=["key_set", "-priority", "run_at", "id"],
                condition=Q(status=CallStatus.PENDING),
                name="dispatcher_call_waiting_idx",
            ),
            models.Index(
                fields=["run_at"], condition=Q(status=CallStatus.PENDING), name="dispatcher_call_run_at_idx"
            ),
            # The rescue sweep: calls in flight, oldest first.
            models.Index(
                fields=["status", "dispatched_at"],
                condition=Q(status__in=[CallStatus.DISPATCHED, CallStatus.RUNNING]),
                name="dispatcher_call_inflight_idx",
            ),
            # Retention cleanup: finished calls by age.
            models.Index(
                fields=["finished_at"],
                condition=Q(status__in=[CallStatus.DONE, CallStatus.FAILED, CallStatus.CANCELLED]),
                name="dispatcher_call_finished_idx",
            ),
            models.Index(fields=["status", "method"], name="dispatcher_call_status_idx"),
        ]
        constraints = [
            models.CheckConstraint(
                condition=Q(status__in=CallStatus.values),
                name="dispatcher_call_status_valid",
            ),
            models.CheckConstraint(condition=Q(max_attempts__gte=1), name="dispatcher_call_max_attempts_gte_1"),
            # One holder per unique key: send()'s INSERT ... ON CONFLICT (or its savepoint) meets it.
            models.UniqueConstraint(
                fields=["unique_key"], condition=HOLDS_UNIQUE_KEY, name="dispatcher_call_unique_key_held"
            ),
        ]

    def __str__(self) -> str:
        return f"#{self.pk} {self.method} ({self.status})"

    def cost_of(self, key: str) -> int:
        """Return the units the call counts against one of its keys."""
        return int((self.cost or {}).get(key, 1))

    @property
    def is_retry_wait(self) -> bool:
        """Whether the call waits for a retry, having been tried before."""
        return self.status == self.Status.PENDING and self.attempts > 0
