"""The calls' hand-written statements: insert, the waiting key sets, the claim, a start's head and mark, finishes."""
from __future__ import annotations

import functools

from dispatcher.states import CallStatus
from dispatcher.store.limit_sql import POLICY_VERSION
from dispatcher.store.schema import (
    CLOCK,
    NOTIFY,
    assignments,
    column,
    columns,
    epoch_us,
    field_of,
    insert_clause,
    meta,
    pg_type,
    table,
)

# --- calls: send -------------------------------------------------------------------------------

# The fields a new call is given by send(); the other columns take their model default below.
NEW_CALL_FIELDS = ("method", "params", "keys", "key_set", "priority", "queue", "max_attempts", "run_at", "cost")


def _new_call_defaults() -> dict[str, str]:
    # The constant Python defaults of the fields send() leaves alone (attempts, last_error...),
    # as SQL literals; the nullable ones and the database's own defaults are left out (NULL / db_default).
    literals = {}
    for field in meta("CallQueue").concrete_fields:
        if field.primary_key or field.name in NEW_CALL_FIELDS or field.name == "status" or callable(field.default):
            continue
        if field.has_default() and field.default is not None:
            default = field.default
            literals[field.name] = str(default) if isinstance(default, int) else "'" + default.replace("'", "''") + "'"
    return literals


# A call holding its unique key (the partial unique index's condition): ON CONFLICT names it.
def _unique_conflict() -> str:
    key, released = column("CallQueue", "unique_key"), column("CallQueue", "unique_released")
    return f"ON CONFLICT ({key}) WHERE {key} IS NOT NULL AND NOT {released} DO NOTHING"


def _unique_values(before: str, after: str = "") -> dict[str, str]:
    # unique_until: the statement's timestamp (created_at's) plus the hold, in microseconds.
    return {
        "unique_key": f"{before}unique_key{after}::text",
        "unique_until": f"STATEMENT_TIMESTAMP() + {before}hold_for_us{after}::bigint * INTERVAL '1 microsecond'",
    }


def _insert_call(once: bool, hold: bool = False) -> str:
    values = {}
    for name in NEW_CALL_FIELDS:
        if name == "run_at":
            values[name] = "COALESCE(%(run_at)s::timestamptz, STATEMENT_TIMESTAMP())"
        else:
            values[name] = f"%({name})s::{pg_type(field_of('CallQueue', name))}"
    values["status"] = "%(status)s"
    if once:
        unique = _unique_values("%(", ")s")
        values["unique_key"] = unique["unique_key"]
        if hold:
            values["unique_until"] = unique["unique_until"]
    names, exprs = insert_clause("CallQueue", {**values, **_new_call_defaults()})
    return (
        f"INSERT INTO {table('CallQueue')} ({names}) VALUES ({exprs}) {_unique_conflict() if once else ''}"
        f" RETURNING {column('CallQueue', 'id')}, {epoch_us(column('CallQueue', 'created_at'))}"
    )


@functools.cache
def insert_call() -> str:
    """Insert one call; params: NEW_CALL_FIELDS' values in order, then the status.

    run_at defaults to the column's own default (Django's Now() is STATEMENT_TIMESTAMP()), which
    created_at also gets; it comes back as microseconds since the epoch.
    """
    return _insert_call(once=False)


@functools.cache
def insert_call_once(hold: bool) -> str:
    """Insert one call unless another call holds its unique key (no row back then); params: insert_call()'s,
    unique_key and, with ``hold`` (a unique_for), hold_for_us in microseconds.

    Without a hold unique_until is left out (NULL) rather than computed from a NULL hold: one
    expression less for PostgreSQL to parse at every send.
    """
    return _insert_call(once=True, hold=hold)


def _insert_calls(once: bool) -> str:
    row_fields = [name for name in NEW_CALL_FIELDS if name != "params"]
    record = ", ".join(f"{name} {pg_type(field_of('CallQueue', name))}" for name in row_fields)
    values = {name: f"c.{name}" for name in NEW_CALL_FIELDS}
    values["run_at"] = "COALESCE(c.run_at, STATEMENT_TIMESTAMP())"
    values["status"] = "%(status)s"
    if once:
        row_fields += ["unique_key", "hold_for_us"]
        record += ", unique_key text, hold_for_us bigint"
        values.update(_unique_values("c."))
    names, exprs = insert_clause("CallQueue", {**values, **_new_call_defaults()})
    returned = f"{column('CallQueue', 'id')}, {epoch_us(column('CallQueue', 'created_at'))}"
    if once:
        returned += f", {column('CallQueue', 'unique_key')}"
    return f"""
        INSERT INTO {table('CallQueue')} ({names})
        SELECT {exprs}
        FROM ROWS FROM (
            json_to_recordset(%(rows)s::json) AS ({record}),
            jsonb_array_elements(%(params)s::jsonb)
        ) WITH ORDINALITY AS c({', '.join(row_fields)}, params, ord)
        ORDER BY c.ord
        {_unique_conflict() if once else ''}
        RETURNING {returned}
    """


