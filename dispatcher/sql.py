"""Every hand-written SQL statement of the app, each named, built from the models' ``_meta``.

The ORM writes every other query. A statement is written by hand here only where the ORM cannot
say it (a loose index scan, data-modifying CTEs, ``FOR UPDATE SKIP LOCKED`` inside ``LATERAL``)
or where compiling its ORM form costs more than running it on a hot path (every claim, start and
finish). Tables and columns come from the models' ``_meta``, never typed by hand, and the pieces
several statements share (locking key rows in key order, the start log's arrays, a time as
microseconds) are built once. Nearly all are PostgreSQL's: the managers take the ORM path on
other databases (see ``managers.py``, where each operation's two paths sit side by side).

Each statement is a function returning its text, computed once per process (the models do not
change after start-up); the caller runs it on ``connections[alias]`` with the alias its manager
uses, never on the default ``connection``.
"""
from __future__ import annotations

import functools
from collections.abc import Mapping

from django.apps import apps
from django.db.models import Field
from django.db.models.options import Options

from dispatcher.states import CallStatus

# The database's clock, read now (not at transaction start): see dispatcher.clock.
CLOCK = "clock_timestamp()"
READ_CLOCK = f"SELECT {CLOCK}"
# A NOTIFY on a channel, delivered when the transaction commits.
NOTIFY = "SELECT pg_notify(%s, '')"


def _meta(model: str) -> Options:
    # Looked up in the app registry rather than imported: this module sits below the models.
    return apps.get_model("dispatcher", model)._meta


def quote(name: str) -> str:
    """Return an identifier quoted as standard SQL (PostgreSQL and SQLite both read it)."""
    return '"' + name.replace('"', '""') + '"'


def table(model: str) -> str:
    """Return a dispatcher model's table, quoted."""
    return quote(_meta(model).db_table)


def column(model: str, name: str) -> str:
    """Return the column of a dispatcher model's field, quoted."""
    return quote(_meta(model).get_field(name).column)


def columns(model: str, prefix: str = "") -> str:
    """Return all the model's columns in ``concrete_fields`` order (the order ``from_db`` takes)."""
    return ", ".join(prefix + quote(f.column) for f in _meta(model).concrete_fields)


def _insert(model: str, values: Mapping[str, str]) -> tuple[str, str]:
    """Return the column list and the matching value list of an INSERT, from {field name: SQL expression}."""
    return ", ".join(column(model, name) for name in values), ", ".join(values.values())


def _assignments(model: str, values: Mapping[str, str]) -> str:
    """Return an UPDATE's SET list from {field name: SQL expression}."""
    return ", ".join(f"{column(model, name)} = {value}" for name, value in values.items())


def _pg_type(field: Field) -> str:
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


def _epoch_us(expression: str) -> str:
    """A timestamp as whole microseconds since the epoch: a bigint the driver hands back untouched."""
    return f"(EXTRACT(EPOCH FROM {expression}) * 1000000)::bigint"


def _lock_key_rows(select: str) -> str:
    """Lock the KeyState rows of the keys in %s (a text array) in key order, as every locker of several keys does."""
    key = column("KeyState", "key")
    return f"SELECT {select} FROM {table('KeyState')} WHERE {key} = ANY(%s::text[]) ORDER BY {key} FOR UPDATE"


# --- the clock and wake-ups ------------------------------------------------------------------


def listen(channel: str) -> str:
    """LISTEN on a wake-up channel (a fixed identifier, never user input)."""
    return f"LISTEN {channel}"


def policies_with_clock(policies: str) -> str:
    """The policies' query (compiled by the ORM) joined to the clock, so one round trip reads both.

    The clock's subquery is evaluated once (PostgreSQL does not flatten a volatile one), and the
    LEFT JOIN returns it even when no policy exists.
    """
    return f"SELECT c.now, p.* FROM (SELECT {CLOCK} AS now) c LEFT JOIN ({policies}) p ON TRUE"


# --- the limiter -------------------------------------------------------------------------------


@functools.cache
def lock_key_states() -> str:
    """Lock and read whole KeyState rows of the keys in %s, in key order."""
    return _lock_key_rows(columns("KeyState"))


@functools.cache
def _bucket_probe() -> str:
    # A bucket's one timestamp (params: key, period).
    key, period = column("KeyBucket", "key"), column("KeyBucket", "period")
    return f"(SELECT {column('KeyBucket', 'tat_us')} FROM {table('KeyBucket')} WHERE {key} = %s AND {period} = %s)"


