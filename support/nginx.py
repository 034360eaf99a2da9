"""A real nginx ``limit_req`` in front of a fake API on 127.0.0.1, for the pacing benchmark.

Each zone is a smooth rate without burst (``limit_req zone=... ;`` with no ``burst``): nginx
refuses, with 429, any request that comes sooner than one interval after the last one it let
through (its clock has millisecond steps). nginx runs as a child process in the foreground
(``daemon off``, no master process) with its configuration, pid file, logs and temporary files in
a folder of its own, on a port of its own; ``stop`` ends it by its process id. Debian's nginx:
``make bench-deps`` installs it if it is missing.
"""
from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

NGINX = "/usr/sbin/nginx"

# Each access log line: when nginx logged it (its ms clock), the status, the time nginx took
# (s, ms steps) and the path.
LOG_FORMAT = "$msec $status $request_time $uri"


def available() -> bool:
    """Return whether nginx is installed (``make bench-deps``)."""
    return shutil.which("nginx") is not None or Path(NGINX).exists()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@dataclass
class Logged:
    """One request as nginx logged it."""

    at: float
    status: int
    seconds: float
    path: str


@dataclass
class Nginx:
    """nginx proxying ``/<zone>/...`` to ``upstream`` with a smooth rate per zone (requests per second)."""

    upstream: str
    rates: dict[str, int]
    port: int = 0
    folder: Path | None = None
    process: subprocess.Popen | None = None
    _tmp: tempfile.TemporaryDirectory | None = field(default=None, repr=False)

    def config(self) -> str:
        assert self.folder is not None
        folder = self.folder
        host = self.upstream.removeprefix("http://").rstrip("/")
        zones = "\n".join(
            # $server_port: a key no request lacks (an empty key is never limited).
            f"    limit_req_zone $server_port zone={name}:1m rate={rate}r/s;" for name, rate in self.rates.items()
        )
        locations = "\n".join(
            f"""        location /{name}/ {{
            limit_req zone={name};
            proxy_pass http://api;
        }}"""
            for name in self.rates
        )
        temps = "\n".join(
            f"    {kind}_temp_path {folder}/{kind}_temp;" for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
        )
        return f"""worker_processes 1;
pid {folder}/nginx.pid;
error_log {folder}/error.log warn;
events {{ worker_connections 512; }}
http {{
    log_format paced '{LOG_FORMAT}';
    access_log {folder}/access.log paced;
{temps}
{zones}
    limit_req_status 429;
    limit_req_log_level info;
    upstream api {{
        server {host};
        keepalive 64;
    }}
    proxy_http_version 1.1;
    proxy_set_header Connection "";
    server {{
        listen 127.0.0.1:{self.port};
{locations}
    }}
}}
"""

    def start(self, timeout: float = 10) -> Nginx:
        """Write the configuration, start nginx in the foreground, wait (bounded) until it answers."""
        self._tmp = tempfile.TemporaryDirectory(prefix="bench-nginx-")
        self.folder = Path(self._tmp.name)
        self.port = self.port or _free_port()
        conf = self.folder / "nginx.conf"
        conf.write_text(self.config())
        self.process = subprocess.Popen(
            [NGINX, "-p", str(self.folder), "-e", str(self.folder / "error.log"), "-c", str(conf),
             "-g", "daemon off; master_process off;"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                error = self.process.stderr.read().decode(errors="replace") if self.process.stderr else ""
                raise RuntimeError(f"nginx exited with {self.process.returncode}: {error}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"nginx did not listen on 127.0.0.1:{self.port} within {timeout:g} s")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        """End nginx by its process id (bounded), then remove its folder."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=5)
        if self.process is not None and self.process.stderr is not None:
            self.process.stderr.close()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def logged(self) -> list[Logged]:
        """Return every request nginx has logged so far."""
        assert self.folder is not None
        path = self.folder / "access.log"
        if not path.exists():
            return []
        found = []
        for line in path.read_text().splitlines():
            at, status, seconds, uri = line.split(" ", 3)
            found.append(Logged(float(at), int(status), float(seconds), uri))
        return found
