"""Name -> function registries: a config names a variant, a user adds one by importing the library."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

F = TypeVar("F")


class Registry(dict[str, F], Generic[F]):
    """A dict of named functions with a `register` decorator and a `get` that lists the names."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind

    def register(self, name: str) -> Callable[[F], F]:
        """Decorator: registers the function under `name` (which must be new) and returns it."""

        def decorator(fn: F) -> F:
            if name in self:
                raise ValueError(
                    f"{self.kind.capitalize()} {name!r} is already registered ({self[name]!r}); "
                    "expected a new name."
                )
            self[name] = fn
            return fn

        return decorator

    def get(self, name: str, *default: F) -> F:  # type: ignore[override]
        """The function registered under `name`; a ValueError lists the registered names.

        With a default, plain `dict.get` semantics (what code that treats it as a dict expects).
        """
        if default:
            return super().get(name, *default)
        if name not in self:
            raise ValueError(f"Unknown {self.kind} {name!r}; expected one of {sorted(self)}.")
        return self[name]
