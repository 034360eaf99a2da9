"""CPU time per kind of process on this machine, from /proc: where a benchmark's calls spend it.

A row's throughput on the 2-core machine is bounded by the CPU its calls take in every process
together (the worker, the dispenser, PostgreSQL, Redis, the benchmark itself, which publishes the
plain tasks and serves the fake API); ``Meter`` reads each kind's CPU seconds before and after.
"""
from __future__ import annotations

import os
from pathlib import Path

KINDS = ("worker", "dispenser", "postgres", "redis", "bench", "other")


def _kind(pid: int, comm: str, cmdline: str) -> str:
    if pid == os.getpid():
        return "bench"
    if comm.startswith("postgres") or cmdline.startswith("postgres:"):
        return "postgres"
    if comm.startswith("redis-server"):
        return "redis"
    if "celery" in cmdline and "worker" in cmdline:
        return "worker"
    if "dispense" in cmdline:
        return "dispenser"
    return "other"


def snapshot() -> dict[int, tuple[str, float]]:
    """Each live process's kind and CPU seconds (user + system) so far."""
    tick = os.sysconf("SC_CLK_TCK")
    seen: dict[int, tuple[str, float]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue  # ended meanwhile
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        seen[int(entry.name)] = (_kind(int(entry.name), comm, cmdline), (int(fields[11]) + int(fields[12])) / tick)
    return seen


class Meter:
    """CPU seconds per kind of process between ``start()`` and ``stop()`` (processes that started
    meanwhile count from zero; those that ended meanwhile are not counted)."""

    def start(self) -> None:
        self.before = snapshot()

    def stop(self) -> dict[str, float]:
        after = snapshot()
        spent = dict.fromkeys(KINDS, 0.0)
        for pid, (kind, seconds) in after.items():
            spent[kind] += seconds - self.before.get(pid, (kind, 0.0))[1]
        return {kind: round(value, 2) for kind, value in spent.items()}