@functools.cache
def insert_calls() -> str:
    """Insert many calls in one statement (all or none), in input order; params: status, rows, params.

    The calls travel as two JSON documents that the server unpacks: the rows (every field of
    NEW_CALL_FIELDS but params) and the params, each an array in the same order.
    """
    return _insert_calls(once=False)


@functools.cache
def insert_calls_once() -> str:
    """Insert many calls as insert_calls() does, skipping those whose unique key another call holds; each
    row also carries unique_key and hold_for_us, and the unique key comes back with each stored call."""
    return _insert_calls(once=True)


@functools.cache
def unique_holders() -> str:
    """Every column of the calls holding any of the unique keys %(keys)s (the rows of the partial unique index)."""
    key = column("CallQueue", "unique_key")
    held = f"{key} = ANY(%(keys)s::text[]) AND {key} IS NOT NULL AND NOT {column('CallQueue', 'unique_released')}"
    return f"SELECT {columns('CallQueue')} FROM {table('CallQueue')} WHERE {held}"


# --- calls: read from the limiter's side -------------------------------------------------------


@functools.cache
def running_calls(field: str) -> str:
    """One column of the running calls (params: the status): their ``key_set`` (the limiter counts
    them per key) or their ``id`` (as a subquery), read without the call model."""
    return f"SELECT {column('CallQueue', field)} FROM {table('CallQueue')} WHERE {column('CallQueue', 'status')} = %s"


# --- calls: dispense ---------------------------------------------------------------------------


def _waiting() -> str:
    # The status is a literal, so the planner can match the partial indexes' predicate.
    return f"{column('CallQueue', 'status')} = '{CallStatus.PENDING.value}'"


def _key_sets_scan() -> str:
    call, key_set, waiting = table("CallQueue"), column("CallQueue", "key_set"), _waiting()
    return f"""
        WITH RECURSIVE ks(k) AS (
            SELECT MIN({key_set}) FROM {call} WHERE {waiting} AND {key_set} > %(after)s
            UNION ALL
            SELECT (SELECT MIN({key_set}) FROM {call} WHERE {waiting} AND {key_set} > ks.k)
            FROM ks WHERE ks.k IS NOT NULL
        )"""


@functools.cache
def waiting_key_sets() -> str:
    """The distinct key sets of waiting calls after %(after)s, in order: a loose index scan of the
    partial waiting index, each step one probe for the next key set; at most %(limit)s."""
    return f"{_key_sets_scan()} SELECT k FROM ks WHERE k IS NOT NULL LIMIT %(limit)s"


@functools.cache
def waiting_key_sets_with_version() -> str:
    """One row: the clock, the policies' version and, as an array, ``waiting_key_sets``'."""
    return (
        f"{_key_sets_scan()} SELECT {CLOCK}, {POLICY_VERSION},"
        " ARRAY(SELECT k FROM ks WHERE k IS NOT NULL LIMIT %(limit)s)"
    )


@functools.cache
def next_due() -> str:
    """When the earliest waiting call not yet due at %(now)s (the database's clock where NULL)
    becomes due: one probe of the partial index on run_at (the bound is read once, as a CTE, so
    that the volatile clock does not keep the index out)."""
    call, run_at = table("CallQueue"), column("CallQueue", "run_at")
    return (
        f"WITH c AS MATERIALIZED (SELECT COALESCE(%(now)s::timestamptz, {CLOCK}) AS now)"
        f" SELECT (SELECT {run_at} FROM {call} WHERE {_waiting()} AND {run_at} > c.now ORDER BY {run_at} LIMIT 1) FROM c"
    )


# What a claim returns of each call, in order.
CLAIMED = ("id", "dispatch_no", "queue", "key_set", "priority", "cost", "run_at")


