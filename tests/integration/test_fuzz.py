"""Bad input, fuzzed: send() and the ratelimit command answer with clear errors and store nothing."""
from __future__ import annotations

import pytest
from django.core.management import CommandError, call_command
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dispatcher.models import CallQueue, RateLimit

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)
hostile_text = st.text(alphabet=st.characters(codec=None, categories=None), max_size=40) | st.sampled_from(
    ["\0", "\ud800", "\udfff", "x" * 300, "*", "a*b", " a", "\r\n", "../../etc", "'; DROP TABLE x; --"]
)


def nested(depth: int) -> dict:
    value: dict = {}
    for _ in range(depth):
        value = {"a": value}
    return value


BAD_SENDS = [
    ("nope", {}, {}),
    (None, {}, {}),
    ("noop", [], {}),
    ("noop", "x", {}),
    ("noop", {"a": float("nan")}, {}),
    ("noop", {"a": "\0"}, {}),
    ("noop", {"a": "\ud800"}, {}),
    ("noop", {"a": b"bytes"}, {}),
    ("noop", {"a": object()}, {}),
    ("noop", {"a": "x" * 70_000}, {}),
    ("noop", nested(10_000), {}),
    ("noop", {}, {"keys": "single"}),
    ("noop", {}, {"keys": ["a*"]}),
    ("noop", {}, {"keys": [""]}),
    ("noop", {}, {"keys": ["x" * 201]}),
    ("noop", {}, {"keys": ["a\nb"]}),
    ("noop", {}, {"keys": [str(i) for i in range(9)]}),
    ("noop", {}, {"priority": 2**40}),
    ("noop", {}, {"priority": "1"}),
    ("noop", {}, {"max_attempts": 0}),
    ("noop", {}, {"queue": "a b"}),
    ("noop", {}, {"run_at": "tomorrow"}),
    ("greet", {"name": ""}, {}),
    ("http", {"method": "GET", "url": "http://evil.example/"}, {}),
    ("http", {"method": "GET\r\n", "url": "http://127.0.0.1/"}, {}),
    ("http", {"method": "GET", "url": "http://127.0.0.1/", "timeout": 1e9}, {}),
    ("http", {"method": "GET", "url": "http://127.0.0.1/", "extra": 1}, {}),
    ("http", {"method": "GET", "url": "http://127.0.0.1/", "json": {}, "data": "x"}, {}),
]


@pytest.mark.django_db
@pytest.mark.parametrize("method, params, extra", BAD_SENDS)
def test_bad_sends_raise_value_error_and_store_nothing(method, params, extra):
    with pytest.raises(ValueError) as info:
        CallQueue.objects.send(method, params, **extra)
    assert str(info.value)
    assert not CallQueue.objects.exists()


@pytest.mark.django_db
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(method=st.sampled_from(["noop", "greet", "http", "nope"]), params=json_values, keys=st.none() | st.lists(hostile_text, max_size=3))
def test_random_sends_either_store_one_call_or_raise_value_error(method, params, keys):
    before = CallQueue.objects.count()
    try:
        call = CallQueue.objects.send(method, params, keys=keys)
    except ValueError:
        assert CallQueue.objects.count() == before
        return
    stored = CallQueue.objects.get(id=call.id)
    assert isinstance(stored.params, dict)


BAD_COMMANDS = [
    ["set", "k", "--limit", "0", "--per", "1s"],
    ["set", "k", "--limit", "x", "--per", "1s"],
    ["set", "k", "--limit", "1", "--per", "0s"],
    ["set", "k", "--limit", "1", "--per", "-1s"],
    ["set", "k", "--limit", "1", "--per", "1 parsec"],
    ["set", "k", "--limit", "1", "--per", "nan"],
    ["set", "k", "--limit", "1", "--per", "1e400"],
    ["set", "k", "--limit", "1", "--per", "1s", "--concurrency", "0"],
    ["set", "a*b", "--limit", "1", "--per", "1s"],
    ["set", "", "--limit", "1", "--per", "1s"],
    ["set", "x" * 201, "--limit", "1", "--per", "1s"],
    ["set", "a\0b", "--limit", "1", "--per", "1s"],
    ["set", "k", "--limit", "99999999999999999999", "--per", "1s"],
    ["pause", "k", "--for", "0s"],
    ["pause", "k", "--for", "forever"],
    ["delete", "missing"],
]


@pytest.mark.django_db
@pytest.mark.parametrize("args", BAD_COMMANDS)
def test_bad_ratelimit_arguments_raise_command_error_and_change_nothing(args):
    with pytest.raises(CommandError):
        call_command("ratelimit", *args)
    assert not RateLimit.objects.exists()