@functools.cache
def _window_probe() -> str:
    # The running total before a window's first start (params: key, window start): one index probe.
    key, started_at, cum = column("KeyStart", "key"), column("KeyStart", "started_at"), column("KeyStart", "cum")
    return (
        f"(SELECT {cum} - {column('KeyStart', 'units')} FROM {table('KeyStart')}"
        f" WHERE {key} = %s AND {started_at} >= %s ORDER BY {started_at}, {cum} LIMIT 1)"
    )


@functools.cache
def policy_readings(buckets: tuple[bool, ...]) -> str:
    """Read every policy of a check in one row: per policy a bucket's timestamp (True) or a window's base (False)."""
    return "SELECT " + ", ".join(_bucket_probe() if bucket else _window_probe() for bucket in buckets)


@functools.cache
def adjust_reserved(keys: int) -> str:
    """Add to the reserved counters of ``keys`` locked keys, each its own amount, in one statement.

    Params: (key, calls) per key, (key, units) per key, then the keys.
    """
    key = column("KeyState", "key")
    cases = " ".join("WHEN %s THEN %s" for _ in range(keys))
    reserved, units = column("KeyState", "reserved"), column("KeyState", "reserved_units")
    return (
        f"UPDATE {table('KeyState')} SET {reserved} = {reserved} + CASE {key} {cases} END,"
        f" {units} = {units} + CASE {key} {cases} END WHERE {key} IN ({', '.join('%s' for _ in range(keys))})"
    )


@functools.cache
def remember_send_delay() -> str:
    """Keep a measured start-to-send delay (%(us)s microseconds) on keys %(keys)s, each with its
    memory span %(spans)s (dispatcher.policies.remember_delay): a span gone by rolls the memory
    over, a larger delay raises it; other rows are not touched (nor locked)."""
    current, previous = column("KeyState", "send_delay_us"), column("KeyState", "send_delay_prev_us")
    since, key = column("KeyState", "send_delay_since"), column("KeyState", "key")
    rolls = f"s.{since} IS NULL OR m.t >= s.{since} + m.span"
    return f"""
        WITH m AS (
            SELECT k.key, k.span, {CLOCK} AS t FROM unnest(%(keys)s::text[], %(spans)s::interval[]) AS k(key, span)
        )
        UPDATE {table('KeyState')} AS s SET
            {previous} = CASE
                WHEN s.{since} IS NULL OR m.t >= s.{since} + 2 * m.span THEN 0
                WHEN m.t >= s.{since} + m.span THEN s.{current}
                ELSE s.{previous} END,
            {current} = CASE WHEN {rolls} THEN %(us)s ELSE GREATEST(s.{current}, %(us)s) END,
            {since} = CASE WHEN {rolls} THEN m.t ELSE s.{since} END
        FROM m
        WHERE s.{key} = m.key AND ({rolls} OR s.{current} < %(us)s)
    """


# --- calls: send -------------------------------------------------------------------------------

# The fields a new call is given by send(); the other columns take their model default below.
NEW_CALL_FIELDS = ("method", "params", "keys", "key_set", "priority", "queue", "max_attempts", "run_at", "cost")


def _new_call_defaults() -> dict[str, str]:
    # The constant Python defaults of the fields send() leaves alone (attempts, last_error...),
    # as SQL literals; the nullable ones and the database's own defaults are left out (NULL / db_default).
    literals = {}
    for field in _meta("CallQueue").concrete_fields:
        if field.primary_key or field.name in NEW_CALL_FIELDS or field.name == "status" or callable(field.default):
            continue
        if field.has_default() and field.default is not None:
            default = field.default
            literals[field.name] = str(default) if isinstance(default, int) else "'" + default.replace("'", "''") + "'"
    return literals


@functools.cache
def insert_call() -> str:
    """Insert one call; params: NEW_CALL_FIELDS' values in order, then the status.

    run_at defaults to the column's own default (Django's Now() is STATEMENT_TIMESTAMP()), which
    created_at also gets; it comes back as microseconds since the epoch.
    """
    call = _meta("CallQueue")
    values = {}
    for name in NEW_CALL_FIELDS:
        if name == "run_at":
            values[name] = "COALESCE(%(run_at)s::timestamptz, STATEMENT_TIMESTAMP())"
        else:
            values[name] = f"%({name})s::{_pg_type(call.get_field(name))}"
    values["status"] = "%(status)s"
    names, exprs = _insert("CallQueue", {**values, **_new_call_defaults()})
    return (
        f"INSERT INTO {table('CallQueue')} ({names}) VALUES ({exprs})"
        f" RETURNING {column('CallQueue', 'id')}, {_epoch_us(column('CallQueue', 'created_at'))}"
    )


