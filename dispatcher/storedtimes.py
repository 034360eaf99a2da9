"""Read timestamps stored out of Python's range without failing (PostgreSQL).

PostgreSQL's ``timestamptz`` holds years 4713 BC to 294276 AD and ``infinity``; Python's
datetime holds years 1 to 9999. ``send()`` refuses such moments now (see
``dispatcher.validation``), but a row written before that, by raw SQL or by another program
would make every read of it raise ``DataError``: the rescue sweep and dispense passes would stop
at it, the worker could not start it, the admin and the status API would answer 500, and the ORM
could not delete it. Each connection therefore reads such a value as the nearest bound
(``EARLIEST`` or ``LATEST``), logs it once, and carries on; the row keeps its stored value until
the dispatcher next writes that column (a retry's ``run_at``, a finish's ``finished_at``).
"""
from __future__ import annotations

import logging
from typing import Any

from dispatcher.validation import EARLIEST, LATEST

log = logging.getLogger("dispatcher")

# The stored values this process has already logged: a row read on every dispense pass is logged
# once, not once a pass. Bounded; cleared when full (a value then logs once more).
_logged: set[str] = set()
MAX_LOGGED = 1_000


def clamping_loader(base: type) -> type:
    """Return a subclass of a timestamptz loader that reads out-of-range values as a bound."""

    class ClampingTimestamptzLoader(base):  # type: ignore[misc]  # psycopg's loader, found at run time
        _dispatcher_clamps = True

        def load(self, data: Any) -> Any:
            try:
                return super().load(data)
            except Exception as exc:  # psycopg.DataError, or ValueError/OverflowError from datetime
                text = bytes(data).decode("ascii", "replace")
                bound = EARLIEST if text.endswith("BC") or text.startswith("-") else LATEST
                if text not in _logged:
                    if len(_logged) >= MAX_LOGGED:
                        _logged.clear()
                    _logged.add(text)
                    log.warning("timestamp_out_of_range stored=%s read_as=%s error=%r", text, bound.isoformat(), exc)
                if not hasattr(self, "timezone"):  # psycopg's own loader: aware, in UTC
                    return bound
                # Django's loader: its time zone, or naive when USE_TZ is off.
                return bound.astimezone(self.timezone) if self.timezone is not None else bound.replace(tzinfo=None)

    return ClampingTimestamptzLoader


def install(sender: Any, connection: Any, **kwargs: Any) -> None:
    """Make a new PostgreSQL connection read out-of-range timestamps as bounds (connection_created)."""
    if connection.vendor != "postgresql":
        return
    try:
        from psycopg.postgres import types
        from psycopg.pq import Format
    except ImportError:  # psycopg2: leave it as it is
        return
    adapters = connection.connection.adapters
    oid = types["timestamptz"].oid
    current = adapters.get_loader(oid, Format.TEXT)
    if current is None or getattr(current, "_dispatcher_clamps", False):
        return
    adapters.register_loader("timestamptz", clamping_loader(current))
