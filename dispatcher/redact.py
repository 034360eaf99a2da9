"""Redaction of values that look like secrets, for the admin and the logs."""
from __future__ import annotations

import re
from typing import Any

REDACTED = "********"
SECRET_NAME = re.compile(r"(pass(word|wd)?|secret|token|api[-_]?key|auth(orization)?|cookie|credential|private[-_]?key|signature)", re.I)
SECRET_VALUE = re.compile(r"^(bearer|basic|token)\s+\S+", re.I)


def redact(value: Any, depth: int = 0) -> Any:
    """Return a copy of a JSON-like value with secret-looking entries replaced."""
    if depth > 50:
        return REDACTED
    if isinstance(value, dict):
        return {
            k: (REDACTED if isinstance(k, str) and SECRET_NAME.search(k) else redact(v, depth + 1))
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [redact(v, depth + 1) for v in value]
    if isinstance(value, str) and SECRET_VALUE.match(value.strip()):
        return REDACTED
    return value
