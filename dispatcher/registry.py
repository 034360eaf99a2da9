"""Handlers: the functions that perform calls, registered by method name."""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from dispatcher.exceptions import InvalidParams, UnknownMethod

Validator = Callable[[dict[str, Any]], Any]


@dataclass(frozen=True)
class Handler:
    """A registered handler and what send() needs to know about its calls."""

    name: str
    fn: Callable[..., Any]
    keys: tuple[str, ...] = ()
    validator: Validator | None = None
    queue: str | None = None
    max_attempts: int | None = None
    meta: Mapping[str, Any] = field(default_factory=dict)
    # Computes a call's cost from its params when send() names none: an int or {key: units}.
    cost: Callable[[dict[str, Any]], Any] | None = None

    def validate(self, params: dict[str, Any]) -> None:
        """Run the handler's validator; any error it raises becomes InvalidParams."""
        if self.validator is None:
            return
        try:
            result = self.validator(params)
        except InvalidParams:
            raise
        except (ValueError, TypeError, KeyError) as exc:
            raise InvalidParams(f"{self.name}: {exc}") from exc
        except Exception as exc:  # a validator's own bug must not store a call either
            raise InvalidParams(f"{self.name}: params rejected ({type(exc).__name__}: {exc})") from exc
        if result is False:
            raise InvalidParams(f"{self.name}: params rejected by the handler's validator")


_registry: dict[str, Handler] = {}


def handler(
    name: str,
    *,
    keys: list[str] | tuple[str, ...] | None = None,
    validator: Validator | None = None,
    queue: str | None = None,
    max_attempts: int | None = None,
    cost: Callable[[dict[str, Any]], Any] | None = None,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register the decorated function as the handler of ``name``, called as ``fn(**params)``."""
    if not isinstance(name, str) or not name:
        raise ValueError("a handler needs a non-empty name")
    if isinstance(keys, str):
        raise ValueError("keys must be a list of key templates, not a single string")
    if cost is not None and not callable(cost):
        raise ValueError("cost must be a callable taking the params and returning units")

    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        existing = _registry.get(name)
        if existing is not None and existing.fn is not fn and _qualname(existing.fn) != _qualname(fn):
            raise ValueError(f"handler {name!r} is already registered by {_qualname(existing.fn)}")
        _registry[name] = Handler(
            name=name,
            fn=fn,
            keys=tuple(keys or ()),
            validator=validator,
            queue=queue,
            max_attempts=max_attempts,
            cost=cost,
        )
        return fn

    return register


def _qualname(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def get_handler(name: Any) -> Handler:
    """Return the handler registered as ``name`` or raise UnknownMethod."""
    if not isinstance(name, str) or name not in _registry:
        known = ", ".join(sorted(_registry)) or "none"
        raise UnknownMethod(f"unknown method {name!r}; registered handlers: {known}")
    return _registry[name]
