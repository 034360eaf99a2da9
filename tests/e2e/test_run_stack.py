"""`make run`: gunicorn on the port of PORT, and Ctrl-C stops the whole stack cleanly."""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import urllib.request

import pytest

from support.processes import ROOT, clean_environment, wait_until


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def children(pid: int) -> list[int]:
    """The pids of a process's children, read from /proc."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                with open(f"/proc/{entry}/stat") as stat:
                    # pid (comm) state ppid ...: comm may hold spaces, so split after its ")".
                    if int(stat.read().rsplit(")", 1)[1].split()[1]) == pid:
                        found.append(int(entry))
    return found


@pytest.mark.embedded
@pytest.mark.slow
def test_make_run_serves_on_port_and_stops_cleanly_on_ctrl_c(tmp_path):
    port = free_port()
    env = clean_environment({"DISPATCHER_VAR_DIR": str(tmp_path), "PORT": str(port), "PYTHONUNBUFFERED": "1"})
    log = tmp_path / "run.log"
    with open(log, "w") as out:
        stack = subprocess.Popen(
            [sys.executable, "-m", "demo.run_stack"], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        served = wait_until(lambda: answers(f"http://127.0.0.1:{port}/admin/login/"), 120, 0.5)
        # Let worker, beat and dispenser come up (and beat send its first dispense) before Ctrl-C.
        up = wait_until(lambda: "ready." in log.read_text() and "dispenser running" in log.read_text(), 60, 0.5)
        assert served and up, log.read_text()[-4000:]
        stack.send_signal(signal.SIGINT)  # what Ctrl-C sends to the foreground process
        try:
            rc = stack.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail("the stack did not stop within 60 s of Ctrl-C:\n" + log.read_text()[-6000:])
    finally:
        if stack.poll() is None:
            # Its processes run in sessions of their own: stop them too, not only the stack.
            for pid in children(stack.pid):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)
            os.killpg(stack.pid, signal.SIGKILL)
            stack.wait(timeout=10)
    text = log.read_text()
    assert rc == 0, text[-4000:]
    assert "Starting gunicorn" in text and f"Listening at: http://127.0.0.1:{port}" in text
    assert "ERROR" not in text and "Traceback" not in text, text[-4000:]
    assert "stopping web, worker, beat and dispenser" in text
