"""A call's states, in a module of their own so the managers can use them without importing the models."""
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
