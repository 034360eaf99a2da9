"""Real processes for the tests: Celery workers and dispensers, started and always stopped."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


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
    """Starts commands with a shared environment; stops every one it started."""

    def __init__(self, env: dict[str, str], log_dir: Path) -> None:
        self.env = {**os.environ, **env}
        self.log_dir = log_dir
        self.procs: list[tuple[subprocess.Popen, Path]] = []

    def start(self, name: str, *args: str, extra_env: dict[str, str] | None = None) -> subprocess.Popen:
        log_path = self.log_dir / f"{name}-{len(self.procs)}.log"
        log_file = open(log_path, "wb")
        proc = subprocess.Popen(
            list(args), cwd=ROOT, env={**self.env, **(extra_env or {})}, stdout=log_file, stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log_file.close()
        self.procs.append((proc, log_path))
        return proc

    def worker(
        self, queue: str, concurrency: int = 2, extra_env: dict[str, str] | None = None, pool: str = "prefork",
    ) -> subprocess.Popen:
        return self.start(
            "worker", sys.executable, "-m", "celery", "-A", "project", "worker", "-Q", queue, "-c", str(concurrency),
            "-P", pool, "-l", "info", "--without-mingle", "--without-gossip", "--without-heartbeat",
            "-n", f"w{len(self.procs)}@%h", extra_env=extra_env,
        )

    def dispenser(self, extra_env: dict[str, str] | None = None) -> subprocess.Popen:
        return self.start("dispenser", sys.executable, "manage.py", "dispense", "--loop", extra_env=extra_env)

    def manage(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "manage.py", *args], cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=timeout
        )

    def logs(self) -> str:
        return "\n".join(f"--- {p}\n{p.read_text(errors='replace')[-4000:]}" for _, p in self.procs)

    def stop(self, proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 15) -> None:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)

    def stop_all(self) -> None:
        for proc, _ in reversed(self.procs):
            self.stop(proc)


def wait_until(predicate: Callable[[], bool], timeout: float, interval: float = 0.1) -> bool:
    """Poll a condition, bounded in time; return whether it came true."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()
