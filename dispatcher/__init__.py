"""dispatcher: calls to rate-limited APIs as a durable, exactly paced stream."""
from typing import Any

from dispatcher.arrivals import mark_sent, marks_sent
from dispatcher.costs import report_cost
from dispatcher.exceptions import CostNeverFits, InvalidCall, InvalidCost, PermanentError, RateLimited
from dispatcher.registry import handler

__all__ = [
    "handler", "RateLimited", "PermanentError", "InvalidCall", "InvalidCost", "CostNeverFits", "report_cost",
    "report_rate_limit", "mark_sent", "marks_sent",
]


def __getattr__(name: str) -> Any:
    # Django imports this package while it loads INSTALLED_APPS, before any model may be defined;
    # report_rate_limit's module (dispatcher.learning) reads the limiter's tables, so it is
    # imported when first asked for, as django.contrib.auth's get_user_model() looks up its model.
    if name == "report_rate_limit":
        from dispatcher.learning import report_rate_limit

        return report_rate_limit
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
