"""The tables of the limiter and of a call's history: policies, per-key state and counters, the start
log, bucket states, learnt limits, fair turns, attempts and liveness.

They are defined here, below the engine that reads and writes them (``dispatcher.limits``,
``dispatcher.calls``), and re-exported by ``dispatcher.models``, whose ``CallQueue`` carries the
door (``CallQueue.objects``) that imports the engine. Nothing here imports the engine.
"""
from __future__ import annotations

from datetime import timedelta

from django.db import models
from django.db.models import Q
from django.db.models.functions import Now

from dispatcher.limits.shapes import Policy, make_policy
from dispatcher.states import AttemptOutcome

__all__ = ["Attempt", "FairShare", "Heartbeat", "KeyBucket", "KeyState", "LearntLimit", "RateLimit", "StartLog"]


def limit_constraints(table: str) -> list[models.BaseConstraint]:
    """One limit per key and period, a limit of at least 1, a period above zero (a policy or a learnt limit)."""
    return [
        models.UniqueConstraint(fields=["key", "period"], name=f"{table}_key_period_uniq"),
        models.CheckConstraint(condition=Q(limit__gte=1), name=f"{table}_limit_gte_1"),
        models.CheckConstraint(condition=Q(period__gt=timedelta(0)), name=f"{table}_period_gt_0"),
    ]


class Attempt(models.Model):
    """One start of a call by a worker; append-only history shown in the admin."""

    Outcome = AttemptOutcome

    call = models.ForeignKey("dispatcher.CallQueue", on_delete=models.CASCADE, related_name="attempt_set")
    number = models.PositiveIntegerField(help_text="Which attempt of the call this is, from 1.")
    started_at = models.DateTimeField()
    finished_at = models.DateTimeField(null=True, blank=True)
    outcome = models.CharField(max_length=20, choices=Outcome.choices, default=Outcome.RUNNING)
    error = models.TextField(blank=True, default="")
    worker = models.CharField(max_length=200, blank=True, default="")

    class Meta:
        db_table = "dispatcher_attempt"
        ordering = ["call_id", "id"]
        indexes = [
            models.Index(fields=["call", "id"], name="dispatcher_attempt_call_idx"),
            # The dashboard's last hour (outcomes per minute, errors per key): attempts by finish.
            models.Index(fields=["finished_at"], name="dispatcher_attempt_finish_idx"),
        ]

    def __str__(self) -> str:
        return f"attempt {self.number} of call #{self.call_id}: {self.outcome}"


