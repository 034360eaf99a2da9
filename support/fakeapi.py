"""A fake third-party API on 127.0.0.1 for the tests, the benchmarks and the demo; it records every arrival.

In the tests and benchmarks it runs in a thread of the test (``FakeAPI().start()``). The demo runs
it as its partner in a process of its own, with published limits: ``python -m support.fakeapi
--limit 20 --per 2 --concurrency 4 --tenant-limit 6``; see ``main()``. Control and statistics
over HTTP: ``GET /_fake/stats`` and ``POST /_fake/limits`` (a JSON object of new limits).
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import random
import signal
import threading
import time
from collections import defaultdict, deque
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from support.windows import max_in_window  # noqa: F401 - re-exported for callers

LIMIT_FIELDS = {"limit", "period", "concurrency", "tenant_limit", "announce"}

# While a partner serves in a thread of the test, the objects the test process already holds are
# kept out of the garbage collector's full collections (``gc.freeze``): a full collection stops
# every thread of the process, the partner's too, which then stamps a burst of requests that
# waited as if they had arrived together. After a few hundred tests it took about as long as
# the largest guard (an e2e run in CI saw 4 x 429 from its window partner and a start-to-arrival
# spread of 260 ms; a full collection of the heap pytest holds after collecting the tests alone
# takes 86 ms here, and 0 ms once frozen). Frozen from the first partner's start to the last
# one's stop.
_serving = 0
_serving_lock = threading.Lock()


def _partner_started() -> None:
    global _serving
    with _serving_lock:
        if _serving == 0:
            gc.collect()
            gc.freeze()
        _serving += 1


def _partner_stopped() -> None:
    global _serving
    with _serving_lock:
        _serving -= 1
        if _serving == 0:
            gc.unfreeze()


def answer(req: BaseHTTPRequestHandler, status: int, body: dict, headers: dict | None = None) -> None:
    """Write a JSON answer with its length, and any extra headers."""
    data = json.dumps(body).encode()
    req.send_response(status)
    req.send_header("Content-Type", "application/json")
    req.send_header("Content-Length", str(len(data)))
    for name, value in (headers or {}).items():
        req.send_header(name, value)
    req.end_headers()
    req.wfile.write(data)


@dataclass
class Arrival:
    at: float
    path: str
    tenant: str
    call: str
    units: int = 1
    # The status it was answered with (0 until answered).
    status: int = 0


class Window:
    """Refuses a request whose units would make more than ``limit`` in the last ``period`` seconds."""

    def __init__(self, limit: int, period: float) -> None:
        self.limit, self.period = limit, period
        self.recent: deque = deque()

    def admit(self, now: float, units: int) -> float | None:
        while self.recent and self.recent[0][0] <= now - self.period:
            self.recent.popleft()
        if sum(u for _, u in self.recent) + units > self.limit:
            return max(0.05, self.recent[0][0] + self.period - now)
        self.recent.append((now, units))
        return None


class Bucket:
    """A token bucket: ``rate`` tokens per second up to ``burst``; a request takes its units."""

    def __init__(self, rate: float, burst: int) -> None:
        self.rate, self.burst = rate, burst
        self.tokens = float(burst)
        self.last: float | None = None

    def admit(self, now: float, units: int) -> float | None:
        if self.last is not None:
            self.tokens = min(self.burst, self.tokens + (now - self.last) * self.rate)
        self.last = now
        if self.tokens < units:
            return (units - self.tokens) / self.rate
        self.tokens -= units
        return None


class Smooth:
    """Refuses any request closer than ``interval`` seconds to the last one it admitted."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.last: float | None = None

    def admit(self, now: float, units: int) -> float | None:
        if self.last is not None and now - self.last < self.interval:
            return self.interval - (now - self.last)
        self.last = now
        return None


