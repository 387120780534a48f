"""A spy for tests: wrap a function or method so that each call records something of its
arguments, then runs as before."""

from __future__ import annotations

from typing import Any, Callable


def spy(monkeypatch: Any, owner: Any, name: str, pick: Callable[..., Any]) -> list[Any]:
    """Replace owner.name (a module's function or a class's method) for the test; every call
    appends pick(*args) (a method's args start with self) to the returned list."""
    seen: list[Any] = []
    real = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        seen.append(pick(*args))
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, wrapper)
    return seen
