"""Logical axis names -> mesh axes.

Every parameter and main activation carries logical axis names ("embed", "q_heads", "batch", ...).
A rules table maps each logical name to mesh axes. One table serves both meshes: mesh axes that a
mesh does not have are dropped (the learner mesh has `fsdp, tp`, the sampler mesh `data, tp`), and a
mesh axis already used by an earlier dimension of the same array is skipped (so `batch` takes `fsdp`
on activations and `embed` then stays unsharded there). A dimension whose size does not divide by
its mesh axes stays replicated (e.g. a 259-token byte vocabulary on `tp=2`).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

Rules = tuple[tuple[str, Any], ...]

DEFAULT_RULES: Rules = (
    ("batch", ("data", "fsdp")),  # activations and KV-cache slots
    ("length", None),
    ("embed", "fsdp"),  # parameters: FSDP shards the model dimension
    ("vocab", "tp"),
    ("q_heads", "tp"),
    ("kv_heads", "tp"),
    ("head_dim", None),
    ("mlp", "tp"),
    ("norm", None),
    ("cache_length", None),
    ("lora_rank", None),  # LoRA adapters' inner dimension
)

_RULES: contextvars.ContextVar[Rules] = contextvars.ContextVar(
    "rolloutpipe_rules", default=DEFAULT_RULES
)


@contextlib.contextmanager
def axis_rules(rules: Rules | Sequence[Sequence[Any]]) -> Iterator[None]:
    """Uses `rules` for activation sharding constraints inside the block."""
    token = _RULES.set(normalize_rules(rules))
    try:
        yield
    finally:
        _RULES.reset(token)


def current_rules() -> Rules:
    return _RULES.get()


def normalize_rules(rules: Sequence[Sequence[Any]]) -> Rules:
    """Validates a rules table (e.g. from a ConfigDict) and returns it as nested tuples."""
    out = []
    for i, rule in enumerate(rules):
        if len(rule) != 2 or not isinstance(rule[0], str):
            raise ValueError(
                f"Sharding rule #{i} is {rule!r}; expected (logical_name, mesh_axes) where mesh_axes "
                "is None, a mesh axis name, or a tuple of them."
            )
        axes = rule[1]
        if axes is not None and not isinstance(axes, str):
            axes = tuple(axes)
        out.append((rule[0], axes))
    return tuple(out)


def logical_to_spec(
    names: Sequence[str | None],
    mesh: Mesh | jax.sharding.AbstractMesh,
    rules: Rules | None = None,
    shape: Sequence[int] | None = None,
) -> PartitionSpec:
    """PartitionSpec for an array with logical axis `names` on `mesh` under `rules`."""
    table = dict(current_rules() if rules is None else rules)
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
    used: set[str] = set()
    spec: list[Any] = []
    for dim, name in enumerate(names):
        axes = table.get(name) if name is not None else None
        axes = (axes,) if isinstance(axes, str) else (axes or ())
        axes = tuple(a for a in axes if a in sizes and a not in used)
        size = 1
        for a in axes:
            size *= sizes[a]
        if shape is not None and shape[dim] % size:
            axes = ()
        used.update(axes)
        spec.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return PartitionSpec(*spec)


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """Sharding constraint by logical names; a no-op outside a `jax.set_mesh` context."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    return jax.lax.with_sharding_constraint(x, logical_to_spec(names, mesh, shape=x.shape))


def tree_shardings(abstract_state: Any, mesh: Mesh, rules: Rules | None = None) -> Any:
    """NamedShardings for an nnx State whose Variables carry `logical_axes` metadata."""
    from flax import nnx

    def one(var: Any) -> Any:
        names = var.get_metadata().get("logical_axes")
        if names is None:
            names = (None,) * len(var.get_value().shape)
        return var.replace(
            NamedSharding(mesh, logical_to_spec(names, mesh, rules, shape=var.get_value().shape))
        )

    return jax.tree.map(one, abstract_state, is_leaf=lambda v: isinstance(v, nnx.Variable))