@functools.cache
def claim_due(returned: str = "") -> str:
    """Mark the due calls of every asking key set dispatched in one statement, skipping rows locked elsewhere.

    One LATERAL scan of the waiting index per key set (%(key_sets)s), each with its own LIMIT (%(wanted)s).
    Returns the columns of CLAIMED, or ``returned`` (``store.functions``: the same, each cast to its type).
    """
    call = table("CallQueue")
    c = functools.partial(column, "CallQueue")
    sets = assignments("CallQueue", {
        "status": "%(dispatched)s", "dispatched_at": "%(now)s", "dispatch_no": f"{c('dispatch_no')} + 1",
    })
    returned = returned or ", ".join(c(name) for name in CLAIMED)
    return f"""
        UPDATE {call} SET {sets}
        WHERE {c('id')} IN (
            SELECT due.id FROM unnest(%(key_sets)s::text[], %(wanted)s::int[]) AS ask(key_set, wanted)
            CROSS JOIN LATERAL (
                SELECT {c('id')} AS id FROM {call}
                WHERE {c('status')} = %(pending)s AND {c('key_set')} = ask.key_set AND {c('run_at')} <= %(now)s
                ORDER BY {c('priority')} DESC, {c('run_at')}, {c('id')}
                LIMIT ask.wanted
                FOR UPDATE SKIP LOCKED
            ) AS due
        )
        RETURNING {returned}
    """


# --- calls: start and finish -------------------------------------------------------------------

# The start log as arrays, one row per key and call (key, units, running total, call; a single
# start passes no calls and its log rows name the started call).
_START_LOG = (
    "unnest(%(log_keys)s::text[], %(log_units)s::int[], %(log_cums)s::bigint[], %(log_calls)s::bigint[])"
    " AS log(key, units, cum, call_id)"
)


# What a start checks of a call before any lock.
_HEAD_FIELDS = ("key_set", "status", "dispatch_no", "cost")


@functools.cache
def call_head() -> str:
    """Read what a start checks before any lock: key_set, status, dispatch_no and cost of call %s."""
    names = ", ".join(column("CallQueue", name) for name in _HEAD_FIELDS)
    return f"SELECT {names} FROM {table('CallQueue')} WHERE {column('CallQueue', 'id')} = %s"


@functools.cache
def call_heads() -> str:
    """The same for the calls whose ids are in %s (an array), each row led by its id."""
    names = ", ".join(column("CallQueue", name) for name in ("id", *_HEAD_FIELDS))
    return f"SELECT {names} FROM {table('CallQueue')} WHERE {column('CallQueue', 'id')} = ANY(%s)"


def _start_writes(source: str, call_id: str, only_if: tuple[str, str], buckets: bool = True) -> str:
    """The CTEs every start writes besides the calls: the attempts, the start log, the buckets
    (none without ``buckets``: a start that charges no bucket).

    ``source`` is the CTE of the started calls, ``call_id`` the expression of a log row's call,
    ``only_if`` a FROM item and condition that must hold for the log and the buckets to be written.
    Everything is written at ``clock.now`` (a CTE of the statement), and a bucket's state is its
    judged one carried to that clock: max(judged, clock + what the start charged beyond
    max(tat, judged clock)), TokenBucket.charge's max. A bucket a late request moved on since the
    start read it (%(b_read)s: its state then; ``ledger.move_on``) carries the move on top, and
    ``moved_buckets`` returns it (the bucket's place in %(b_keys)s, its state, the move), so the
    start holds its request that much longer. Each bucket keeps the start's token (%(b_start)s):
    a late request of the start moves it on only while it stands.
    """
    c = functools.partial(column, "CallQueue")
    attempt_columns, attempt_values = insert_clause("Attempt", {
        "call": c("id"), "number": f"{c('attempts')} + {c('deferrals')}", "started_at": "clock.now",
        "outcome": "%(outcome)s", "error": "''", "worker": "%(worker)s",
    })
    log_columns, log_values = insert_clause("StartLog", {
        "key": "log.key", "started_at": "clock.now", "units": "log.units", "cum": "log.cum", "call_id": call_id,
    })
    judged = f"GREATEST(b.tat_us, {epoch_us('clock.now')} + b.charged_us)"
    bucket_columns, bucket_values = insert_clause("KeyBucket", {
        "key": "b.key", "period": "b.period", "tat_us": judged, "since": "clock.now", "start": "%(b_start)s",
    })
    tat, key, period = column("KeyBucket", "tat_us"), column("KeyBucket", "key"), column("KeyBucket", "period")
    bucket_rows = (
        "unnest(%(b_keys)s::text[], %(b_periods)s::interval[], %(b_tats)s::bigint[], %(b_charged)s::bigint[],"
        " %(b_read)s::bigint[]) WITH ORDINALITY AS b(key, period, tat_us, charged_us, read_us, n)"
    )
    gate, condition = only_if
    writes = f"""
        attempt AS (
            INSERT INTO {table('Attempt')} ({attempt_columns})
            SELECT {attempt_values} FROM {source}, clock
            RETURNING {column('Attempt', 'id')} AS id, {column('Attempt', 'number')} AS number,
                {column('Attempt', 'call')} AS call_id
        ), start_log AS (
            INSERT INTO {table('StartLog')} ({log_columns})
            SELECT {log_values} FROM {gate}, clock, {_START_LOG} WHERE {condition}
        )"""
    if not buckets:
        return writes
    return f"""{writes}, moved_buckets AS (
            UPDATE {table('KeyBucket')} AS kb
            SET {tat} = {judged} + GREATEST(kb.{tat} - b.read_us, 0), {column('KeyBucket', 'start')} = %(b_start)s
            FROM {gate}, clock, {bucket_rows}
            WHERE {condition} AND kb.{key} = b.key AND kb.{period} = b.period
            RETURNING b.n, kb.{tat} AS tat_us, kb.{tat} - {judged} AS moved_us
        ), new_buckets AS (
            INSERT INTO {table('KeyBucket')} ({bucket_columns})
            SELECT {bucket_values} FROM {gate}, clock, {bucket_rows} WHERE {condition}
            ON CONFLICT ({key}, {period}) DO NOTHING
        )"""


