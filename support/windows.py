"""Sliding-window arithmetic over event times, used to check limits from the outside."""
from __future__ import annotations

from collections.abc import Iterable


def max_in_window(times: Iterable[float], period: float) -> int:
    """Return the most events in any closed interval of length ``period``."""
    best, left = 0, 0
    ordered = sorted(times)
    for right, t in enumerate(ordered):
        while ordered[left] < t - period:
            left += 1
        best = max(best, right - left + 1)
    return best
