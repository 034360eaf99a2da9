"""The benchmark suite's quick mode runs in CI: its figures are printed, its correctness checks count."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.db import connection

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.postgres, pytest.mark.slow]


def test_quick_benchmark_loses_no_call_and_keeps_every_window_within_its_limit():
    settings = connection.settings_dict
    user = settings.get("USER") or "postgres"
    host = settings.get("HOST") or "127.0.0.1"
    port = settings.get("PORT") or 5432
    # The benchmark creates and drops a database of its own next to the test database.
    bench_db = f"bench_{settings['NAME']}"[:60]
    env = {
        **os.environ,
        "BENCH_DATABASE_URL": f"postgres://{user}@{host}:{port}/{bench_db}",
        "BENCH_REDIS_URL": f"redis://127.0.0.1:6379/{os.environ.get('TEST_REDIS_DB', '9')}",
    }
    done = subprocess.run(
        [sys.executable, "-m", "bench", "--quick"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    print(done.stdout[-6000:])
    # Exit status 1 means a correctness check failed (a call lost, a window over its limit);
    # missed speed targets only show as "NO" in the table.
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    table = done.stdout[done.stdout.index("figure ") :]
    for figure in ("dispatch throughput (Redis", "dispense pass of 100 calls", "wake-up latency", "utilisation",
                   "utilisation, token bucket", "starts in the window (window)", "starts in the window (bucket)",
                   "completed calls", "to a 100 ms API", "enqueue send_many", "enqueue send one by one", "dispenser memory",
                   "held at the API: sliding window", "held at the API: smooth rate", "a call's steps in 1 worker",
                   "fair turns: 8 tenants"):
        assert figure in table
    assert "CHECK FAILED" not in table and "ERROR" not in table


def test_dedup_benchmark_prints_its_rows_and_stores_each_key_once():
    settings = connection.settings_dict
    user, host, port = settings.get("USER") or "postgres", settings.get("HOST") or "127.0.0.1", settings.get("PORT") or 5432
    env = {**os.environ, "BENCH_DATABASE_URL": f"postgres://{user}@{host}:{port}/bench_dedup_{settings['NAME']}"[:100]}
    done = subprocess.run(
        [sys.executable, "-m", "bench.dedup", "--rounds", "2", "--block", "20", "--batch", "200", "--batch-rounds", "1"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    print(done.stdout)
    # The bench asserts that a duplicate stores nothing and that send_many stores each key once.
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    # A keyed send makes the statements a plain one makes; a duplicate one more, the holder's SELECT.
    assert "plain: 3 (BEGIN, INSERT dispatcher_call, COMMIT); keyed: 3 (BEGIN, INSERT dispatcher_call, COMMIT)" in done.stdout
    assert "plain: 1 (INSERT dispatcher_call); keyed: 1 (INSERT dispatcher_call)" in done.stdout
    for row in ("send() in its own transaction, a fresh unique key",
                "send() committing alone, a duplicate", "send_many(200), 10% keys held by waiting calls"):
        assert row in done.stdout
