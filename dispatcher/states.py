"""The vocabularies every view reads: a call's states, an attempt's outcomes and why a waiting call
waits; in a module of their own so that the modules below the models use them without importing
the models."""
from __future__ import annotations

import enum

from django.db import models


class CallStatus(models.TextChoices):
    """Where a call is in its life; ``CallQueue.Status``."""

    PENDING = "pending", "Waiting"
    """Waiting: never tried, waiting for a retry (attempts > 0), or deferred by a 429."""
    DISPATCHED = "dispatched", "Dispatched"
    """Claimed by a dispenser and published to Celery; not yet started by a worker."""
    RUNNING = "running", "Running"
    """A worker is running the handler."""
    DONE = "done", "Done"
    """The handler returned; the result is stored."""
    FAILED = "failed", "Failed"
    """Gave up: a permanent error, or max_attempts spent."""
    CANCELLED = "cancelled", "Cancelled"
    """Cancelled before it ran."""


class AttemptOutcome(models.TextChoices):
    """How one attempt of a call ended; ``Attempt.Outcome``. Where an attempt's state is its call's
    (running, done), it is named by the call's word: one vocabulary on every screen."""

    RUNNING = CallStatus.RUNNING.value, CallStatus.RUNNING.label
    """Started and not finished yet."""
    DONE = CallStatus.DONE.value, CallStatus.DONE.label
    """The handler returned."""
    ERROR = "error", "Error (retryable)"
    """The handler raised; the call retries while attempts remain."""
    FAILED = "failed", "Failed (permanent)"
    """The handler raised a permanent error; the call failed."""
    RATE_LIMITED = "rate_limited", "Rate limited (429)"
    """A 429: the call waits again and the attempt is refunded."""
    MISSED = "missed", "Missed its send moment"
    """Its request was held for a moment its worker came too late for, after a later start was
    judged on its keys: it was not sent; the call waits again and the attempt is refunded."""
    LOST = "lost", "Lost (rescued)"
    """No outcome within DISPATCHER_RUN_TIMEOUT: the rescue sweep ended it."""


class WaitKind(enum.StrEnum):
    """What holds a waiting call back: the limiter's verdicts and the call's own schedule alike."""

    RUN_AT = "run_at"
    """Its ``run_at`` has not come (sent for later)."""
    BACKOFF = "backoff"
    """It failed and waits for its retry's delay."""
    DEFERRED = "deferred"
    """A 429 sent it back to wait for the API's Retry-After."""
    PAUSED = "paused"
    """One of its keys is paused (by an operator, or by a 429)."""
    CONCURRENCY = "concurrency"
    """One of its keys has as many calls in flight as its concurrency cap."""
    RATE = "rate"
    """A configured policy (window or bucket) of one of its keys has no room for it."""
    LEARNT = "learnt"
    """A limit the API announced for one of its keys has no room for it."""
    QUEUED = "queued"
    """Calls queued before it on one of its keys take that key's room first."""
