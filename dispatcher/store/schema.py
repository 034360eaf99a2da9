"""The shared pieces of the hand-written statements: tables and columns from the models' ``_meta``,
the clock, wake-ups, and which path a database takes.

The ORM writes every other query. A statement is written by hand only where the ORM cannot say
it (a loose index scan, data-modifying CTEs, ``FOR UPDATE SKIP LOCKED`` inside ``LATERAL``) or
where compiling its ORM form costs more than running it on a hot path (every claim, start and
finish). Tables and columns come from the models' ``_meta``, never typed by hand. Each statement
(``limit_sql``, ``call_sql``) is a function returning its text, computed once per process; the
caller runs it on ``connections[alias]`` with its manager's alias, never on the default
``connection``. Most are PostgreSQL's; on other databases the operation takes the ORM's path.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from django.apps import apps
from django.db import connections
from django.db.models import Field
from django.db.models.options import Options

# The database's clock, read now (not at transaction start): see dispatcher.clock.
CLOCK = "clock_timestamp()"
READ_CLOCK = f"SELECT {CLOCK}"
# A NOTIFY on a channel, delivered when the transaction commits.
NOTIFY = "SELECT pg_notify(%s, '')"


def postgresql_path(alias: str) -> bool:
    """Whether an operation on the database ``alias`` takes its PostgreSQL statement, not the ORM's path."""
    return connections[alias].vendor == "postgresql"


def meta(model: str) -> Options[Any]:
    # Looked up in the app registry rather than imported: this module sits below the models.
    options: Options[Any] = apps.get_model("dispatcher", model)._meta
    return options


def quote(name: str) -> str:
    """Return an identifier quoted as standard SQL (PostgreSQL and SQLite both read it)."""
    return '"' + name.replace('"', '""') + '"'


def table(model: str) -> str:
    """Return a dispatcher model's table, quoted."""
    return quote(meta(model).db_table)


def field_of(model: str, name: str) -> Field[Any, Any]:
    """Return a dispatcher model's field that has a column of its own."""
    found = meta(model).get_field(name)
    if not isinstance(found, Field) or not found.column:
        raise LookupError(f"{model}.{name} has no column")
    return found


def column(model: str, name: str) -> str:
    """Return the column of a dispatcher model's field, quoted."""
    found = field_of(model, name)
    assert found.column  # field_of checked it
    return quote(found.column)


def columns(model: str, prefix: str = "") -> str:
    """Return all the model's columns in ``concrete_fields`` order (the order ``from_db`` takes)."""
    return ", ".join(prefix + quote(f.column) for f in meta(model).concrete_fields)


def insert_clause(model: str, values: Mapping[str, str]) -> tuple[str, str]:
    """Return the column list and the matching value list of an INSERT, from {field name: SQL expression}."""
    return ", ".join(column(model, name) for name in values), ", ".join(values.values())


def assignments(model: str, values: Mapping[str, str]) -> str:
    """Return an UPDATE's SET list from {field name: SQL expression}."""
    return ", ".join(f"{column(model, name)} = {value}" for name, value in values.items())


def pg_type(field: Field[Any, Any]) -> str:
    """Return the PostgreSQL type a parameter for the field is cast to (unbounded where the column is bounded)."""
    kind = field.get_internal_type()
    if kind == "JSONField":
        return "jsonb"
    if kind == "DateTimeField":
        return "timestamptz"
    if kind == "BigIntegerField":
        return "bigint"
    if kind.endswith("IntegerField"):
        return "int"
    if kind == "DurationField":
        return "interval"
    return "text"


def epoch_us(expression: str) -> str:
    """A timestamp as whole microseconds since the epoch: a bigint the driver hands back untouched."""
    return f"(EXTRACT(EPOCH FROM {expression}) * 1000000)::bigint"


def lock_key_rows(select: str, keys: str = "%s::text[]") -> str:
    """Lock the KeyState rows of the keys in ``keys`` (a text array: %s by default) in key order,
    as every locker of several keys does."""
    key = column("KeyState", "key")
    return f"SELECT {select} FROM {table('KeyState')} WHERE {key} = ANY({keys}) ORDER BY {key} FOR UPDATE"


# --- the clock and wake-ups ------------------------------------------------------------------


def listen(channel: str) -> str:
    """LISTEN on a wake-up channel (a fixed identifier, never user input)."""
    return f"LISTEN {channel}"


# The policies' version: a counter that every edit of what the policies' query reads bumps (a
