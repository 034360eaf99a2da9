"""An experiment, not part of dispatcher: a `-P threads` worker's bookkeeping in a helper process.

Under `-P threads` a worker process is bound by its GIL, and a call's start and finish cost it
about 2 ms of CPU (docs/performance.md, issue 14's seventh slice). This moves them to a second
process: a worker started with ``BENCH_BOOKKEEPING_HELPER`` set (``bench.tasks`` installs it when
the worker is ready) starts ``python -m bench.helper SOCKET``. Its threads then send each start
and each successful finish there over a Unix socket and wait for the answer. The helper runs
everything that is waiting at once, with the manager's own methods (``start_many``,
``finish_done_many``), and answers each thread with what the method returned (pickled; the
socket is in a directory only this user can enter).

What it leaves out, as an experiment may: a helper that dies is not restarted and a thread that
cannot reach it fails its call; errors, retries and 429s are recorded by the worker as before.
``python -m bench --only http_threads_helper`` measures it.
"""
from __future__ import annotations

import functools
import os
import pickle
import selectors
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

ENV = "BENCH_BOOKKEEPING_HELPER"
ROOT = Path(__file__).resolve().parent.parent
_HEADER = struct.Struct("!I")


def _send(sock: socket.socket, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(_HEADER.pack(len(data)) + data)


def _receive_exactly(sock: socket.socket, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = sock.recv(left)
        if not chunk:
            raise ConnectionError("the bookkeeping helper closed the connection")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


# --- in the worker ------------------------------------------------------------------------------

_local = threading.local()
_path = ""


def _ask(request: tuple[Any, ...]) -> Any:
    sock = getattr(_local, "sock", None)
    if sock is None:
        sock = _local.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(_path)
    _send(sock, request)
    (size,) = _HEADER.unpack(_receive_exactly(sock, _HEADER.size))
    kind, value, noted = pickle.loads(_receive_exactly(sock, size))
    if kind == "error":
        raise value
    return value, noted


def install(**_: Any) -> None:
    """Start the helper and send the worker's starts and successful finishes to it."""
    global _path
    from dispatcher import arrivals, worker
    from dispatcher.models import CallQueue

    _path = os.path.join(tempfile.mkdtemp(prefix="bench-helper-"), "socket")
    helper = subprocess.Popen([sys.executable, "-m", "bench.helper", _path], cwd=ROOT)
    deadline = time.monotonic() + 30
    while not os.path.exists(_path):
        if helper.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the bookkeeping helper did not start")
        time.sleep(0.05)

    def start(call_id: int, dispatch_no: int, worker: str, *, may_wait: timedelta = timedelta(0)) -> Any:
        started, noted = _ask(("start", (call_id, dispatch_no), worker, may_wait))
        arrivals.restore(noted)  # the start's clock was read in the helper (one monotonic clock)
        return started

    def finish_done(call: Any, attempt: Any, result: Any, *, wake: bool = True) -> bool:
        _ask(("done", (call, attempt, result, wake)))  # a call rescued meanwhile is logged there
        return True

    worker._combined_start = start  # type: ignore[assignment]
    CallQueue.objects.finish_done = finish_done  # type: ignore[method-assign]

    from celery.signals import worker_shutdown

    worker_shutdown.connect(lambda **_: helper.terminate(), weak=False)


# --- in the helper ------------------------------------------------------------------------------

def serve(path: str) -> None:
    """Answer the worker's threads: whatever is waiting runs together, starts by (worker, may_wait)."""
    import django

    django.setup()
    from dispatcher import arrivals
    from dispatcher.models import CallQueue

    manager = CallQueue.objects
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(256)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    buffers: dict[socket.socket, bytes] = {}

    def read(sock: socket.socket) -> list[tuple[socket.socket, Any]]:
        data = sock.recv(1 << 16)
        if not data:
            selector.unregister(sock)
            sock.close()
            buffers.pop(sock, None)
            return []
        buffer, requests = buffers.get(sock, b"") + data, []
        while len(buffer) >= _HEADER.size:
            (size,) = _HEADER.unpack(buffer[: _HEADER.size])
            if len(buffer) < _HEADER.size + size:
                break
            requests.append((sock, pickle.loads(buffer[_HEADER.size : _HEADER.size + size])))
            buffer = buffer[_HEADER.size + size :]
        buffers[sock] = buffer
        return requests

    def answer(socks: list[socket.socket], run: Any) -> None:
        try:
            results, noted = run()
            replies = [("ok", result, noted) for result in results]
        except Exception as exc:  # noqa: BLE001 - each thread raises it in its own call
            replies = [("error", exc, None)] * len(socks)
        for sock, reply in zip(socks, replies, strict=True):
            _send(sock, reply)

    while True:
        waiting: list[tuple[socket.socket, Any]] = []
        for timeout in (None, 0):  # what is ready now, then what became ready meanwhile
            for key, _ in selector.select(timeout):
                if key.fileobj is listener:
                    selector.register(listener.accept()[0], selectors.EVENT_READ)
                else:
                    waiting += read(key.fileobj)  # type: ignore[arg-type]
        starts: dict[tuple[str, timedelta], list[tuple[socket.socket, tuple[int, int]]]] = {}
        done = []
        for sock, (kind, *rest) in waiting:
            if kind == "start":
                delivery, worker, may_wait = rest
                starts.setdefault((worker, may_wait), []).append((sock, delivery))
            else:
                done.append((sock, rest[0]))
        for (worker, may_wait), part in starts.items():
            answer([sock for sock, _ in part], functools.partial(
                _start_group, manager, [delivery for _, delivery in part], worker, may_wait, arrivals.snapshot
            ))
        if done:
            answer([sock for sock, _ in done], functools.partial(_finish_group, manager, [d for _, d in done]))


def _start_group(manager: Any, deliveries: list[tuple[int, int]], worker: str, may_wait: timedelta,
                 snapshot: Any) -> tuple[list[Any], Any]:
    return manager.start_many(deliveries, worker, may_wait=may_wait), snapshot()


def _finish_group(manager: Any, done: list[Any]) -> tuple[list[None], None]:
    manager.finish_done_many(done)
    return [None] * len(done), None


if __name__ == "__main__":
    serve(sys.argv[1])
