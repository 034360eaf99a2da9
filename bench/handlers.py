"""Handlers the benchmarks send calls to."""
from __future__ import annotations

import time
from typing import Any

from dispatcher import handler


@handler("bench.noop")
def noop(**params: Any) -> None:
    return None


@handler("bench.stamp")
def stamp(**params: Any) -> dict[str, float]:
    """Return when the handler started, on this machine's clock."""
    return {"t": time.time()}
