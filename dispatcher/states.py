"""A call's states and an attempt's outcomes, in a module of their own so that the modules below the
models (managers, limiter, sql) use them without importing the models."""
from __future__ import annotations

from django.db import models


class CallStatus(models.TextChoices):
    """Where a call is in its life; ``CallQueue.Status``."""

    # Waiting: never tried, waiting for a retry (attempts > 0), or deferred by a 429.
    PENDING = "pending", "Pending"
    # Claimed by a dispenser and published to Celery; not yet started by a worker.
    DISPATCHED = "dispatched", "Dispatched"
    # A worker is running the handler.
    RUNNING = "running", "Running"
    # The handler returned; the result is stored.
    DONE = "done", "Done"
    # Gave up: a permanent error, or max_attempts spent.
    FAILED = "failed", "Failed"
    # Cancelled before it ran.
    CANCELLED = "cancelled", "Cancelled"


class AttemptOutcome(models.TextChoices):
    """How one attempt of a call ended; ``Attempt.Outcome``."""

    # Started and not finished yet.
    RUNNING = "running", "Running"
    # The handler returned.
    DONE = "done", "Done"
    # The handler raised; the call retries while attempts remain.
    ERROR = "error", "Error (retryable)"
    # The handler raised a permanent error; the call failed.
    FAILED = "failed", "Failed (permanent)"
    # A 429: the call waits again and the attempt is refunded.
    RATE_LIMITED = "rate_limited", "Rate limited (429)"
    # No outcome within DISPATCHER_RUN_TIMEOUT: the rescue sweep ended it.
    LOST = "lost", "Lost (rescued)"
