"""dispatcher: calls to rate-limited APIs as a durable, exactly paced stream."""
from dispatcher.arrivals import mark_sent
from dispatcher.costs import report_cost
from dispatcher.exceptions import CostNeverFits, InvalidCall, InvalidCost, PermanentError, RateLimited
from dispatcher.learning import report_rate_limit
from dispatcher.registry import handler

__all__ = [
    "handler", "RateLimited", "PermanentError", "InvalidCall", "InvalidCost", "CostNeverFits", "report_cost",
    "report_rate_limit", "mark_sent",
]
