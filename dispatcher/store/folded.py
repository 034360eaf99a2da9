"""A start's or a claim's transaction on PostgreSQL in fewer round trips: BEGIN and COMMIT ride along.

A start (``CallQueueManager.start`` and ``start_many``) is one short transaction: lock the keys'
rows, read their windows, mark the calls running. Under ``transaction.atomic`` psycopg sends BEGIN
on its own before the lock and Django sends COMMIT on its own after the mark: six round trips
with the call's head read before. Every round trip is a wait for the GIL to come back under
Celery's ``threads`` pool, and the key's row stays locked for all of them.

Here the lock statement is sent as ``BEGIN; <lock>`` and the mark as ``<mark>; COMMIT``, each one
round trip (a multi-statement query, which psycopg's client-side binding cursors, Django's
default, send as one); a start's lock also reads its calls' heads after it
(``locks.lock_keys_of_calls``), and a dispense pass's claim sends its counters as
``<counters>; COMMIT`` (``calls.dispense``). The transaction is ours, not Django's, so nothing
inside it may open an ``atomic`` block (Django would try to leave autocommit inside a
transaction): the start's code does not, nor a claim's whose key sets share no key (fair turns
are written through the ORM: such a claim is not folded), and the one place that would,
creating key rows a claim had not created, asks for the plain transaction instead
(``Unfoldable``). When the block ends without a COMMIT sent (a call deferred, a start early, an
error) the transaction is committed or, after an error, rolled back.

Only where it is safe: PostgreSQL with psycopg 3's client-side binding, in autocommit, outside any
``atomic`` block. Elsewhere ``start_transaction`` is ``transaction.atomic``.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TypeVar

from django.db import DatabaseError, connections, transaction

from dispatcher.store import schema

T = TypeVar("T")


class Unfoldable(Exception):
    """Raised inside a folded start that needs Django's transaction (see the module's docstring)."""


class Folded:
    """The state of a folded start: whether BEGIN has gone out, and whether COMMIT has."""

    def __init__(self) -> None:
        self.begun = False
        self.committed = False

    def begin(self, statement: str) -> str:
        """The first statement of the transaction, with its BEGIN."""
        assert not self.begun, "BEGIN sent twice"
        self.begun = True
        return f"BEGIN; {statement}"

    def commit(self, statement: str) -> str:
        """The last statement of the transaction, with its COMMIT (as it is if none began)."""
        if not self.begun:
            return statement  # atomic by itself
        self.committed = True
        return f"{statement}; COMMIT"


def can_fold(db: str) -> bool:
    """Whether a start on ``db`` may send its BEGIN and COMMIT with its statements."""
    connection = connections[db]
    if not schema.postgresql_path(db) or connection.in_atomic_block or not connection.get_autocommit():
        return False
    # Several statements in one query need client-side binding (psycopg 3's ClientCursor, which
    # Django uses unless OPTIONS["server_side_binding"]); the transaction's state is read from it.
    psycopg3 = getattr(connection, "Database", object).__name__ == "psycopg"
    return psycopg3 and not connection.settings_dict.get("OPTIONS", {}).get("server_side_binding")


def folding(start: Callable[[bool], T]) -> T:
    """Run ``start(fold)`` folded, and again in Django's transaction if it raised ``Unfoldable``."""
    try:
        return start(True)
    except Unfoldable:
        return start(False)


@contextlib.contextmanager
def start_transaction(db: str, fold: bool = True) -> Iterator[Folded | None]:
    """The transaction of one start: ``Folded`` where ``can_fold``, else ``transaction.atomic`` (None)."""
    if not (fold and can_fold(db)):
        with transaction.atomic(using=db):
            yield None
        return
    folded = Folded()
    try:
        yield folded
    except BaseException:
        _end(db, folded, "ROLLBACK")
        raise
    _end(db, folded, "COMMIT")


def _end(db: str, folded: Folded, command: str) -> None:
    """End the transaction if BEGIN went out and it is still open (a failed statement leaves it open)."""
    if not folded.begun or (folded.committed and command == "COMMIT"):
        return
    connection = connections[db]
    raw = connection.connection
    # psycopg's pq.TransactionStatus, by name: this module loads on databases without psycopg.
    status = None if raw is None or raw.closed else raw.info.transaction_status.name
    if status in (None, "IDLE"):  # closed, or nothing open
        return
    if status != "INTRANS":  # failed (or unknown): only a rollback ends it
        command = "ROLLBACK"
    try:
        with connection.cursor() as cursor:
            cursor.execute(command)
    except DatabaseError:
        if command == "COMMIT":
            raise
        # The connection is gone or unusable: closing it ends the transaction on the server.
        connection.close()
