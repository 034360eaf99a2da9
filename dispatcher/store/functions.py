"""The hottest statements as PL/pgSQL functions, planned once per database session, not at every run:
a dispense pass's key sets, claim and next due moment, a start's mark, a successful finish.

With Django's default client-side binding PostgreSQL parses and plans every statement at every
run, and these plan far longer than they run (measured, docs/performance.md: a
start's mark 1.4-1.9 ms inline, 0.5 ms as a function; a claim 0.57 against 0.29 ms; a pass's
key sets 0.76 against 0.31 ms; a successful finish 0.74 against 0.30 ms).
Preparing them (``store.prepared``, the site's choice) saves the parse but not the plan: the
plan cache keeps choosing a custom plan for them. A PL/pgSQL function keeps its statement's
plan for the session, here always the generic one (``plan_cache_mode``), and unlike a prepared
statement it lives in the database, not in one server connection, so a pooler in transaction
mode (PgBouncer) may hand each transaction to any connection.

Each function's name ends with a hash of its definition, so code and database never disagree:
``migrate`` creates the functions of the code it runs (``install``, at ``post_migrate``) and
leaves other versions' in place for processes still running older code; a process uses the
functions only once it has seen them all in its database (``installed``, asked once per
process and database), and until then sends the statements as they are. The statuses are
written into the functions as constants, so the generic plan still matches the partial indexes.
"""
from __future__ import annotations

import enum
import functools
import hashlib
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from django.db import connections, router

from dispatcher.states import CallStatus
from dispatcher.store import call_sql, schema

# The parameters written into the functions as constants (a claim's and a start's statuses).
_CONSTANTS = {
    "pending": CallStatus.PENDING.value, "dispatched": CallStatus.DISPATCHED.value, "running": CallStatus.RUNNING.value,
    "done": CallStatus.DONE.value,
}
# The types of the parameters the statements do not cast themselves.
_TYPES = {
    "now": "timestamptz", "n": "integer", "outcome": "text", "worker": "text", "b_start": "bigint", "after": "text",
    "limit": "integer", "channel": "text",
}
_PARAM = re.compile(r"%\((\w+)\)s(?:::([a-z]+(?:\[\])?))?")


@dataclass(frozen=True)
class Function:
    """One statement as a function: ``name`` (with its hash), ``definition`` (to create it) and
    ``statement`` (to call it: the same parameters and the same rows as the statement inline)."""

    name: str
    definition: str
    statement: str


def _function(stem: str, body: str, returns: str) -> Function:
    """``body`` (a statement with %(name)s parameters) as a function returning ``returns``, and
    the statement that calls it with the same parameters.

    The result names its columns' types rather than a table's row type: a function whose result
    is a table's type would keep the table from being dropped (``migrate dispatcher zero``).
    """
    types: dict[str, str] = {}
    for name, cast in _PARAM.findall(body):
        if name not in _CONSTANTS:
            types.setdefault(name, cast or _TYPES[name])
    arguments = sorted(types)

    def written(match: re.Match[str]) -> str:
        name = match.group(1)
        value = f"'{_CONSTANTS[name]}'" if name in _CONSTANTS else f"p_{name}"
        return value + (f"::{match.group(2)}" if match.group(2) else "")

    code = _PARAM.sub(written, body)
    signature = ", ".join(f"p_{name} {types[name]}" for name in arguments)
    # The search_path is the caller's: the tables are found where the site's migrations made them.
    tail = (
        f"({signature}) RETURNS {returns} LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan"
        f" AS $body$ BEGIN RETURN QUERY {code}; END $body$"
    )
    name = f"dispatcher_{stem}_{hashlib.sha256(tail.encode()).hexdigest()[:12]}"
    call = ", ".join(f"%({name})s::{types[name]}" for name in arguments)
    return Function(name, f"CREATE OR REPLACE FUNCTION {name}{tail}", f"SELECT * FROM {name}({call})")


def _result_type(field: Any, using: str) -> str:
    # The column's type without its modifier (varchar(100) -> varchar): a function's result has none.
    return re.sub(r"\(.*\)", "", field.db_type(connections[using]))


def _call_columns(names: Iterable[str], prefix: str, using: str) -> tuple[str, str]:
    """The call's columns ``names`` as a function returns them (each cast to its type, read from
    ``prefix``) and the result columns that declare them (r_<column>), in order."""
    fields = [schema.field_of("CallQueue", name) for name in names]
    returned = ", ".join(f"{prefix}{schema.quote(f.column)}::{_result_type(f, using)}" for f in fields)
    declared = ", ".join(f"r_{f.column} {_result_type(f, using)}" for f in fields)
    return returned, declared


def _call_fields() -> list[str]:
    return [field.name for field in schema.meta("CallQueue").concrete_fields]


