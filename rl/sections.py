"""Typed configs from a run config's sections: the one way every typed config is built.

A run's config is an ml_collections ConfigDict of sections (`sampling`, `engine`, `driver`,
`learner`, `elastic`, `ray`, `data`, ...); each part of the run reads its own frozen dataclass.
The check (rl.config_check), the builders (rl.runtime.compose), the runtimes and the Ray workers
all build them with `from_section`, so a field the code does not know is named the same way
wherever it is met:

    engine = from_section(EngineConfig, config.engine, name="engine", seed=config.seed)
    driver = from_section(DriverConfig, config.driver, name="driver", sampling=sampling)
    migration = from_section(MigrationConfig, config.elastic, name="elastic", shared=True,
                             rename={"migration": "policy"})

`derived` keyword arguments supply what comes from elsewhere (the engine's seed, the sampler's stop
token); a section that sets one of them is an error. A field whose type is a dataclass and whose value in the section
is a mapping (`driver.tail`) is built from it the same way, its unknown fields named as
`config.driver.tail`. `shared=True` reads only this dataclass's fields from a section that several
typed configs share (`config.elastic` holds migration's and borrowing's). `rename` maps a
section's key to the dataclass field it fills, where the two names differ.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

T = TypeVar("T")


def from_section(
    cls: type[T],
    section: Mapping[str, Any] | None,
    *,
    name: str,
    shared: bool = False,
    rename: Mapping[str, str] | None = None,
    **derived: Any,
) -> T:
    """`cls` (a dataclass) from `config.<name>` (a ConfigDict, a mapping or None) and `derived`.

    Raises ValueError naming unknown fields and the ones expected; the dataclass's own checks
    (`__post_init__`) raise as they do.
    """
    if section is not None and not _is_section(section):
        raise ValueError(f"config.{name}={section!r}; expected a section of fields (a mapping).")
    rename = dict(rename or {})
    values = {rename.get(k, k): v for k, v in dict(section or {}).items()}
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    if shared:
        values = {k: v for k, v in values.items() if k in fields}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        inverse = {v: k for k, v in rename.items()}
        expected = sorted(inverse.get(f, f) for f in fields if f not in derived)
        raise ValueError(
            f"config.{name} has unknown fields {unknown}; expected some of {expected}."
        )
    clash = sorted(set(values) & set(derived))
    if clash:
        raise ValueError(
            f"config.{name} sets {clash}, which the run derives from elsewhere; expected them "
            "left out."
        )
    hints = typing.get_type_hints(cls)
    for key, value in values.items():
        kind = hints.get(key)
        if _is_section(value) and isinstance(kind, type) and dataclasses.is_dataclass(kind):
            values[key] = from_section(kind, value, name=f"{name}.{key}")
    values.update(derived)
    return cls(**values)


def _is_section(value: Any) -> bool:
    """A mapping, or an ml_collections ConfigDict (which is not registered as one)."""
    return isinstance(value, Mapping) or (hasattr(value, "keys") and hasattr(value, "to_dict"))
