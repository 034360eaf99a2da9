"""The limiter's hand-written statements: the policies with the clock, key locks, readings, counters, send delays."""
from __future__ import annotations

import functools

from dispatcher.states import CallStatus
from dispatcher.store.schema import CLOCK, column, columns, epoch_us, lock_key_rows, table

# The policies' version, which every change of a policy, a learnt limit or a pattern pause moves (the
# table and triggers of migration 0008, PostgreSQL only, with no model, hence its name here);
# NULL if its row is missing, which only disables keeping the policies between starts.
POLICY_VERSION = "(SELECT version FROM dispatcher_policy_version WHERE id = 1)"


def policies_with_clock(policies: str) -> str:
    """The policies' query (compiled by the ORM) joined to the clock and their version: one round trip.

    The clock's subquery is evaluated once (PostgreSQL does not flatten a volatile one), and the
    LEFT JOIN returns it even when no policy exists.
    """
    return (
        f"SELECT c.now, c.version, p.* FROM (SELECT {CLOCK} AS now, {POLICY_VERSION} AS version) c"
        f" LEFT JOIN ({policies}) p ON TRUE"
    )


@functools.cache
def clock_readings(kinds: tuple[str, ...], unflushed: bool = False) -> str:
    """The clock, the policies' version and the keys' probes (``kinds``, windows measured back
    from this clock less %s each) in one statement: a start's with kept policies, and a claim's;
    with ``unflushed``, a last column lets the transaction commit without waiting for its WAL to
    reach the disk (``synchronous_commit`` off for it alone: a claim's, ``calls.dispense.claim_batch``;
    other sessions see its commit at once, and a later durable commit flushes it with its own).

    The policies themselves are not in it, even behind a join that returns them only when the
    version moved: PostgreSQL parses and plans the whole statement at every run all the same
    (a quarter of a millisecond of each start, ``EXPLAIN`` timed alone), to read them perhaps
    once an edit.
    """
    probes = "".join(", " + probe for probe in _probes(kinds, "c.now - %s"))
    flush = ", set_config('synchronous_commit', 'off', true)" if unflushed else ""
    return (
        f"WITH c AS MATERIALIZED (SELECT {CLOCK} AS now, {POLICY_VERSION} AS version)"
        f" SELECT c.now, c.version{probes}{flush} FROM c"
    )


# --- the limiter -------------------------------------------------------------------------------


@functools.cache
def lock_key_states() -> str:
    """Lock and read whole KeyState rows of the keys in %s, in key order."""
    return lock_key_rows(columns("KeyState"))


@functools.cache
def lock_key_states_of_calls() -> str:
    """Lock and read whole KeyState rows of the keys of the calls whose ids are in %s, in key
    order (a folded start's, ``locks.lock_keys_of_calls``). A key set that is not a JSON array
    fails the statement."""
    call, key_set, call_id = table("CallQueue"), column("CallQueue", "key_set"), column("CallQueue", "id")
    keys = f"ARRAY(SELECT jsonb_array_elements_text({key_set}::jsonb) FROM {call} WHERE {call_id} = ANY(%s::bigint[]))"
    return lock_key_rows(columns("KeyState"), keys)


@functools.cache
def _bucket_probe() -> str:
    # A bucket's one timestamp (params: key, period).
    key, period = column("KeyBucket", "key"), column("KeyBucket", "period")
    return f"(SELECT {column('KeyBucket', 'tat_us')} FROM {table('KeyBucket')} WHERE {key} = %s AND {period} = %s)"


@functools.cache
def _window_probe(since: str) -> str:
    # The running total before a window's first start (params: key, then the window's start as
    # ``since`` takes it): one index probe.
    key, started_at, cum = column("StartLog", "key"), column("StartLog", "started_at"), column("StartLog", "cum")
    return (
        f"(SELECT {cum} - {column('StartLog', 'units')} FROM {table('StartLog')}"
        f" WHERE {key} = %s AND {started_at} >= {since} ORDER BY {started_at}, {cum}, {column('StartLog', 'id')} LIMIT 1)"
    )


@functools.cache
def _running_probe(postgresql: bool) -> str:
    # How many running calls have the key (param: key), through the partial index on calls in
    # flight (its first column is the status). Exact under the key's lock: a call becomes running
    # only in a start holding it, and a finish committed after this statement's snapshot is
    # counted as still running, which errs on the side of the cap.
    call, key_set = table("CallQueue"), column("CallQueue", "key_set")
    running = f"{column('CallQueue', 'status')} = '{CallStatus.RUNNING.value}'"
    if postgresql:
        has_key = f"jsonb_exists({key_set}::jsonb, %s)"
    else:
        has_key = f"EXISTS (SELECT 1 FROM json_each({call}.{key_set}) AS k WHERE k.value = %s)"
    return f"(SELECT COUNT(*) FROM {call} WHERE {running} AND {has_key})"


def _probes(kinds: tuple[str, ...], since: str, postgresql: bool = True) -> list[str]:
    # One column per probe: "bucket" (params: key, period), "window" (key, window start),
    # "running" (key).
    made = {"bucket": _bucket_probe(), "window": _window_probe(since), "running": _running_probe(postgresql)}
    return [made[kind] for kind in kinds]


