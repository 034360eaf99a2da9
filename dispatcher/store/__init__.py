"""Storage: the hand-written statements (``schema``, ``limit_sql``, ``call_sql``), a start's folded transaction (``folded``) and new calls' inserts (``inserts``)."""
