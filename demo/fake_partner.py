"""A fake partner API on 127.0.0.1 that enforces its own published limits, as a real one would.

Limits: ``limit`` requests per ``period`` seconds in all, at most ``concurrency`` at once, and
``tenant_limit`` per ``period`` for each tenant (the ``X-Tenant`` header). A request beyond any
of them is answered ``429 Too Many Requests`` with a ``Retry-After`` header (seconds until a slot
frees) and does not count as served. Every arrival is recorded with its time, for the summary.

With ``announce`` set to 1 it states its overall limit on every answer, in the IETF draft's
``RateLimit-Policy`` and ``RateLimit`` fields.

Run on its own: ``python -m demo.fake_partner --limit 20 --per 2 --concurrency 4``. Control and
statistics: ``GET /_partner/stats`` (arrivals and 429s) and ``POST /_partner/limits`` with a JSON
object of new limits (``limit``, ``period``, ``concurrency``, ``tenant_limit``, ``announce``).
"""
from __future__ import annotations

import argparse
import json
import random
import signal
import threading
import time
from collections import defaultdict, deque
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from support.fakeapi import Bucket, answer

LIMIT_FIELDS = {"limit": int, "period": float, "concurrency": int, "tenant_limit": int, "announce": int}


@dataclass
class Limits:
    """What the partner publishes: N per period in all and per tenant, C at once."""

    limit: int = 20
    period: float = 2.0
    concurrency: int = 4
    tenant_limit: int = 6
    announce: int = 0


@dataclass
class Partner:
    """The partner's state: its limits, the served-request windows and every arrival."""

    limits: Limits = field(default_factory=Limits)
    latency: tuple[float, float] = (0.02, 0.08)
    lock: threading.Lock = field(default_factory=threading.Lock)
    recent: deque = field(default_factory=deque)
    recent_by_tenant: dict[str, deque] = field(default_factory=lambda: defaultdict(deque))
    in_flight: int = 0
    max_in_flight: int = 0
    # (arrival time, tenant, status) for every request, 429s included.
    arrivals: list[tuple[float, str, int]] = field(default_factory=list)
    # The bucket-shaped API under /v2/: `bucket_rate` tokens per second up to `bucket_burst`.
    bucket_rate: float = 4.0
    bucket_burst: int = 12
    bucket: Bucket | None = None
    bucket_arrivals: list[tuple[float, int]] = field(default_factory=list)

    def admit_bucket(self, now: float) -> float | None:
        """Take a token of the /v2/ bucket; return None if served, else the seconds to wait (a 429)."""
        with self.lock:
            if self.bucket is None:
                self.bucket = Bucket(self.bucket_rate, self.bucket_burst)
            wait = self.bucket.admit(now, 1)
            self.bucket_arrivals.append((now, 200 if wait is None else 429))
            return None if wait is None else max(0.05, wait)

    def admit(self, tenant: str, now: float) -> float | None:
        """Count a request in; return None if served, else the seconds to wait (a 429)."""
        lim = self.limits
        with self.lock:
            for window in (self.recent, self.recent_by_tenant[tenant]):
                while window and window[0] <= now - lim.period:
                    window.popleft()
            waits = []
            if len(self.recent) >= lim.limit:
                waits.append(self.recent[len(self.recent) - lim.limit] + lim.period - now)
            tenant_window = self.recent_by_tenant[tenant]
            if tenant and len(tenant_window) >= lim.tenant_limit:
                waits.append(tenant_window[len(tenant_window) - lim.tenant_limit] + lim.period - now)
            if self.in_flight >= lim.concurrency:
                waits.append(0.2)
            if waits:
                self.arrivals.append((now, tenant, 429))
                return max(0.05, max(waits))
            self.recent.append(now)
            if tenant:
                tenant_window.append(now)
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            self.arrivals.append((now, tenant, 200))
            return None

    def release(self) -> None:
        with self.lock:
            self.in_flight -= 1

    def set_limits(self, changes: dict[str, Any]) -> Limits:
        """Change the published limits; raise ValueError on an unknown or bad field."""
        unknown = set(changes) - set(LIMIT_FIELDS)
        if unknown:
            raise ValueError(f"unknown limit fields: {', '.join(sorted(unknown))}")
        with self.lock:
            values = {name: LIMIT_FIELDS[name](value) for name, value in changes.items()}
            if any(v <= 0 for name, v in values.items() if name != "announce"):
                raise ValueError("limits must be greater than zero")
            for name, value in values.items():
                setattr(self.limits, name, value)
            return self.limits

    def announcement(self, now: float) -> dict[str, str]:
        """The IETF rate-limit fields for the overall limit, if the partner announces it."""
        lim = self.limits
        if not lim.announce:
            return {}
        with self.lock:
            live = [t for t in self.recent if t > now - lim.period]
            remaining = max(lim.limit - len(live), 0)
            reset = (live[0] + lim.period - now) if live else lim.period
        return {
            "RateLimit-Policy": f'"overall";q={lim.limit};w={lim.period:g}',
            "RateLimit": f'"overall";r={remaining};t={max(int(reset + 0.999), 1)}',
        }

    def stats(self) -> dict[str, Any]:
        with self.lock:
            return {
                "limits": vars(self.limits).copy(),
                "arrivals": list(self.arrivals),
                "max_in_flight": self.max_in_flight,
                "in_flight": self.in_flight,
                "bucket": {"rate": self.bucket_rate, "burst": self.bucket_burst},
                "bucket_arrivals": list(self.bucket_arrivals),
            }


