"""When a failed call is tried again."""
from __future__ import annotations

import random
from dataclasses import dataclass
from datetime import timedelta

from dispatcher.conf import dispatcher_settings as ds

# Up to a quarter more on each delay: calls that failed together (an API's outage) come back spread out.
JITTER = 0.25


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with jitter.

    delay(n) = min(max, base * 2 ** (n - 1)) * (1 + jitter * U), U uniform in [0, 1),
    where n is the number of attempts made so far (n >= 1).
    """

    base: timedelta
    max: timedelta
    jitter: float = JITTER

    def delay(self, attempts: int, rand: float | None = None) -> timedelta:
        """Return how long to wait after the given number of attempts."""
        exponent = max(0, attempts - 1)
        seconds = min(self.max.total_seconds(), self.base.total_seconds() * (2 ** min(exponent, 62)))
        u = random.random() if rand is None else rand
        return timedelta(seconds=seconds * (1 + self.jitter * u))

    @classmethod
    def from_settings(cls) -> RetryPolicy:
        return cls(base=ds.RETRY_BASE, max=ds.RETRY_MAX, jitter=ds.tuned("RETRY_JITTER", JITTER))
