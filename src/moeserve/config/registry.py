"""Named implementations of a pluggable part (dispatchers, expert runners, attention
backends, architectures): one registry class for all of them.

    RUNNERS = Registry("expert runner")

    @RUNNERS.register("triton")
    class TritonExperts(Experts): ...

    RUNNERS.get("triton")  # the class; an unknown name is a ValueError listing the known ones

A registry is filled by importing the modules that register into it; the package that
offers a `create_*` factory imports them all, so a registry is complete wherever the factory
can be called.
"""

from __future__ import annotations

from typing import Callable, Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """A decorator that registers what it decorates under `name` and returns it."""
        def register(entry: T) -> T:
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._entries[name] = entry
            return entry
        return register

    def get(self, name: str) -> T:
        if name not in self._entries:
            raise ValueError(f"unknown {self.kind} {name!r}; known: {', '.join(self.names())}")
        return self._entries[name]

    def name_of(self, entry: T) -> str:
        """The name `entry` is registered under."""
        for name, known in self._entries.items():
            if known is entry:
                return name
        raise ValueError(f"{entry!r} is not a registered {self.kind}")

    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self._entries))

    def __contains__(self, name: str) -> bool:
        return name in self._entries
