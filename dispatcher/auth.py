"""Bearer tokens: the one parser of ``Authorization: Bearer <token>`` for the API and the metrics."""
from __future__ import annotations

import hmac
from collections.abc import Iterable

from django.http import HttpRequest


def bearer_token_ok(request: HttpRequest, tokens: Iterable[str]) -> bool | None:
    """Return whether the request's bearer token is one of ``tokens``; None if it sends no Authorization."""
    header = request.headers.get("Authorization", "")
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return False
    given = token.strip().encode()
    # Compare with every token, in constant time each, so the answer's timing tells nothing.
    return any(hmac.compare_digest(given, t.encode()) for t in tokens)
