"""A logging filter that keeps routine periodic tasks out of the INFO log."""
from __future__ import annotations

import logging
from collections.abc import Iterable


class QuietTasks(logging.Filter):
    """Drop the INFO lines of the named tasks: beat's "Sending due task", a worker's "received" and
    "succeeded". Beat sends the dispense task every few seconds; its three lines would drown the rest.
    Warnings and errors of those tasks pass, as do all lines of other tasks."""

    def __init__(self, tasks: Iterable[str] = ()) -> None:
        super().__init__()
        self.tasks = frozenset(tasks)

    def filter(self, record: logging.LogRecord) -> bool:
        """Return False for an INFO line about one of the tasks."""
        if record.levelno != logging.INFO:
            return True
        # Celery's worker passes the task in ``extra={"data": {...}}``; beat in the message's arguments.
        data = getattr(record, "data", None)
        if isinstance(data, dict):
            names = [data.get("name")]
        elif isinstance(record.args, tuple):
            names = list(record.args)
        else:
            names = []
        return not any(isinstance(name, str) and name in self.tasks for name in names)
