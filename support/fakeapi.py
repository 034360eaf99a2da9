"""A fake third-party API served on 127.0.0.1 inside the tests and benchmarks; it records every arrival.

Its answer writer and policy shapes (``Window``, ``Bucket``, ``Smooth``) also serve the demo's partner.
"""
from __future__ import annotations

import json
import math
import threading
import time
from collections import defaultdict, deque
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

from support.windows import max_in_window  # noqa: F401 - re-exported for callers


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
    beyond ``limit`` in the last ``period`` seconds, as a real partner would. With ``announce``
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

            def do_GET(self) -> None:
                api._serve(self)

            do_POST = do_GET

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _serve(self, req: BaseHTTPRequestHandler) -> None:
        now = time.time()
        length = int(req.headers.get("content-length") or 0)
        if length:
            req.rfile.read(length)
        parts = urlsplit(req.path)
        query = {k: v[0] for k, v in parse_qs(parts.query).items()}
        segments = [s for s in parts.path.split("/") if s]
        units = int(req.headers.get("x-cost") or 1)
        with self.lock:
            self.arrivals.append(
                Arrival(now, parts.path, req.headers.get("x-tenant", ""), req.headers.get("x-call", ""), units)
            )
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            shape = self.shapes.get(segments[0] if segments else "")
            if shape is not None:
                wait = shape.admit(now, units)
                if wait is not None:
                    self.refused[segments[0]] += 1
                    self.rejected_429 += 1
                    self.in_flight -= 1
                    return self._answer(req, 429, {"error": "slow down"}, {"Retry-After": f"{wait:.3f}"})
                self.answered.append(self.arrivals[-1])
            if self.enforce is not None:
                limit, period = self.enforce
                while self.recent and self.recent[0] <= now - period:
                    self.recent.popleft()
                if len(self.recent) >= limit:
                    self.rejected_429 += 1
                    self.rejected_at.append(now)
                    retry = max(0.05, self.recent[0] + period - now)
                    self.in_flight -= 1
                    headers = self._announced(limit, period, 0, retry, now) if self.announce else {}
                    headers.setdefault("Retry-After", f"{retry:.3f}" if not self.announce else str(math.ceil(retry)))
                    return self._answer(req, 429, {"error": "slow down"}, headers)
                self.recent.append(now)
                announced = (
                    self._announced(limit, period, limit - len(self.recent), self.recent[0] + period - now, now)
                    if self.announce else {}
                )
            counter_key = parts.path
            self.counters[counter_key] += 1
            seen = self.counters[counter_key]
        try:
            kind = segments[0] if segments else "ok"
            if kind == "slow":
                time.sleep(float(query.get("delay", "0.2")))
            if kind == "fail" and seen <= int(query.get("times", "1")):
                return self._answer(req, 500, {"error": "transient", "seen": seen})
            if kind == "always500":
                return self._answer(req, 500, {"error": "down"})
            if kind == "bad":
                return self._answer(req, 400, {"error": "bad request"})
            if kind == "limited" and seen <= int(query.get("times", "1")):
                return self._answer(req, 429, {"error": "slow down"}, {"Retry-After": query.get("after", "1")})
            return self._answer(req, 200, {"ok": True, "seen": seen, "path": parts.path}, announced if self.enforce else None)
        finally:
            with self.lock:
                self.in_flight -= 1

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

    @staticmethod
    def _answer(req: BaseHTTPRequestHandler, status: int, body: dict, headers: dict | None = None) -> None:
        answer(req, status, body, headers)

    def times(self, predicate=lambda a: True) -> list[float]:
        with self.lock:
            return sorted(a.at for a in self.arrivals if predicate(a))