@functools.cache
def policy_readings(kinds: tuple[str, ...], postgresql: bool) -> str:
    """Read every probe of a check in one row (see ``_probes``); standard SQL but for the running count."""
    return "SELECT " + ", ".join(_probes(kinds, "%s", postgresql))


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
def remember_send_delay(kept: bool = False) -> str:
    """Keep a measured start-to-send delay (%(us)s microseconds) on keys %(keys)s, each with its
    memory span %(spans)s (guard.remember_delay): a span gone by rolls the memory over, a larger
    delay raises it; other rows are not touched (nor locked). ``kept``: return every key's
    memory as it then stands (key, current, previous, since), written or not."""
    current, previous = column("KeyState", "send_delay_us"), column("KeyState", "send_delay_prev_us")
    since, key = column("KeyState", "send_delay_since"), column("KeyState", "key")
    rolls = f"s.{since} IS NULL OR m.t >= s.{since} + m.span"
    update = f"""
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
    given = f"SELECT k.key, k.span, {CLOCK} AS t FROM unnest(%(keys)s::text[], %(spans)s::interval[]) AS k(key, span)"
    if not kept:
        return f"WITH m AS ({given}) {update}"
    # The rows it did not write are read as they were (the statement's one snapshot).
    state = f"s.{key}, s.{current}, s.{previous}, s.{since}"
    return f"""
        WITH m AS ({given}), w AS ({update} RETURNING {state})
        SELECT * FROM w
        UNION ALL
        SELECT {state} FROM {table('KeyState')} AS s JOIN m ON s.{key} = m.key
        WHERE s.{key} NOT IN (SELECT {key} FROM w)
    """


def _moved_to(state: str) -> str:
    """Where a late request moves a bucket on to, read at the move on the database's clock: the
    state its start left (``state``) and the request's lateness past its deadline (%(deadline)s,
    µs since the epoch; none if NULL), and %(pad)s µs for the rest of its way out."""
    return f"{state} + COALESCE(GREATEST({epoch_us(CLOCK)} - %(deadline)s::bigint, 0), 0) + %(pad)s"


@functools.cache
def move_on_one() -> str:
    """Move one bucket (%(key)s, %(period)s) on as ``move_on`` does several: from the state its
    start left it in (%(tat)s), while it holds the start's token (%(start)s); a row back, with how
    far past that state it now stands, if it did."""
    key, period, tat = column("KeyBucket", "key"), column("KeyBucket", "period"), column("KeyBucket", "tat_us")
    return (
        f"UPDATE {table('KeyBucket')} SET {tat} = GREATEST({tat}, {_moved_to('%(tat)s::bigint')})"
        f" WHERE {key} = %(key)s AND {period} = %(period)s AND {column('KeyBucket', 'start')} = %(start)s"
        f" RETURNING {tat} - %(tat)s::bigint"
    )


@functools.cache
def move_on() -> str:
    """Move buckets on for a held request that goes out late, as far as it needs them (never back:
    a request of the same start may have moved them further), while each still holds the start's
    token (%(start)s: no later start was charged on it since): the buckets %(keys)s, %(periods)s
    and the states the start left them in, %(tats)s. The rows are locked first, in key order,
    and a locked row is read as committed after the wait. All or none; a row back, with how far
    past the start's state the first bucket now stands, if they moved (NULL: they did not)."""
    key, period, tat = column("KeyBucket", "key"), column("KeyBucket", "period"), column("KeyBucket", "tat_us")
    start, bucket = column("KeyBucket", "start"), table("KeyBucket")
    return f"""
        WITH e AS (
            SELECT * FROM unnest(%(keys)s::text[], %(periods)s::interval[], %(tats)s::bigint[])
                WITH ORDINALITY AS e(key, period, tat_us, n)
        ), locked AS (
            SELECT kb.{key} AS key, kb.{period} AS period, kb.{start} AS start FROM {bucket} AS kb
            JOIN e ON kb.{key} = e.key AND kb.{period} = e.period
            ORDER BY kb.{key}, kb.{period} FOR UPDATE OF kb
        ), still AS (
            SELECT COUNT(*) = cardinality(%(keys)s::text[]) AS last FROM locked WHERE start = %(start)s
        ), moved AS (
            UPDATE {bucket} AS kb SET {tat} = GREATEST(kb.{tat}, {_moved_to('e.tat_us')})
            FROM still, e WHERE still.last AND kb.{key} = e.key AND kb.{period} = e.period
            RETURNING e.n, kb.{tat} - e.tat_us AS by
        )
        SELECT CASE WHEN last THEN (SELECT by FROM moved ORDER BY n LIMIT 1) END FROM still
    """


@functools.cache
def window_bases() -> str:
    """The running total before each window's first start, for many windows at once (PostgreSQL):
    params %(keys)s (text[]) and %(since)s (timestamptz[]), one window each; a row per window in
    their order (its ordinality, then the total or NULL). One plan, one index probe per window,
    where a probe per column (``policy_readings``) costs its planning for every window."""
    key, started_at, cum = column("StartLog", "key"), column("StartLog", "started_at"), column("StartLog", "cum")
    return (
        f"SELECT w.n, (SELECT {cum} - {column('StartLog', 'units')} FROM {table('StartLog')}"
        f" WHERE {key} = w.key AND {started_at} >= w.since ORDER BY {started_at}, {cum}, {column('StartLog', 'id')} LIMIT 1)"
        " FROM unnest(%(keys)s::text[], %(since)s::timestamptz[]) WITH ORDINALITY AS w(key, since, n) ORDER BY w.n"
    )
