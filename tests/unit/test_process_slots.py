"""A worker process's budget of handlers at once: its pool's size where that is one process's."""
from __future__ import annotations

import os

import pytest
from celery.concurrency.prefork import TaskPool as PreforkPool
from celery.concurrency.thread import TaskPool as ThreadPool

from dispatcher import handlerpool, liveness


@pytest.mark.parametrize(
    ("pool", "forks"),
    [(PreforkPool, True), ("prefork", True), ("processes", True), (ThreadPool, False), ("threads", False),
     ("solo", False), ("no.such:Pool", True)],
)
def test_only_a_pool_of_child_processes_forks(pool, forks):
    assert liveness._forks(pool) is forks


def test_the_slots_are_the_main_process_s_only(monkeypatch):
    monkeypatch.setattr(liveness, "_main_slots", (os.getpid(), 32))
    assert liveness.process_slots() == 32
    assert handlerpool.handler_threads() == 32
    # A child forked from that process (a prefork pool's, or anything it starts) has another pid.
    monkeypatch.setattr(liveness, "_main_slots", (os.getpid() + 1, 32))
    assert liveness.process_slots() is None
    assert handlerpool.handler_threads() == handlerpool.MESSAGE_THREADS


def test_a_small_pool_still_runs_a_message_s_calls_at_once(monkeypatch):
    monkeypatch.setattr(liveness, "_main_slots", (os.getpid(), 2))
    assert handlerpool.handler_threads() == handlerpool.MESSAGE_THREADS
