"""Hostile-input timings: redaction and the JSON depth scan of 1 MB, each shape of the corpus at that size.

Run with ``python -m bench.hostile`` (Django settings from ``DJANGO_SETTINGS_MODULE``, default
``tests.settings``). Prints one row per shape and the worst; the targets are 50 ms each
(docs/security.md). Pure: no database.
"""
from __future__ import annotations

import os
import time

import django

SIZE = 1 << 20
TARGET_MS = 50.0

SHAPES = [
    "a", "a=", "=", "-", "a-", "a:", "\n", " ", '"', '"\\', '\\"', "[", "{", "[]", '{"a":', "http://", "a://b:",
    "Bearer ", "Token ", "password=", "<password>", "api%5Fkey=", "{'password': '", "x: ", "<a>", "'a':'",
    "-----BEGIN PRIVATE KEY-----", "password=hunter2zz&", "Authorization: Bearer abc\n", "é", "\u202e",
    # a secret name's container value: element tags paired, brackets counted, YAML blocks read
    "<password><a>", "<key>", "<password><![CDATA[", '{"password": {', "password=[", "password: {\n",
    "password:\n", "- password:\n", "password: |\n",
    # strings escaped, joined or triple-quoted; INI sections; ``=>``; a secret named by a sibling;
    # a secret element's attributes; a secret element never closed
    '{\\"password\\": \\"', '{\\"password\\": {\\"', 'password="a\\"', "'token': 'ab' ", 'password = """',
    "[password]\n", "[password]\nv=1\n", '"password" => "', "password => ", '<add key="ApiKey" value="',
    '{"name": "password", "value": "', '{"name": "password", "value": {', '<password value="x"/>', "<token> ",
    "<token></a>",
    # an element a name attribute names secret, its content; form fields a sibling names secret
    '<setting name="ApiKey"><v>', '<param name="password">', '<setting name="ApiKey"></a>',
    "name=password&value=", "key=api_key&val=x&", "name=password&",
]


def grow(unit: str, size: int = SIZE) -> str:
    return (unit * (size // len(unit) + 1))[:size]


def best_of(fn, text: str, runs: int = 3) -> float:
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        fn(text)
        times.append(time.perf_counter() - started)
    return min(times) * 1000


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    django.setup()
    from dispatcher.redact import redact_text
    from dispatcher.validation import json_text_depth

    rows = []
    for unit in SHAPES:
        text = grow(unit)
        rows.append((unit, best_of(redact_text, text), best_of(json_text_depth, text)))
    rows.append(('"\\"\\"...', best_of(redact_text, '"' + grow('\\"')), best_of(json_text_depth, '"' + grow('\\"'))))
    print(f"{'shape (x 1 MiB)':32} {'redact ms':>10} {'depth ms':>10}")
    for unit, redact_ms, depth_ms in rows:
        print(f"{unit[:30]!r:32} {redact_ms:10.1f} {depth_ms:10.1f}")
    worst_redact = max(r[1] for r in rows)
    worst_depth = max(r[2] for r in rows)
    print(f"worst: redact {worst_redact:.1f} ms, depth scan {worst_depth:.1f} ms (targets {TARGET_MS:g} ms each)")


if __name__ == "__main__":
    main()