@functools.cache
def insert_calls() -> str:
    """Insert many calls in one statement (all or none), in input order; params: status, rows, params.

    The calls travel as two JSON documents that the server unpacks: the rows (every field of
    NEW_CALL_FIELDS but params) and the params, each an array in the same order.
    """
    call = _meta("CallQueue")
    row_fields = [name for name in NEW_CALL_FIELDS if name != "params"]
    record = ", ".join(f"{name} {_pg_type(call.get_field(name))}" for name in row_fields)
    values = {name: f"c.{name}" for name in NEW_CALL_FIELDS}
    values["run_at"] = "COALESCE(c.run_at, STATEMENT_TIMESTAMP())"
    values["status"] = "%(status)s"
    names, exprs = _insert("CallQueue", {**values, **_new_call_defaults()})
    return f"""
        INSERT INTO {table('CallQueue')} ({names})
        SELECT {exprs}
        FROM ROWS FROM (
            json_to_recordset(%(rows)s::json) AS ({record}),
            jsonb_array_elements(%(params)s::jsonb)
        ) WITH ORDINALITY AS c({', '.join(row_fields)}, params, ord)
        ORDER BY c.ord
        RETURNING {column('CallQueue', 'id')}, {_epoch_us(column('CallQueue', 'created_at'))}
    """


# --- calls: dispense ---------------------------------------------------------------------------


@functools.cache
def waiting_key_sets() -> str:
    """The distinct key sets of waiting calls after %(after)s, in order: a loose index scan of the
    partial waiting index, each step one probe for the next key set; at most %(limit)s."""
    call, key_set = table("CallQueue"), column("CallQueue", "key_set")
    # The status is a literal, so the planner can match the partial index's predicate.
    waiting = f"{column('CallQueue', 'status')} = '{CallStatus.PENDING.value}'"
    return f"""
        WITH RECURSIVE ks(k) AS (
            SELECT MIN({key_set}) FROM {call} WHERE {waiting} AND {key_set} > %(after)s
            UNION ALL
            SELECT (SELECT MIN({key_set}) FROM {call} WHERE {waiting} AND {key_set} > ks.k)
            FROM ks WHERE ks.k IS NOT NULL
        )
        SELECT k FROM ks WHERE k IS NOT NULL LIMIT %(limit)s
    """


@functools.cache
def claim_due() -> str:
    """Mark the due calls of every asking key set dispatched in one statement, skipping rows locked elsewhere.

    One LATERAL scan of the waiting index per key set (%(key_sets)s), each with its own LIMIT (%(wanted)s).
    """
    call = table("CallQueue")
    c = functools.partial(column, "CallQueue")
    sets = _assignments("CallQueue", {
        "status": "%(dispatched)s", "dispatched_at": "%(now)s", "dispatch_no": f"{c('dispatch_no')} + 1",
    })
    returned = ", ".join(c(name) for name in ("id", "dispatch_no", "queue", "key_set", "priority", "cost"))
    return f"""
        UPDATE {call} SET {sets}
        WHERE {c('id')} IN (
            SELECT due.id FROM unnest(%(key_sets)s::text[], %(wanted)s::int[]) AS ask(key_set, wanted)
            CROSS JOIN LATERAL (
                SELECT {c('id')} AS id FROM {call}
                WHERE {c('status')} = %(pending)s AND {c('key_set')} = ask.key_set AND {c('run_at')} <= %(now)s
                ORDER BY {c('priority')} DESC, {c('id')}
                LIMIT ask.wanted
                FOR UPDATE SKIP LOCKED
            ) AS due
        )
        RETURNING {returned}
    """


# --- calls: start and finish -------------------------------------------------------------------

# The start log of one start as three arrays, one row per key (key, units, running total).
_START_LOG = "unnest(%(log_keys)s::text[], %(log_units)s::int[], %(log_cums)s::bigint[]) AS log(key, units, cum)"


@functools.cache
def call_head() -> str:
    """Read what a start checks before any lock: key_set, status, dispatch_no and cost of call %s."""
    names = ", ".join(column("CallQueue", name) for name in ("key_set", "status", "dispatch_no", "cost"))
    return f"SELECT {names} FROM {table('CallQueue')} WHERE {column('CallQueue', 'id')} = %s"


