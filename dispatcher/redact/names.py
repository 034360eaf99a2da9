"""Secret names, and what says a value holds no secret: what every pass of ``dispatcher.redact`` asks."""
from __future__ import annotations

import functools
import re
from urllib.parse import unquote

REDACTED = "********"
SECRET_NAME = re.compile(
    r"(pass(word|wd|phrase)?|secret|token|api[-_]?key|access[-_]?key|subscription[-_]?key|auth(orization)?|cookie"
    r"|credential|private[-_]?key|signature|session[-_]?id|jwt|^(sig|key|pwd)$)",
    re.I,
)
SECRET_VALUE = re.compile(r"^(bearer|basic|token)\s+\S+", re.I)
# Values that say there is no secret: ``key=None`` stays readable in a log line.
NOT_SECRET = frozenset({"", "none", "null", "nil", "undefined", "true", "false", "-", "[]", "{}", "()", REDACTED.lower()})
# A known secret shorter than this is not searched for in text (it would hide ordinary words).
MIN_KNOWN_SECRET = 6
NAME_CHARS = r"A-Za-z0-9_.\-\[\]%"
# Some part of every secret name (SECRET_NAME, URL-encoded names included: %5F is an
# underscore, the words around it stay), and of every credential scheme: a text without any
# needs no name- or scheme-based pattern.
NAMED = ("pass", "pwd", "secret", "token", "key", "auth", "cookie", "credential", "sig", "session", "jwt")


@functools.lru_cache(maxsize=1024)  # text repeats its names: a tag, a header per line
def is_secret(name: str) -> bool:
    if "%" in name:
        name = unquote(name)  # api%5Fkey is api_key
    return bool(SECRET_NAME.search(name))


def hidden(value: str) -> bool:
    return value.strip("\"' ").lower() not in NOT_SECRET
