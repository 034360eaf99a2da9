"""Fault-injection points the crash tests switch on through ``DISPATCHER_FAULTS``."""
from __future__ import annotations

import logging
import os

log = logging.getLogger("dispatcher")


def maybe_fail(point: str) -> None:
    """Kill this process at a named point if the environment asks for it."""
    wanted = {p.strip() for p in os.environ.get("DISPATCHER_FAULTS", "").split(",") if p.strip()}
    if point in wanted:
        log.error("fault_injected point=%s pid=%s", point, os.getpid())
        os._exit(70)