class RateLimit(models.Model):
    """A policy: ``limit`` units per ``period`` for a key (a sliding window, or a token bucket with
    ``burst``), and at most ``concurrency`` in flight."""

    key = models.CharField(
        max_length=200, help_text="An exact key, or a pattern ending in '*' giving each matching key its own limit."
    )
    limit = models.PositiveIntegerField(help_text="Units that may start per period.")
    period = models.DurationField(help_text="Length of the window, or the time a bucket takes to refill `limit` units.")
    burst = models.PositiveIntegerField(
        null=True, blank=True,
        help_text="Empty: a sliding window (at most `limit` in any period). Set: a token bucket this deep, "
        "refilling at `limit` per period; 1 spaces calls evenly.",
    )
    concurrency = models.PositiveIntegerField(
        null=True, blank=True, help_text="Most calls of the key dispatched or running at once."
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        db_table = "dispatcher_ratelimit"
        ordering = ["key", "period"]
        constraints = [
            *limit_constraints("dispatcher_ratelimit"),
            models.CheckConstraint(
                condition=Q(concurrency__isnull=True) | Q(concurrency__gte=1),
                name="dispatcher_ratelimit_concurrency_gte_1",
            ),
            models.CheckConstraint(
                condition=Q(burst__isnull=True) | Q(burst__gte=1), name="dispatcher_ratelimit_burst_gte_1"
            ),
        ]

    def __str__(self) -> str:
        text = f"{self.key}: {self.as_policy().label()}"
        if self.concurrency:
            text += f", {self.concurrency} concurrent"
        return text

    def as_policy(self) -> Policy:
        """Return the pure policy object of this row (a window, or a bucket with a burst)."""
        return make_policy(self.key, self.limit, self.period, self.burst, self.concurrency)


class KeyState(models.Model):
    """The limiter's lock row and counters for one key (or a pattern's pause)."""

    key = models.CharField(max_length=200, primary_key=True)
    reserved = models.IntegerField(default=0, help_text="Calls dispatched and not yet started.")
    reserved_units = models.IntegerField(default=0, help_text="Units of the calls dispatched and not yet started.")
    total = models.BigIntegerField(default=0, help_text="Units ever started under the key: the start log's running total.")
    paused_until = models.DateTimeField(null=True, blank=True)
    pause_reason = models.CharField(max_length=200, blank=True, default="")
    # The arrival guard learnt from the workers (guard.DelayMemory): the largest
    # start-to-send delay measured since ``send_delay_since`` and in the span before it.
    send_delay_us = models.BigIntegerField(default=0, db_default=0, help_text="Largest start-to-send delay measured lately (µs).")
    send_delay_prev_us = models.BigIntegerField(default=0, db_default=0, help_text="The same, in the span before.")
    send_delay_since = models.DateTimeField(null=True, blank=True)
    # Starts whose request arrived later than their windows counted them under, kept instead of
    # their delay (guard.LateStart): "start_us:reach_us:units", ";" between them.
    late_starts = models.TextField(
        blank=True, default="", db_default="", help_text="Starts whose request arrived late, each counted by its own arrival."
    )
    # Set by ``ratelimit weight``: the share of a shared key that key sets carrying this key get.
    weight = models.PositiveIntegerField(
        null=True, blank=True, help_text="Share of a shared key's room its key sets get against others (empty: 1)."
    )
    # Set when a call of the key first finished (its API answered, or its handler returned):
    # until then a dispenser sends the key's calls one per message, so that a group started at
    # once cannot outrun what the first answers teach (learning.py).
    answered_at = models.DateTimeField(
        null=True, blank=True, help_text="When a call of the key first finished (until then its calls go one per message)."
    )

    class Meta:
        db_table = "dispatcher_keystate"

    def __str__(self) -> str:
        return self.key


class StartLog(models.Model):
    """One start under one key: the sliding-window log, with the key's running total of units.

    A window's count is the key's total less the running total before the window's first
    start: two index probes, whatever the number of starts in the window.
    """

    key = models.CharField(max_length=200)
    started_at = models.DateTimeField()
    units = models.IntegerField(default=1)
    cum = models.BigIntegerField(default=0, help_text="The key's running total of units, this start included.")
    # No foreign key: the log outlives pruned calls; it only finds a start again to correct its cost.
    call_id = models.BigIntegerField(null=True, blank=True)

    class Meta:
        db_table = "dispatcher_keystart"
        indexes = [
            models.Index(fields=["key", "started_at"], name="dispatcher_keystart_key_idx"),
            models.Index(fields=["key", "cum"], name="dispatcher_keystart_cum_idx"),
        ]

    def __str__(self) -> str:
        return f"{self.key} @ {self.started_at.isoformat()}"


class Heartbeat(models.Model):
    """A dispenser or worker process saying it is alive (see dispatcher.liveness)."""

    class Kind(models.TextChoices):
        # A `dispense --loop` process.
        DISPENSER = "dispenser", "Dispenser"
        # Beat's dispense task, in whichever worker runs it: it dispenses, but is no dispenser process.
        BEAT_TASK = "beat_task", "Beat's dispense task"
        # A Celery worker (its main process; the pool's children run the calls).
        WORKER = "worker", "Worker"

    name = models.CharField(max_length=200, primary_key=True, help_text="Process identity: kind, host and pid.")
    kind = models.CharField(max_length=10, choices=Kind.choices)
    started_at = models.DateTimeField(db_default=Now())
    seen_at = models.DateTimeField(db_default=Now(), help_text="Its latest heartbeat.")
    stopped_at = models.DateTimeField(null=True, blank=True, help_text="Set when it shut down cleanly.")
    slots = models.PositiveIntegerField(
        null=True, blank=True,
        help_text="A worker's pool size: the messages it runs at once (dispensers size their messages by it).",
    )

    class Meta:
        db_table = "dispatcher_heartbeat"
        indexes = [models.Index(fields=["kind", "-seen_at"], name="dispatcher_heartbeat_kind_idx")]

    def __str__(self) -> str:
        return self.name


class LearntLimit(models.Model):
    """A limit an API announced for a key, applied beside the configured policies until it expires."""

    key = models.CharField(max_length=200)
    limit = models.PositiveIntegerField(help_text="Most calls the API allows per period.")
    period = models.DurationField(help_text="The API's window (the longest seen when it does not name one).")
    expires_at = models.DateTimeField(help_text="The limit is forgotten then, unless the API repeats it.")
    source = models.CharField(max_length=40, help_text="Which headers said it: ietf, x-ratelimit, ratelimit, handler.")
    signal = models.CharField(max_length=200, blank=True, default="", help_text="The last signal the API gave.")
    observed_at = models.DateTimeField()

    class Meta:
        db_table = "dispatcher_learntlimit"
        ordering = ["key", "period"]
        constraints = limit_constraints("dispatcher_learntlimit")
        indexes = [models.Index(fields=["expires_at"], name="dispatcher_learntlimit_exp_idx")]

    def __str__(self) -> str:
        return f"{self.key}: {self.limit} per {self.period.total_seconds():g}s (learnt from {self.source})"


class KeyBucket(models.Model):
    """A token bucket's state for one key and one policy: GCRA's theoretical arrival time."""

    key = models.CharField(max_length=200)
    period = models.DurationField(help_text="The period of the bucket's policy.")
    tat_us = models.BigIntegerField(help_text="When the bucket is full again, microseconds since the epoch.")
    since = models.DateTimeField(help_text="The first start this state counts; a cost correction of an earlier start leaves it.")
    start = models.BigIntegerField(
        null=True, blank=True,
        help_text="The start that charged it last (a token): a late request moves it on only while it stands.",
    )

    class Meta:
        db_table = "dispatcher_keybucket"
        constraints = [models.UniqueConstraint(fields=["key", "period"], name="dispatcher_keybucket_key_period_uniq")]

    def __str__(self) -> str:
        return f"{self.key} per {self.period}"


class FairShare(models.Model):
    """How much of the keys it shares a key set has been given: its turn among the key sets it competes with."""

    key_set = models.TextField(unique=True)
    served = models.FloatField(default=0, help_text="Units claimed for the key set while it competed, over its weight.")
    updated_at = models.DateTimeField()

    class Meta:
        db_table = "dispatcher_fairshare"
        indexes = [models.Index(fields=["updated_at"], name="dispatcher_fairshare_upd_idx")]

    def __str__(self) -> str:
        return f"{self.key_set}: {self.served:g}"