def _start_assignments(started_at: str, attempts: str, calls: str, units: str, total: str) -> tuple[str, str]:
    """The SET lists of a start: the call's (running since ``started_at``, one attempt more than
    ``attempts``) and its keys' counters (``calls`` and ``units`` fewer reserved, the running ``total``)."""
    k = functools.partial(column, "KeyState")
    started = assignments("CallQueue", {"status": "%(running)s", "started_at": started_at, "attempts": f"{attempts} + 1"})
    counters = assignments("KeyState", {
        "reserved": f"{k('reserved')} - {calls}", "reserved_units": f"{k('reserved_units')} - {units}", "total": total,
    })
    return started, counters


@functools.cache
def mark_running_group(buckets: bool = True, returned: str = "") -> str:
    """Start the admitted calls of one message (or a call alone) in one statement (``start_many``).

    The starts are recorded at the statement's own clock, never before the clock they were judged
    on (%(now)s): a slow judgement cannot date a start earlier than it happened. Each bucket's last
    state is carried to that clock with what the group charged it (%(b_charged)s).

    Params: the calls' ids and dispatch numbers (%(ids)s, %(nos)s) and their count (%(n)s); the
    start log with each row's call (%(log_calls)s); the buckets' last states; per key the calls,
    units and running total the group moves (%(c_keys)s, %(c_calls)s, %(c_units)s, %(c_totals)s).
    All or nothing: the calls are locked first (``ready``), and unless every one is still its
    delivery's to start, nothing is written and no row returned, so the COMMIT a folded start
    sends with it (``dispatcher.folded``) keeps nothing of the group. Returns per started call
    its attempt's id and number, the buckets that existed as [place, state, move] (``_start_writes``),
    then every column of the call (``columns`` order).

    Without ``buckets`` (the group charges no bucket: %(b_keys)s is empty) the statement leaves
    out the bucket writes, which would change nothing, and returns no buckets: PostgreSQL parses
    and plans every statement of Django's client-side binding at each run, and the two bucket
    CTEs were 0.6-0.8 ms of a start's 1.5-1.7 (``EXPLAIN`` timed alone, docs/performance.md).
    Whitespace is folded: psycopg keeps its conversion of a query only up to 4,096 characters.

    ``returned``: the call's columns as returned (default every column of ``columns`` as it is;
    ``store.functions`` casts each to the type its result declares).
    """
    call = table("CallQueue")
    c = functools.partial(column, "CallQueue")
    k = functools.partial(column, "KeyState")
    started, counters = _start_assignments("clock.now", f"{call}.{c('attempts')}", "g.calls", "g.units", "g.total")
    moved = "(SELECT array_agg(ARRAY[n, tat_us, moved_us] ORDER BY n) FROM moved_buckets)" if buckets else "NULL::bigint[]"
    return _folded(f"""
        WITH clock AS (
            SELECT GREATEST(clock_timestamp(), %(now)s::timestamptz) AS now
        ), d AS (
            SELECT * FROM unnest(%(ids)s::bigint[], %(nos)s::int[]) AS d(id, dispatch_no)
        ), ready AS (
            SELECT COUNT(*) = %(n)s AS all_won FROM (
                SELECT 1 FROM {call} JOIN d ON {call}.{c('id')} = d.id
                WHERE {call}.{c('status')} = %(dispatched)s AND {call}.{c('dispatch_no')} = d.dispatch_no
                FOR UPDATE OF {call}
            ) AS locked
        ), started AS (
            UPDATE {call} SET {started}
            FROM d, ready, clock
            WHERE {call}.{c('id')} = d.id AND {call}.{c('status')} = %(dispatched)s
                AND {call}.{c('dispatch_no')} = d.dispatch_no AND ready.all_won
            RETURNING {call}.*
        ), won AS (
            SELECT COUNT(*) = %(n)s AS all_won FROM started
        ), {_start_writes("started", "log.call_id", ("won", "won.all_won"), buckets)}, counters AS (
            UPDATE {table('KeyState')} AS state SET {counters}
            FROM won, unnest(%(c_keys)s::text[], %(c_calls)s::int[], %(c_units)s::int[], %(c_totals)s::bigint[])
                AS g(key, calls, units, total)
            WHERE state.{k('key')} = g.key AND won.all_won
        )
        SELECT attempt.id, attempt.number, {moved}, {returned or columns('CallQueue', 'started.')}
        FROM started JOIN attempt ON attempt.call_id = started.{c('id')}
    """)