def make_server(partner: Partner, port: int = 0) -> ThreadingHTTPServer:
    """Return a server bound to 127.0.0.1 (never another interface) that serves the partner."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:
            pass

        def _answer(self, status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> None:
            answer(self, status, body, headers)

        def _body(self) -> bytes:
            length = int(self.headers.get("content-length") or 0)
            return self.rfile.read(length) if length else b""

        def do_GET(self) -> None:
            if self.path == "/_partner/stats":
                return self._answer(200, partner.stats())
            self._serve()

        def do_POST(self) -> None:
            if self.path == "/_partner/limits":
                try:
                    changes = json.loads(self._body() or b"{}")
                    limits = partner.set_limits(changes)
                except (ValueError, TypeError) as exc:
                    return self._answer(400, {"error": str(exc)})
                return self._answer(200, vars(limits))
            self._serve()

        def _serve(self) -> None:
            self._body()
            if self.path.startswith("/v2/"):
                wait = partner.admit_bucket(time.time())
                if wait is not None:
                    return self._answer(429, {"error": "bucket empty"}, {"Retry-After": f"{wait:.3f}"})
                return self._answer(200, {"ok": True, "path": self.path})
            tenant = self.headers.get("x-tenant", "")
            wait = partner.admit(tenant, time.time())
            if wait is not None:
                headers = {"Retry-After": f"{wait:.3f}", **partner.announcement(time.time())}
                return self._answer(429, {"error": "rate limit exceeded"}, headers)
            try:
                time.sleep(random.uniform(*partner.latency))  # the partner does some work
            finally:
                # Released before the answer is written: the client counts the call as
                # running until it has read the answer, so it never sees more at once.
                partner.release()
            self._answer(200, {"ok": True, "tenant": tenant, "path": self.path}, partner.announcement(time.time()))

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    server.daemon_threads = True
    return server


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0, help="port on 127.0.0.1 (0: any free port)")
    parser.add_argument("--limit", type=int, default=20)
    parser.add_argument("--per", type=float, default=2.0, help="period in seconds")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--tenant-limit", type=int, default=6)
    parser.add_argument("--bucket-rate", type=float, default=4.0, help="/v2/: tokens per second")
    parser.add_argument("--bucket-burst", type=int, default=12, help="/v2/: bucket depth")
    args = parser.parse_args(argv)
    partner = Partner(
        Limits(args.limit, args.per, args.concurrency, args.tenant_limit),
        bucket_rate=args.bucket_rate, bucket_burst=args.bucket_burst,
    )
    server = make_server(partner, args.port)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    print(f"listening on http://127.0.0.1:{server.server_address[1]}", flush=True)
    stop.wait()
    server.shutdown()
    server.server_close()


if __name__ == "__main__":
    main()
