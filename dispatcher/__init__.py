"""dispatcher: calls to rate-limited APIs as a durable, exactly paced stream."""
from dispatcher.exceptions import InvalidCall, PermanentError, RateLimited
from dispatcher.learning import report_rate_limit
from dispatcher.registry import handler

__all__ = ["handler", "RateLimited", "PermanentError", "InvalidCall", "report_rate_limit"]