@functools.cache
def claim(using: str) -> Function:
    """``call_sql.claim_due`` as a function: the columns of CLAIMED, each declared with its type."""
    returned, declared = _call_columns(call_sql.CLAIMED, f"{schema.table('CallQueue')}.", using)
    body = f"WITH claimed AS ({call_sql.claim_due(returned)}) SELECT * FROM claimed"
    return _function("claim", body, f"TABLE ({declared})")


@functools.cache
def mark(buckets: bool, using: str) -> Function:
    """``call_sql.mark_running_group`` as a function: every column of the call, each declared with its type."""
    returned, declared = _call_columns(_call_fields(), "started.", using)
    returns = f"TABLE (r_attempt bigint, r_number integer, r_moved bigint[], {declared})"
    return _function("mark", call_sql.mark_running_group(buckets, returned), returns)


@functools.cache
def key_sets() -> Function:
    """``call_sql.waiting_key_sets_with_version`` as a function (a dispense pass's first statement)."""
    returns = "TABLE (r_now timestamptz, r_version bigint, r_key_sets text[])"
    return _function("key_sets", call_sql.waiting_key_sets_with_version(), returns)


@functools.cache
def next_due() -> Function:
    """``call_sql.next_due`` as a function (after a dispense pass that left calls not yet due)."""
    return _function("next_due", call_sql.next_due(), "TABLE (r_due timestamptz)")


@functools.cache
def finish_done() -> Function:
    """``call_sql.finish_done_many`` as a function (the successful attempts of a message, or one)."""
    return _function("finish_done", call_sql.finish_done_many(), "TABLE (r_id bigint)")


def every(using: str) -> list[Function]:
    return [claim(using), mark(True, using), mark(False, using), key_sets(), next_due(), finish_done()]


def install(using: str) -> None:
    """Create this code's functions in ``using``'s database (PostgreSQL only)."""
    if not schema.postgresql_path(using):
        return
    with connections[using].cursor() as cursor:
        for function in every(using):
            cursor.execute(function.definition)
    _installed[_place(using)] = True


def on_post_migrate(sender: Any = None, using: str = "default", **kwargs: Any) -> None:
    """Install where migrate put the calls' table (a database router may keep it elsewhere)."""
    if router.allow_migrate_model(using, schema.meta("CallQueue").model):
        install(using)


_installed: dict[tuple[str, str], bool] = {}


def _place(using: str) -> tuple[str, str]:
    return using, str(connections[using].settings_dict.get("NAME"))


def installed(using: str) -> bool:
    """Whether ``using``'s database holds every function of this code (read once per process and database)."""
    place = _place(using)
    if place not in _installed:
        with connections[using].cursor() as cursor:
            cursor.execute(
                "SELECT bool_and(to_regproc(name) IS NOT NULL) FROM unnest(%s::text[]) AS name",
                [[function.name for function in every(using)]],
            )
            _installed[place] = bool(cursor.fetchone()[0])
    return _installed[place]


def forget() -> None:
    """Ask the database again at the next use (tests that drop or create the functions)."""
    _installed.clear()


# Each hot statement as ``using`` runs it: its function's call where installed, else inline.


def bind(using: str, params: dict[str, Any]) -> dict[str, Any]:
    """``params`` as the hot statement ``*_statement(using)`` returns takes them most cheaply.

    An installed function's call casts every parameter itself (``%(ids)s::bigint[]``), so a list
    of integers (or NULLs) may go as its array's literal and a choice as its value, which psycopg
    quotes as a plain string: adapting a list costs it 7-12 µs on this code's machine, a string
    under 1.5 µs, and a start's mark and a finish carry a dozen lists (0.2-0.3 ms of a call's
    CPU in the worker, docs/performance.md). The statements inline (functions not installed) use
    some parameters twice, once without a cast, and take them as they are.
    """
    if not installed(using):
        return params
    return {name: _cheap(value) for name, value in params.items()}


def _cheap(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, list) and value and all(item is None or type(item) is int for item in value):
        return "{" + ",".join("NULL" if item is None else str(item) for item in value) + "}"
    return value


def claim_statement(using: str) -> str:
    return claim(using).statement if installed(using) else call_sql.claim_due()


def mark_statement(using: str, buckets: bool) -> str:
    return mark(buckets, using).statement if installed(using) else call_sql.mark_running_group(buckets)


def key_sets_statement(using: str) -> str:
    return key_sets().statement if installed(using) else call_sql.waiting_key_sets_with_version()


def next_due_statement(using: str) -> str:
    return next_due().statement if installed(using) else call_sql.next_due()


def finish_done_statement(using: str) -> str:
    return finish_done().statement if installed(using) else call_sql.finish_done_many()
