"""Child processes of the demo and of ``make run``: started in their own groups, always stopped."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parent.parent


def clean_environment(overrides: dict[str, str]) -> dict[str, str]:
    """Return this environment without the project's own settings, plus ``overrides``.

    A DATABASE_URL or broker URL left in the shell must never point the demo at real data.
    """
    prefixes = ("DISPATCHER_", "CELERY_", "DATABASE_", "DJANGO_", "EMBEDDED_BROKER_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(prefixes)}
    env.update(overrides)
    return env


class Processes:
    """Starts commands in new process groups and stops exactly those groups, last first."""

    def __init__(self, env: dict[str, str], log_dir: Path | None = None) -> None:
        self.env = env
        self.log_dir = log_dir
        self.started: list[tuple[str, subprocess.Popen]] = []
        self._pumps: list[threading.Thread] = []

    def start(self, name: str, *args: str, prefix_output: IO[str] | None = None) -> subprocess.Popen:
        """Start a command; its output goes to ``<log_dir>/<name>.log`` or, prefixed, to a stream."""
        if prefix_output is not None:
            proc = subprocess.Popen(
                list(args), cwd=ROOT, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True, text=True, bufsize=1,
            )
            pump = threading.Thread(target=_pump, args=(name, proc, prefix_output), daemon=True)
            pump.start()
            self._pumps.append(pump)
        else:
            assert self.log_dir is not None, "a log folder or an output stream is needed"
            with open(self.log_dir / f"{name}.log", "ab") as log:
                proc = subprocess.Popen(
                    list(args), cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL, start_new_session=True,
                )
        self.started.append((name, proc))
        return proc

    def manage(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        """Run ``manage.py`` with the shared environment and return its result."""
        return subprocess.run(
            [sys.executable, "manage.py", *args], cwd=ROOT, env=self.env, capture_output=True, text=True,
            timeout=timeout,
        )

    def exited(self) -> list[tuple[str, int]]:
        """Return (name, exit code) of every started process that has ended."""
        return [(name, proc.returncode) for name, proc in self.started if proc.poll() is not None]

    def stop_all(self, timeout: float = 10) -> None:
        """SIGTERM each group started here, wait, then SIGKILL what is left."""
        for _, proc in reversed(self.started):
            if proc.poll() is None:
                _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for _, proc in reversed(self.started):
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for _, proc in self.started:
            # The group may hold children (Celery's pool) even after its leader exited.
            _signal_group(proc, signal.SIGKILL)
            if proc.poll() is None:
                proc.wait(timeout=5)
        for pump in self._pumps:
            pump.join(timeout=2)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # the group id is the child's pid: start_new_session=True
    except (ProcessLookupError, PermissionError):
        pass


def _pump(name: str, proc: subprocess.Popen, out: IO[str]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        out.write(f"{name:>9} | {line}")
        out.flush()


def install_stop_signals() -> Callable[[], None]:
    """Turn SIGTERM and SIGHUP into KeyboardInterrupt (as Ctrl-C is); return an undo function."""

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}

    def restore() -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    return restore


def wait_for(predicate: Callable[[], bool], timeout: float, interval: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()
