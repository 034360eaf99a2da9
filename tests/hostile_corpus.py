"""Hostile inputs every entry point is run against; add each new finding here.

Strings (long, quadratic-bait, control and bidi characters, secret shapes), answer headers,
JSON shapes and admin query strings. Sizes stay modest so the corpus runs in every test pass;
the benchmarks (bench/hostile.py) use the 1 MB versions.
"""
from __future__ import annotations

N = 20_000  # long enough that a quadratic scan shows (seconds), short enough for a test pass

STRINGS: list[str] = [
    "",
    "\x00",
    "a\x00b",
    "\u202e\u2066\u200b\ufeff",
    "\ud7ff\ue000\U0010ffff",
    "%00",
    "%",
    "\\",
    "'",
    '"',
    "None",
    "key=None",
    "9" * 40,
    "-1",
    "1e309",
    "nan",
    # quadratic bait for regular expressions and scanners
    "a" * N,
    "a=" * N,
    "=" * N,
    "a" * N + "=",
    "-" * N,
    "a-" * N,
    "a:" * N,
    "\n" * N,
    " " * N,
    "x: " + " " * N + "y",
    '"' * N,
    '"\\' * N,
    '"' + '\\"' * N,
    "[" * N,
    "{" * N,
    '{"a":' * N,
    "http://" * N,
    "a://b:" * N,
    "Bearer " * N,
    "Token " * N,
    "token " + "1" * N,
    "password=" * N,
    "<password>" * N,
    "-----BEGIN PRIVATE KEY-----" * 200,
    "api%5Fkey=" * N,
    "{'password': '" * 2000,
    # secret shapes that must be hidden
    "password=hunter2zz",
    "{'password': 'hunter2zz'}",
    "password = hunter2zz",
    "api%5Fkey=hunter2zz",
    "Ocp-Apim-Subscription-Key: hunter2zz",
    "<password>hunter2zz</password>",
    "-----BEGIN RSA PRIVATE KEY-----\nhunter2zzAAAA\n-----END RSA PRIVATE KEY-----",
]

# Strings in STRINGS holding the secret "hunter2zz" in a shape redaction must hide.
SECRET_SHAPES = [s for s in STRINGS if "hunter2zz" in s]

# Rate-limit answers (header name, value) an API might send, hostile or broken.
HEADERS: list[list[tuple[str, str]]] = [
    [("RateLimit-Policy", '"p0";q=100000;w=0.123456, "p1";q=99999;w=1.5, "p2";q=5;w=77.1, "p3";q=7;w=3.3')],
    [("RateLimit-Policy", ", ".join(f'"p{i}";q={i + 1};w={i + 0.5}' for i in range(100)))],
    [("RateLimit-Policy", '"p";q=1;w=0')],
    [("RateLimit-Policy", '"p";q=0;w=1e308')],
    [("RateLimit-Policy", '"p";q=-1;w=-1')],
    [("RateLimit-Policy", '"' * 2000)],
    [("RateLimit-Policy", ";" * 1000)],
    [("RateLimit", '"p";r=0;t=99999999999')],
    [("X-RateLimit-Limit", "99999999999999999999"), ("X-RateLimit-Remaining", "0"), ("X-RateLimit-Reset", "1e300")],
    [("X-RateLimit-Limit", "10"), ("X-RateLimit-Reset", "nan")],
    [("Retry-After", "Wed, 21 Oct 99999 07:28:00 GMT")],
    [("Retry-After", "-5")],
    [("Retry-After", "9" * 1000)],
]

# JSON texts an API or a caller might send (depth scan and parser).
JSON_TEXTS: list[str] = [
    '"' + '\\"' * N,
    '"\\' * N,
    '"' * N,
    "[" * N,
    "[" * N + "]" * N,
    "[]" * N,
    '{"a":' * N,
    '["' + "a" * N + '"]',
    '"\\' + '"' * N,
    "]" * N + "[" * 40,
]

# Query strings for the admin's lists.
ADMIN_QUERY_STRINGS: list[str] = [
    "params__json__password__startswith=h",
    "params__password__regex=.",
    "last_error__contains=hunter",
    "last_error__regex=(a%2B)%2B%24",
    "result__token__startswith=h",
    "last_traceback__icontains=x",
    "run_at__year=99999",
    "run_at__year=abc",
    "created_at__gte=0000-00-00",
    "period=abc",
    "key=%00",
    "q=%00",
    "q=" + "a" * 5000,
    "q=%22password%22%3A%20%22h",
    "term=%00",
    "o=999",
    "o=-1.abc",
    "o=" + "9" * 30,
    "p=-1",
    "p=" + "9" * 30,
    "state=%00",
    "state=" + "x" * 300,
    "key=" + "%E2%80%AE" * 50,
    "method__exact=%00",
    "method__isnull=maybe",
    "_facets=1",
    "_to_field=params",
    "_popup=1&_to_field=last_error",
    "e=1",
    "id__gt=99999999999999999999999",
    "pk=1",
]