@functools.cache
def mark_running() -> str:
    """Start a call in one statement: the guarded update, the attempt, the start log, buckets, the counters.

    Returns the attempt's id and number, then every column of the call (``columns`` order).
    """
    c = functools.partial(column, "CallQueue")
    k = functools.partial(column, "KeyState")
    started = _assignments("CallQueue", {
        "status": "%(running)s", "started_at": "%(now)s", "attempts": f"{c('attempts')} + 1",
    })
    attempt_columns, attempt_values = _insert("Attempt", {
        "call": c("id"), "number": f"{c('attempts')} + {c('deferrals')}", "started_at": "%(now)s",
        "outcome": "%(running)s", "error": "''", "worker": "%(worker)s",
    })
    log_columns, log_values = _insert("KeyStart", {
        "key": "log.key", "started_at": "%(now)s", "units": "log.units", "cum": "log.cum", "call_id": "started.id",
    })
    bucket_columns, bucket_values = _insert("KeyBucket", {
        "key": "b.key", "period": "b.period", "tat_us": "b.tat_us", "since": "%(now)s",
    })
    counters = _assignments("KeyState", {
        "reserved": f"{k('reserved')} - 1", "reserved_units": f"{k('reserved_units')} - log.units",
        "running": f"{k('running')} + 1", "total": "log.cum",
    })
    return f"""
        WITH started AS (
            UPDATE {table('CallQueue')} SET {started}
            WHERE {c('id')} = %(id)s AND {c('status')} = %(dispatched)s AND {c('dispatch_no')} = %(dispatch_no)s
            RETURNING *
        ), attempt AS (
            INSERT INTO {table('Attempt')} ({attempt_columns})
            SELECT {attempt_values} FROM started
            RETURNING {column('Attempt', 'id')} AS id, {column('Attempt', 'number')} AS number
        ), start_log AS (
            INSERT INTO {table('KeyStart')} ({log_columns})
            SELECT {log_values} FROM started, {_START_LOG}
        ), buckets AS (
            INSERT INTO {table('KeyBucket')} ({bucket_columns})
            SELECT {bucket_values}
            FROM started, unnest(%(b_keys)s::text[], %(b_periods)s::interval[], %(b_tats)s::bigint[])
                AS b(key, period, tat_us)
            ON CONFLICT ({column('KeyBucket', 'key')}, {column('KeyBucket', 'period')})
            DO UPDATE SET {column('KeyBucket', 'tat_us')} = EXCLUDED.{column('KeyBucket', 'tat_us')}
        ), counters AS (
            UPDATE {table('KeyState')} AS state SET {counters}
            FROM {_START_LOG}
            WHERE state.{k('key')} = log.key AND EXISTS (SELECT 1 FROM started)
        )
        SELECT attempt.id, attempt.number, {columns('CallQueue', 'started.')} FROM started, attempt
    """


@functools.cache
def finish(changed: tuple[str, ...]) -> str:
    """Record a finish in one statement: the guarded update, the attempt, the counters, the wake-up.

    ``changed`` names the call's fields set (params: the keys, one value per changed field, the
    call's id, status and dispatch_no, the attempt's finish time, outcome and error and id, the
    wake-up channel, whether to wake). The key rows are locked in key order, as every other
    locker of several keys does; the counters' UPDATE only touches rows that "locked" already holds.
    Returns how many calls it finished (0 or 1) and how many wake-ups it sent.
    """
    c = functools.partial(column, "CallQueue")
    k = functools.partial(column, "KeyState")
    sets = _assignments("CallQueue", dict.fromkeys(changed, "%s"))
    attempt = _assignments("Attempt", {"finished_at": "%s", "outcome": "%s", "error": "%s"})
    return f"""
        WITH locked AS (
            {_lock_key_rows(k('key'))}
        ), finished AS (
            UPDATE {table('CallQueue')} SET {sets}
            WHERE {c('id')} = %s AND {c('status')} = %s AND {c('dispatch_no')} = %s
            RETURNING {c('id')}
        ), attempt AS (
            UPDATE {table('Attempt')} SET {attempt}
            WHERE {column('Attempt', 'id')} = %s AND EXISTS (SELECT 1 FROM finished)
        ), counters AS (
            UPDATE {table('KeyState')} SET {k('running')} = {k('running')} - 1
            WHERE {k('key')} IN (SELECT {k('key')} FROM locked) AND EXISTS (SELECT 1 FROM finished)
        ), wake AS (
            {NOTIFY} FROM finished WHERE %s
        )
        SELECT (SELECT COUNT(*) FROM finished), (SELECT COUNT(*) FROM wake)
    """
