"""Rate-limit keys: formatting templates from params, validation, the canonical key set."""
from __future__ import annotations

import functools
import json
import string
import unicodedata
from collections.abc import Iterable, Mapping
from typing import Any

from dispatcher.exceptions import InvalidKey

MAX_KEY_LENGTH = 200
MAX_KEYS = 8

_formatter = string.Formatter()
# Characters a key may not hold, by Unicode category: control (Cc), format (Cf: bidi overrides
# such as U+202E, zero-width U+200B-U+200D, U+FEFF), surrogate (Cs), line and paragraph separators
# (Zl, Zp). Each would make two keys look the same in the admin, or one key look like another.
_INVISIBLE_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})
# json.dumps builds a new encoder whenever it is given options; this one is built once.
_compact_json = json.JSONEncoder(separators=(",", ":"))


def format_key(template: str, params: Mapping[str, Any]) -> str:
    """Fill a key template such as ``mailgun:{account_id}`` from the call's params."""
    try:
        fields = [name for _, name, _, _ in _formatter.parse(template) if name is not None]
    except ValueError as exc:
        raise InvalidKey(f"bad key template {template!r}: {exc}") from None
    for name in fields:
        if not name or not name.isidentifier():
            raise InvalidKey(f"key template {template!r} may only name params, like {{account_id}}")
        if name not in params:
            raise InvalidKey(f"key template {template!r} needs param {name!r}, which the call lacks")
    return template.format_map({name: params[name] for name in fields})


def validate_key(key: Any) -> str:
    """Return the key if it is usable for a call, else raise InvalidKey."""
    if not isinstance(key, str):
        raise InvalidKey(f"a key must be a string, not {type(key).__name__}")
    if not key or key != key.strip():
        raise InvalidKey(f"a key must be non-empty without surrounding spaces: {key!r}")
    if len(key) > MAX_KEY_LENGTH:
        raise InvalidKey(f"key longer than {MAX_KEY_LENGTH} characters: {key[:40]!r}...")
    if "*" in key:
        raise InvalidKey(f"a call's key cannot contain '*' (patterns belong to rate limits): {key!r}")
    _refuse_hidden_text(key, "a key", InvalidKey)
    return key


def resolve_keys(templates: Iterable[str], extra: Iterable[str] | None, params: Mapping[str, Any]) -> list[str]:
    """Return the call's keys: the handler's templates filled in, plus keys given to send()."""
    keys: list[str] = []
    for template in templates:
        keys.append(validate_key(format_key(template, params)))
    if extra is not None:
        if isinstance(extra, (str, bytes, Mapping)):
            raise InvalidKey(f"keys must be a list of strings, not {type(extra).__name__}")
        for key in extra:
            keys.append(validate_key(key))
    unique = list(dict.fromkeys(keys))
    if len(unique) > MAX_KEYS:
        raise InvalidKey(f"a call may have at most {MAX_KEYS} keys, got {len(unique)}")
    return unique


def _refuse_hidden_text(key: str, what: str, error: type[Exception]) -> None:
    """Raise ``error`` if the key is not valid Unicode or holds a character that does not show."""
    if not _is_unicode(key):
        raise error(f"{what} must be valid Unicode text: {key!r}")
    if _has_invisible(key):
        raise error(f"{what} cannot contain control, format (bidi, zero-width) or line-separator characters: {key!r}")


def _has_invisible(text: str) -> bool:
    """Whether the text holds a character of a category in _INVISIBLE_CATEGORIES."""
    return any(unicodedata.category(char) in _INVISIBLE_CATEGORIES for char in text)


def _is_unicode(text: str) -> bool:
    """Whether the text encodes to UTF-8 (no lone surrogates, which JSON columns refuse)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def key_set(keys: Iterable[str]) -> str:
    """Return the canonical text of a set of keys: sorted, JSON-encoded."""
    return _key_set_text(frozenset(keys))


# Calls share a few key sets, and send_many() would otherwise encode the same one thousands of times.
@functools.lru_cache(maxsize=4096)
def _key_set_text(keys: frozenset[str]) -> str:
    return _compact_json.encode(sorted(keys))


def key_in_set(key: str) -> str:
    """Return the text a key takes inside a stored key set (to find the sets that hold it)."""
    return json.dumps(key)


def parse_key_set(text: str) -> list[str]:
    return list(json.loads(text))


def read_key_set(text: str) -> list[str]:
    """Return the keys of a stored key set; raise InvalidKey if a row written by hand holds none."""
    return list(_read_key_set(text))


# A pass reads the same few key sets again and again; each is checked once.
@functools.lru_cache(maxsize=4096)
def _read_key_set(text: str) -> tuple[str, ...]:
    try:
        keys = json.loads(text)
    except (TypeError, ValueError) as exc:
        raise InvalidKey(f"the stored key_set {text[:80]!r} is not JSON: {exc}") from None
    if not isinstance(keys, list):
        raise InvalidKey(f"the stored key_set {text[:80]!r} is not a JSON list of keys")
    if len(set(map(repr, keys))) != len(keys):
        raise InvalidKey(f"the stored key_set {text[:80]!r} repeats a key")
    try:
        return tuple(validate_key(key) for key in keys)
    except InvalidKey as exc:
        raise InvalidKey(f"the stored key_set {text[:80]!r}: {exc}") from None


def is_pattern(key: str) -> bool:
    return key.endswith("*")


def validate_policy_key(key: Any) -> str:
    """Return a policy key (exact, or a pattern ending in ``*``) or raise ValueError."""
    if not isinstance(key, str) or not key or key != key.strip():
        raise ValueError(f"a policy key must be a non-empty string without surrounding spaces: {key!r}")
    if len(key) > MAX_KEY_LENGTH:
        raise ValueError(f"policy key longer than {MAX_KEY_LENGTH} characters")
    if "*" in key[:-1]:
        raise ValueError(f"'*' may only end a pattern, as in 'mailgun:*': {key!r}")
    _refuse_hidden_text(key, "a policy key", ValueError)
    return key


def pattern_matches(pattern: str, key: str) -> bool:
    return is_pattern(pattern) and key.startswith(pattern[:-1])