@dataclass
class FakeAPI:
    """Paths: /ok, /fail/<id>?times=N (500 N times then 200), /always500, /bad (400),
    /limited/<id>?times=N&after=S (429 with Retry-After S, N times, then 200), /slow?delay=S.

    With ``enforce=(limit, period)`` the API itself answers 429 (Retry-After) to any request
    beyond ``limit`` in the last ``period`` seconds, as a real partner would; ``tenant_limit``
    adds that many per period for each ``X-Tenant``, and ``concurrency`` a cap on requests served
    at once. These apply to paths without a shape. ``latency`` (low, high) makes every request
    served take a random time in that range, in seconds. With ``announce``
    it also states its limit on every answer: ``"x-seconds"`` (X-RateLimit-* with the reset in
    seconds), ``"x-epoch"`` (the reset as an epoch timestamp), ``"ietf"`` (RateLimit and
    RateLimit-Policy) or ``"retry-after"`` (nothing but Retry-After on its 429s).
    ``connections`` counts the TCP connections it accepted.
    """

    enforce: tuple[int, float] | None = None
    # Per first path segment, a policy enforced on arrival (Window, Bucket, Smooth); the units
    # of a request are its X-Cost header (default 1).
    shapes: dict = field(default_factory=dict)
    refused: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    arrivals: list[Arrival] = field(default_factory=list)
    # The arrivals a shape admitted (the others were answered 429).
    answered: list[Arrival] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    counters: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    recent: deque = field(default_factory=deque)
    rejected_429: int = 0
    rejected_at: list[float] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0
    announce: str | None = None
    connections: int = 0
    tenant_limit: int | None = None
    concurrency: int | None = None
    latency: tuple[float, float] | None = None
    recent_by_tenant: dict[str, deque] = field(default_factory=lambda: defaultdict(deque))
    # Requests admitted and not yet done with their work (concurrency counts these).
    serving: int = 0
    max_serving: int = 0
    # Close every connection after its answer (``Connection: close``), as an API without keep-alive.
    close_connections: bool = False
    # Whether this partner's start froze the test process's heap (``_partner_started``).
    frozen_heap: bool = field(default=False, repr=False)

    def start(self) -> FakeAPI:
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            # Headers and body go out in two writes; without this, Nagle's algorithm holds the
            # body back for the client's delayed ACK (40 ms) on a kept-alive connection.
            disable_nagle_algorithm = True

            def log_message(self, *args) -> None:  # quiet
                pass

            def setup(self) -> None:
                with api.lock:
                    api.connections += 1
                super().setup()

            def end_headers(self) -> None:
                if api.close_connections:
                    self.send_header("Connection", "close")  # and closes it after the answer
                super().end_headers()

            def do_GET(self) -> None:
                api._serve(self)

            do_POST = do_GET

        # A real API's listen backlog, not socketserver's 5: with 5, a burst of new connections
        # overflows it and the kernel retries the dropped ones a second later.
        server_class = type("Server", (ThreadingHTTPServer,), {"request_queue_size": 128})
        self.server = server_class(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        _partner_started()
        self.frozen_heap = True
        self.thread.start()
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        if self.frozen_heap:
            self.frozen_heap = False
            _partner_stopped()

    def _serve(self, req: BaseHTTPRequestHandler) -> None:
        now = time.time()
        length = int(req.headers.get("content-length") or 0)
        body = req.rfile.read(length) if length else b""
        parts = urlsplit(req.path)
        if parts.path.startswith("/_fake/"):
            return self._control(req, parts.path, body)
        query = {k: v[0] for k, v in parse_qs(parts.query).items()}
        segments = [s for s in parts.path.split("/") if s]
        units = int(req.headers.get("x-cost") or 1)
        tenant = req.headers.get("x-tenant", "")
        arrival = Arrival(now, parts.path, tenant, req.headers.get("x-call", ""), units)
        announced: dict[str, str] = {}
        with self.lock:
            self.arrivals.append(arrival)
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            shape = self.shapes.get(segments[0] if segments else "")
            if shape is not None:
                wait = shape.admit(now, units)
                if wait is not None:
                    self.refused[segments[0]] += 1
                    self.rejected_429 += 1
                    self.in_flight -= 1
                    return self._reply(req, arrival, 429, {"error": "slow down"}, {"Retry-After": f"{wait:.3f}"})
                self.answered.append(arrival)
            elif self.enforce is not None:
                limit, period = self.enforce
                waits = self._waits(tenant, now, limit, period)
                if waits:
                    self.rejected_429 += 1
                    self.rejected_at.append(now)
                    retry = max(0.05, *waits)
                    self.in_flight -= 1
                    headers = self._announced(limit, period, 0, retry, now) if self.announce else {}
                    headers.setdefault("Retry-After", f"{retry:.3f}" if not self.announce else str(math.ceil(retry)))
                    return self._reply(req, arrival, 429, {"error": "slow down"}, headers)
                self.recent.append(now)
                if tenant and self.tenant_limit:
                    self.recent_by_tenant[tenant].append(now)
                if self.announce:
                    reset = self.recent[max(len(self.recent) - limit, 0)] + period - now
                    announced = self._announced(limit, period, max(limit - len(self.recent), 0), reset, now)
            self.serving += 1
            self.max_serving = max(self.max_serving, self.serving)
            self.counters[parts.path] += 1
            seen = self.counters[parts.path]
        try:
            kind = segments[0] if segments else "ok"
            try:
                if kind == "slow":
                    time.sleep(float(query.get("delay", "0.2")))
                if self.latency is not None:
                    time.sleep(random.uniform(*self.latency))
            finally:
                # Done before the answer is written: a client counts a request as in progress until
                # it has read the answer, so it never sees more at once than ``serving``.
                with self.lock:
                    self.serving -= 1
            if kind == "fail" and seen <= int(query.get("times", "1")):
                return self._reply(req, arrival, 500, {"error": "transient", "seen": seen})
            if kind == "always500":
                return self._reply(req, arrival, 500, {"error": "down"})
            if kind == "bad":
                return self._reply(req, arrival, 400, {"error": "bad request"})
            if kind == "limited" and seen <= int(query.get("times", "1")):
                return self._reply(req, arrival, 429, {"error": "slow down"}, {"Retry-After": query.get("after", "1")})
            return self._reply(req, arrival, 200, {"ok": True, "seen": seen, "path": parts.path}, announced)
        finally:
            with self.lock:
                self.in_flight -= 1

    def _waits(self, tenant: str, now: float, limit: int, period: float) -> list[float]:
        """Seconds until each limit the request is beyond frees (none: it may be served); call under the lock."""
        tenant_window = self.recent_by_tenant[tenant] if tenant and self.tenant_limit else None
        for window in (self.recent, tenant_window):
            while window and window[0] <= now - period:
                window.popleft()
        waits = []
        if len(self.recent) >= limit:
            waits.append(self.recent[len(self.recent) - limit] + period - now)
        if tenant_window is not None and self.tenant_limit and len(tenant_window) >= self.tenant_limit:
            waits.append(tenant_window[len(tenant_window) - self.tenant_limit] + period - now)
        if self.concurrency is not None and self.serving >= self.concurrency:
            waits.append(0.2)
        return waits

    def _reply(
        self, req: BaseHTTPRequestHandler, arrival: Arrival, status: int, body: dict, headers: dict | None = None,
    ) -> None:
        arrival.status = status
        answer(req, status, body, headers)

    def _control(self, req: BaseHTTPRequestHandler, path: str, body: bytes) -> None:
        """``GET /_fake/stats``; ``POST /_fake/limits`` with new limits (400 for an unknown or bad one)."""
        if path == "/_fake/stats":
            return answer(req, 200, self.stats())
        if path == "/_fake/limits" and req.command == "POST":
            try:
                self.set_limits(**json.loads(body or b"{}"))
            except (ValueError, TypeError) as exc:
                return answer(req, 400, {"error": str(exc)})
            return answer(req, 200, self.stats()["limits"])
        answer(req, 404, {"error": f"no control endpoint {path}"})

    def set_limits(self, **changes: Any) -> None:
        """Change the published limits (limit, period, concurrency, tenant_limit, announce: 1 for the IETF fields)."""
        unknown = set(changes) - LIMIT_FIELDS
        if unknown:
            raise ValueError(f"unknown limit fields: {', '.join(sorted(unknown))}")
        with self.lock:
            limit, period = self.enforce or (1, 1.0)
            limit, period = int(changes.get("limit", limit)), float(changes.get("period", period))
            concurrency = int(changes.get("concurrency", self.concurrency or 1))
            tenant_limit = int(changes.get("tenant_limit", self.tenant_limit or 1))
            if min(limit, period, concurrency, tenant_limit) <= 0:
                raise ValueError("limits must be greater than zero")
            self.enforce = (limit, period)
            if "concurrency" in changes:
                self.concurrency = concurrency
            if "tenant_limit" in changes:
                self.tenant_limit = tenant_limit
            if "announce" in changes:
                self.announce = "ietf" if int(changes["announce"]) else None

    def stats(self) -> dict[str, Any]:
        """The limits in force and every arrival as (time, tenant, status); the shaped /v2/ API's apart."""
        with self.lock:
            limit, period = self.enforce or (None, None)
            return {
                "limits": {
                    "limit": limit, "period": period, "concurrency": self.concurrency,
                    "tenant_limit": self.tenant_limit, "announce": int(self.announce is not None),
                },
                "arrivals": [(a.at, a.tenant, a.status) for a in self.arrivals if not a.path.startswith("/v2/")],
                "bucket_arrivals": [(a.at, a.status) for a in self.arrivals if a.path.startswith("/v2/")],
                "max_in_flight": self.max_serving,
            }

    def _announced(self, limit: int, period: float, remaining: int, reset: float, now: float) -> dict[str, str]:
        """The headers with which the API states its limit, in the style chosen."""
        if self.announce == "x-seconds":
            return {"X-RateLimit-Limit": str(limit), "X-RateLimit-Remaining": str(remaining), "X-RateLimit-Reset": f"{reset:.3f}"}
        if self.announce == "x-epoch":
            return {"X-RateLimit-Limit": str(limit), "X-RateLimit-Remaining": str(remaining), "X-RateLimit-Reset": f"{now + reset:.3f}"}
        if self.announce == "ietf":
            return {
                "RateLimit-Policy": f'"default";q={limit};w={math.ceil(period)}',
                "RateLimit": f'"default";r={remaining};t={math.ceil(reset)}',
            }
        return {}

    def times(self, predicate=lambda a: True) -> list[float]:
        with self.lock:
            return sorted(a.at for a in self.arrivals if predicate(a))


def main(argv: list[str] | None = None) -> None:
    """Serve the demo's partner until SIGTERM or Ctrl-C: a window, per-tenant and concurrency limits, a bucket at /v2/."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--limit", type=int, default=20)
    parser.add_argument("--per", type=float, default=2.0, help="period in seconds")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--tenant-limit", type=int, default=6)
    parser.add_argument("--bucket-rate", type=float, default=4.0, help="/v2/: tokens per second")
    parser.add_argument("--bucket-burst", type=int, default=12, help="/v2/: bucket depth")
    args = parser.parse_args(argv)
    api = FakeAPI(
        enforce=(args.limit, args.per), concurrency=args.concurrency, tenant_limit=args.tenant_limit,
        latency=(0.02, 0.08), shapes={"v2": Bucket(args.bucket_rate, args.bucket_burst)},
    ).start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    print(f"listening on {api.url}", flush=True)
    stop.wait()
    api.stop()


if __name__ == "__main__":
    main()
