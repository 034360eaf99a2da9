"""Exceptions that handlers raise and that ``send()`` raises for bad input."""
from __future__ import annotations


class InvalidCall(ValueError):
    """A call that ``send()`` refused; nothing was stored."""


class UnknownMethod(InvalidCall):
    """The method names no registered handler."""


class InvalidParams(InvalidCall):
    """The params are not a JSON object, too large, or rejected by the handler's validator."""


class InvalidKey(InvalidCall):
    """A rate-limit key is empty, too long, or cannot be formatted from the params."""


class InvalidCost(InvalidCall):
    """A call's cost is not a whole number of units of at least 1, or names a key the call lacks."""


class CostNeverFits(InvalidCost):
    """A call's cost is larger than one of its policies could ever admit (its limit or burst)."""


class PermanentError(Exception):
    """Raised by a handler for a failure that a retry cannot fix; the call fails at once."""


class RateLimited(Exception):
    """Raised by a handler when the downstream says "slow down".

    The key (by default every key of the call) is paused for ``retry_after`` seconds and the
    call waits without spending an attempt.
    """

    def __init__(self, retry_after: float | None = None, *, key: str | None = None, message: str = ""):
        self.retry_after = retry_after
        self.key = key
        super().__init__(message or f"rate limited (retry after {retry_after}s)")
