"""The statements every start and finish sends, prepared where the site's connection allows it.

A start's statements and a finish's are long (a few kB, several tables written in one
statement): on PostgreSQL, planning one took longer than running it (measured: the start's
mark 2.0 ms at the server, 0.5 ms of it running; prepared, 0.5 ms). psycopg 3 prepares a
statement once it has run ``prepare_threshold`` times on a connection, but only on a cursor that
binds its parameters on the server, and Django turns both off by default, as a pooler in
transaction mode (PgBouncer before 1.21, or without ``max_prepared_statements``) would run a
statement prepared on one client's server connection for another's.

So this is the site's choice, made where Django makes it: ``OPTIONS["prepare_threshold"]`` (with
dj-database-url, ``?prepare_threshold=5`` on ``DATABASE_URL``). Set, the start's and finish's own
statements run on a server-binding cursor and are prepared after that many runs, whatever
``server_side_binding`` says for the ORM's queries; unset (Django's default), they run as
every other query. A statement sent this way cannot carry a second one, so a folded start
(``dispatcher.store.folded``) then sends its COMMIT on its own: one round trip more, less than
the planning it saves.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from django.db import connections
from django.db.backends.utils import CursorDebugWrapper, CursorWrapper

from dispatcher.store import schema


def preparing(db: str) -> bool:
    """Whether ``db``'s connection lets psycopg prepare statements (the site set ``prepare_threshold``)."""
    connection = connections[db]
    if not schema.postgresql_path(db) or getattr(connection, "Database", object).__name__ != "psycopg":
        return False
    return connection.settings_dict.get("OPTIONS", {}).get("prepare_threshold") is not None


@contextlib.contextmanager
def cursor(db: str) -> Iterator[Any]:
    """A cursor for a hot statement (a start's, a finish's, a dispense pass's): Django's wrapper on a
    server-binding psycopg cursor where ``preparing``, so psycopg prepares what runs often; else
    Django's own cursor."""
    connection = connections[db]
    if not preparing(db):
        with connection.cursor() as plain:
            yield plain
        return
    connection.ensure_connection()
    with connection.wrap_database_errors:
        # The backend's driver module is psycopg here (``preparing``): its Cursor binds on the server.
        raw = connection.Database.Cursor(connection.connection)  # type: ignore[attr-defined]
    wrapped = _Logged(raw, connection) if connection.queries_logged else CursorWrapper(raw, connection)
    with wrapped:
        yield wrapped


class _Logged(CursorDebugWrapper):
    """Django's debug cursor (``connection.queries``, the ``django.db.backends`` log), showing each
    statement as written: Django reads the text of a run from psycopg, which keeps none for a
    prepared statement's (it would log None)."""

    def debug_sql(
        self, sql: str | None = None, params: Any = None, use_last_executed_query: bool = False, many: bool = False
    ) -> contextlib.AbstractContextManager[None]:
        return super().debug_sql(sql, params, use_last_executed_query=False, many=many)