def _folded(statement: str) -> str:
    """A statement with its runs of whitespace folded to one space (it holds no quoted text that has any)."""
    return " ".join(statement.split())


@functools.cache
def finish(changed: tuple[str, ...]) -> str:
    """Record a finish in one statement: the guarded update, the attempt, the wake-up.

    ``changed`` names the call's fields set (params: one value per changed field, the call's id,
    status and dispatch_no, the attempt's finish time, outcome and error and id, the wake-up
    channel, whether to wake). No key row is locked: running calls have no counter.
    Returns how many calls it finished (0 or 1) and how many wake-ups it sent.
    """
    c = functools.partial(column, "CallQueue")
    sets = assignments("CallQueue", dict.fromkeys(changed, "%s"))
    attempt = assignments("Attempt", {"finished_at": "%s", "outcome": "%s", "error": "%s"})
    return f"""
        WITH finished AS (
            UPDATE {table('CallQueue')} SET {sets}
            WHERE {c('id')} = %s AND {c('status')} = %s AND {c('dispatch_no')} = %s
            RETURNING {c('id')}
        ), attempt AS (
            UPDATE {table('Attempt')} SET {attempt}
            WHERE {column('Attempt', 'id')} = %s AND EXISTS (SELECT 1 FROM finished)
        ), wake AS (
            {NOTIFY} FROM finished WHERE %s
        )
        SELECT (SELECT COUNT(*) FROM finished), (SELECT COUNT(*) FROM wake)
    """


@functools.cache
def finish_done_many() -> str:
    """Record several successful attempts in one statement (``finish_done_many``), at one clock reading.

    Params: the calls' ids, dispatch numbers, attempts, results and whether each wakes the
    dispensers (%(ids)s, %(nos)s, %(attempts)s, %(results)s, %(wakes)s); the done status, the
    attempts' outcome, the running status, the wake-up channel. Returns the ids of the calls won.
    """
    call = table("CallQueue")
    c = functools.partial(column, "CallQueue")
    a = functools.partial(column, "Attempt")
    attempt_table = table("Attempt")
    # Never before the start (a start's own clock may run ahead of this statement's).
    finished = assignments("CallQueue", {
        "status": "%(done)s", "result": "d.result", "last_error": "''",
        "finished_at": f"GREATEST(clock.now, {call}.{c('started_at')})",
    })
    attempt = assignments("Attempt", {
        "finished_at": f"GREATEST(clock.now, {attempt_table}.{a('started_at')})", "outcome": "%(outcome)s", "error": "''",
    })
    return f"""
        WITH clock AS MATERIALIZED (
            SELECT {CLOCK} AS now
        ), d AS (
            SELECT * FROM unnest(%(ids)s::bigint[], %(nos)s::int[], %(attempts)s::bigint[], %(results)s::jsonb[],
                %(wakes)s::bool[]) AS d(id, dispatch_no, attempt_id, result, wake)
        ), finished AS (
            UPDATE {call} SET {finished}
            FROM d, clock
            WHERE {call}.{c('id')} = d.id AND {call}.{c('status')} = %(running)s
                AND {call}.{c('dispatch_no')} = d.dispatch_no
            RETURNING {call}.{c('id')} AS id, d.attempt_id, d.wake
        ), attempt AS (
            UPDATE {attempt_table} SET {attempt}
            FROM finished, clock WHERE {attempt_table}.{a('id')} = finished.attempt_id
        ), wake AS (
            {NOTIFY.replace("%s", "%(channel)s")} WHERE EXISTS (SELECT 1 FROM finished WHERE wake)
        )
        SELECT id FROM finished, (SELECT COUNT(*) FROM wake) AS woken
    """
