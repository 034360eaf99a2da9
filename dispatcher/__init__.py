"""dispatcher: calls to rate-limited APIs as a durable, exactly paced stream."""
from dispatcher.exceptions import InvalidCall, PermanentError, RateLimited
from dispatcher.registry import handler

__all__ = ["handler", "RateLimited", "PermanentError", "InvalidCall"]
