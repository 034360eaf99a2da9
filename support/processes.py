"""Child processes of the tests, the demo and the benchmarks: started in their own groups, always stopped."""
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


def database_url(settings_dict: dict) -> str:
    """Return a DATABASE_URL for the database the test runs on (the test database)."""
    if settings_dict["ENGINE"].endswith("sqlite3"):
        return f"sqlite:///{settings_dict['NAME']}"
    user = settings_dict.get("USER") or "postgres"
    host = settings_dict.get("HOST") or "127.0.0.1"
    port = settings_dict.get("PORT") or 5432
    password = f":{settings_dict['PASSWORD']}" if settings_dict.get("PASSWORD") else ""
    return f"postgres://{user}{password}@{host}:{port}/{settings_dict['NAME']}"


class Processes:
    """Starts commands in new process groups with one environment; stops exactly those groups, last first."""

    def __init__(self, env: dict[str, str], log_dir: Path | None = None) -> None:
        self.env = env
        self.log_dir = log_dir
        # (process, its log file or None when its output is pumped to a stream), in start order.
        self.procs: list[tuple[subprocess.Popen, Path | None]] = []
        self.names: list[str] = []
        self._pumps: list[threading.Thread] = []

    def start(
        self,
        name: str,
        *args: str,
        extra_env: dict[str, str] | None = None,
        prefix_output: IO[str] | None = None,
        cwd: Path = ROOT,
    ) -> subprocess.Popen:
        """Start a command; its output goes to ``<log_dir>/<name>.log`` (``<name>-<n>.log`` for
        the n-th process of that name) or, prefixed with the name, to a stream."""
        env = {**self.env, **(extra_env or {})}
        log_path = None
        proc: subprocess.Popen[Any]
        if prefix_output is not None:
            proc = subprocess.Popen(
                list(args), cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True, text=True, bufsize=1,
            )
            pump = threading.Thread(target=_pump, args=(name, proc, prefix_output), daemon=True)
            pump.start()
            self._pumps.append(pump)
        else:
            assert self.log_dir is not None, "a log folder or an output stream is needed"
            seen = self.names.count(name)
            log_path = self.log_dir / (f"{name}-{seen}.log" if seen else f"{name}.log")
            with open(log_path, "ab") as log:
                proc = subprocess.Popen(
                    list(args), cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL, start_new_session=True,
                )
        self.procs.append((proc, log_path))
        self.names.append(name)
        return proc

    def worker(
        self, queue: str, concurrency: int = 2, extra_env: dict[str, str] | None = None, pool: str = "prefork",
    ) -> subprocess.Popen:
        """Start a Celery worker of the project on one queue, under the given pool."""
        return self.start(
            "worker", sys.executable, "-m", "celery", "-A", "project", "worker", "-Q", queue, "-c", str(concurrency),
            "-P", pool, "-l", "info", "--without-mingle", "--without-gossip", "--without-heartbeat",
            "-n", f"w{len(self.procs)}@%h", extra_env=extra_env,
        )

    def dispenser(self, extra_env: dict[str, str] | None = None) -> subprocess.Popen:
        """Start ``manage.py dispense --loop``."""
        return self.start("dispenser", sys.executable, "manage.py", "dispense", "--loop", extra_env=extra_env)

    def manage(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        """Run ``manage.py`` with the shared environment and return its result."""
        return subprocess.run(
            [sys.executable, "manage.py", *args], cwd=ROOT, env=self.env, capture_output=True, text=True,
            timeout=timeout,
        )

    def exited(self) -> list[tuple[str, int]]:
        """Return (name, exit code) of every started process that has ended."""
        return [(name, proc.returncode) for name, (proc, _) in zip(self.names, self.procs, strict=True) if proc.poll() is not None]

    def logs(self) -> str:
        """Return the tail of every log file, for a failure message."""
        return "\n".join(f"--- {p}\n{p.read_text(errors='replace')[-4000:]}" for _, p in self.procs if p is not None)

    def stop(self, proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 15) -> None:
        """Signal one process's group, wait, then SIGKILL whatever of the group is left."""
        if proc.poll() is None:
            _signal_group(proc, sig)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
        _kill_group(proc)

    def stop_all(self, timeout: float = 15, *, leaders: bool = False) -> None:
        """SIGTERM each group started here (with ``leaders``, each process started here, which stops
        its own children: gunicorn's workers, Celery's pool, without "killed" errors), wait for all
        within one deadline, then SIGKILL what is left of the groups."""
        for proc, _ in reversed(self.procs):
            if proc.poll() is None:
                if leaders:
                    proc.send_signal(signal.SIGTERM)
                else:
                    _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for proc, _ in reversed(self.procs):
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for proc, _ in self.procs:
            _kill_group(proc)
        for pump in self._pumps:
            pump.join(timeout=2)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # the group id is the child's pid: start_new_session=True
    except (ProcessLookupError, PermissionError):
        pass


def _kill_group(proc: subprocess.Popen) -> None:
    # The group may hold children (Celery's pool) even after its leader exited.
    _signal_group(proc, signal.SIGKILL)
    if proc.poll() is None:
        proc.wait(timeout=5)


def _pump(name: str, proc: subprocess.Popen, out: IO[str]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        out.write(f"{name:>9} | {line}")
        out.flush()


def install_stop_signals() -> Callable[[], None]:
    """Turn SIGTERM and SIGHUP into KeyboardInterrupt, and Ctrl-C's SIGINT too: Python leaves a
    SIGINT its parent ignored ignored (a script's background job: ``make run &`` in a script, or
    a test suite run so), and Ctrl-C then stopped nothing. Return an undo function."""

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}

    def restore() -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    return restore


def wait_until(predicate: Callable[[], bool], timeout: float, interval: float = 0.1) -> bool:
    """Poll a condition, bounded in time; return whether it came true."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()
