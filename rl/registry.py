"""Name -> function registries: a config names a variant, a user adds one by importing the library.

Every registry is known by its kind ("reward", "policy loss", ...), so that what a user's script
registered reaches the processes a run starts: the Ray runtime sends `snapshot()` (every entry of
every registry, each pickled on its own: rl.runtime.ray_process.worker_payload) with each worker's
config, and the worker `install`s the entries it lacks before it builds anything. An entry that
cannot be loaded there (a function of a module the worker cannot import) is skipped and named,
with the reason, if the run looks it up.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Generic, TypeVar

F = TypeVar("F")

_BY_KIND: dict[str, Registry[Any]] = {}  # every registry of this process, by kind


class Registry(dict[str, F], Generic[F]):
    """A dict of named functions with a `register` decorator and a `get` that lists the names."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.unloaded: dict[str, str] = {}  # name -> why another process's entry did not load here
        _BY_KIND.setdefault(kind, self)

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
        if name in self.unloaded:
            raise ValueError(
                f"Unknown {self.kind} {name!r} in this worker process: the run's driver registered "
                f"it, but it could not be loaded here ({self.unloaded[name]}); expected it defined "
                "in the script that starts the run or in a module the workers can import."
            )
        if name not in self:
            raise ValueError(f"Unknown {self.kind} {name!r}; expected one of {sorted(self)}.")
        return self[name]


def snapshot() -> dict[str, dict[str, Any]]:
    """Every registry's entries, by kind: what another process of the run `install`s."""
    return {kind: dict(registry) for kind, registry in _BY_KIND.items()}


def install(entries: Mapping[str, Mapping[str, Any]], load: Callable[[Any], Any]) -> None:
    """Adds the entries of another process's `snapshot()` that this process's registries lack,
    each made a function by `load` (its unpickling); one that fails to load is recorded with the
    reason and named if looked up. A name registered here keeps its entry; a kind with no registry
    here is used by nothing here."""
    for kind, named in entries.items():
        registry = _BY_KIND.get(kind)
        if registry is None:
            continue
        for name, packed in named.items():
            if name in registry:
                continue
            try:
                registry[name] = load(packed)
            except Exception as e:  # noqa: BLE001 - any failure to load: recorded, named on use
                registry.unloaded[name] = f"{type(e).__name__}: {e}"
