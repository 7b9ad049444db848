"""LoRA: the adapters, which parameters train, and merging adapters into their base weights.

`config.model.lora.rank > 0` gives every targeted projection of the Transformer
(rl/models/transformer.py, whose Attention and MLP are `Adapted`) an `Adapter`: W x becomes
W x + (alpha / rank) * B A x, with A and B `nnx.LoRAParam`s and B starting at zero, so the
adapted model starts as its base. Then:
  * the learner's TrainState holds only the adapter leaves (`split_trainable`): gradients,
    optimizer state and checkpoints cover the adapters, the base stays as built (a seed's init or
    the hf_path weights, rebuilt the same way on a resume or an export);
  * the sampler decodes base + adapter, and a publish moves only the adapter leaves (the base's
    arrays are the same objects every publish: learner/publish.py moves them once);
  * an export merges each adapter into its weight (`merge_adapters`): a plain Hugging Face
    checkpoint of the tuned model.
Without LoRA every parameter trains and the frozen part is empty.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from rl.models.config import LORA_TARGETS, LoraConfig, ModelConfig
from rl.models.sharding import Rules, tree_shardings


class Adapter(nnx.Module):
    """A LoRA update of one projection weight W, whose first `n_in` dimensions are its inputs:
    x -> scale * (x . a) . b, with a (*in, rank) drawn normal(0, 1/sqrt(fan_in)) and b
    (rank, *out) zeros, both `nnx.LoRAParam` (the learner trains only those)."""

    def __init__(self, weight: nnx.Param, n_in: int, lora: LoraConfig, rngs: nnx.Rngs):
        shape, axes, dtype = weight.shape, weight.logical_axes, weight.dtype
        fan_in = math.prod(shape[:n_in])
        a = jax.random.normal(rngs.params(), (*shape[:n_in], lora.rank), jnp.float32)
        self.a = nnx.LoRAParam(
            (a / np.sqrt(fan_in)).astype(dtype), logical_axes=(*axes[:n_in], "lora_rank")
        )
        self.b = nnx.LoRAParam(
            jnp.zeros((lora.rank, *shape[n_in:]), dtype), logical_axes=("lora_rank", *axes[n_in:])
        )
        self.n_in = n_in
        self.scale = lora.scale

    def __call__(self, x: jax.Array) -> jax.Array:
        h = jnp.tensordot(x, self.a[...].astype(x.dtype), axes=self.n_in)
        return jnp.tensordot(h, self.b[...].astype(x.dtype), axes=1) * jnp.asarray(
            self.scale, x.dtype
        )

    def delta(self) -> jax.Array:
        """scale * a . b in float32: what merging adds to W."""
        a, b = self.a[...].astype(jnp.float32), self.b[...].astype(jnp.float32)
        return jnp.tensordot(a, b, axes=1) * self.scale


class Adapted(nnx.Module):
    """A module whose projections may carry LoRA adapters (`attach`, after its base weights)."""

    PROJECTIONS: dict[str, int] = {}  # weight attribute -> its number of input dimensions
    adapters: nnx.Dict | None = None

    def attach(self, lora: LoraConfig, rngs: nnx.Rngs) -> None:
        targets = [t for t in lora.targets if t in self.PROJECTIONS]
        if targets:
            self.adapters = nnx.Dict(
                {t: Adapter(getattr(self, t), self.PROJECTIONS[t], lora, rngs) for t in targets}
            )

    def adapted(self, name: str, x: jax.Array, y: jax.Array) -> jax.Array:
        """y = x . W_name, plus the adapter's update when `name` has one."""
        if self.adapters is None or name not in self.adapters:
            return y
        return y + self.adapters[name](x)


def lora_config_from(section: Mapping[str, Any] | None) -> LoraConfig | None:
    """config.model.lora (rank 0 or absent: no adapters) as a LoraConfig."""
    if not section or not section.get("rank", 0):
        return None
    targets = section.get("targets", LORA_TARGETS)
    if isinstance(targets, str):
        targets = tuple(t.strip() for t in targets.split(",") if t.strip())
    try:
        return LoraConfig(
            rank=section["rank"], alpha=float(section.get("alpha", 16.0)), targets=tuple(targets)
        )
    except ValueError as e:
        raise ValueError(f"config.model.lora: {e}") from None


def add_adapters(
    model: Any,
    lora: LoraConfig,
    *,
    seed: int = 0,
    mesh: Mesh | None = None,
    rules: Rules | None = None,
) -> Any:
    """`model` (a Transformer without adapters) with fresh adapters: its base arrays kept, the
    adapters drawn from `seed` as the model's constructor draws them after every base weight
    (placed by their logical axes on `mesh`)."""
    if model.config.lora is not None:
        raise ValueError("add_adapters: the model already has LoRA adapters.")
    cfg = dataclasses.replace(model.config, lora=lora)
    graphdef, init = _adapter_initializer(type(model), cfg, mesh, rules)
    return nnx.merge(graphdef, nnx.state(model), init(jax.random.key(seed)))


@functools.lru_cache(maxsize=8)
def _adapter_initializer(
    cls: type, cfg: ModelConfig, mesh: Mesh | None, rules: Rules | None
) -> Any:
    """(graphdef, jitted key -> adapter State) for a `cls(cfg)` model: the init computes only the
    adapters (the base weights it would draw are dead code)."""
    graphdef, abstract = nnx.split(_abstract(cls, cfg))
    adapters = nnx.filter_state(abstract, nnx.LoRAParam)

    def init(key: jax.Array) -> Any:
        return nnx.filter_state(nnx.state(cls(cfg, rngs=nnx.Rngs(key))), nnx.LoRAParam)

    out = {} if mesh is None else dict(out_shardings=tree_shardings(adapters, mesh, rules))
    return graphdef, jax.jit(init, **out)


def has_adapters(state: Any) -> bool:
    """Whether an nnx State (or a model's) holds LoRA adapter leaves."""
    return bool(jax.tree.leaves(nnx.filter_state(state, nnx.LoRAParam)))


def split_trainable(params: Any) -> tuple[Any, Any]:
    """(trainable, frozen) halves of a model's parameter State: the adapters and the rest when it
    has adapters, else everything and an empty State. `nnx.merge(graphdef, trainable, frozen)`
    rebuilds the model."""
    if has_adapters(params):
        return nnx.split_state(params, nnx.LoRAParam, ...)
    return params, nnx.State({})


def merge_adapters(model: Any) -> Any:
    """The model with every adapter folded into its weight (W + scale * A B, in the weight's
    dtype) and no adapters: the tuned model as a plain Transformer. A model without adapters is
    returned as is."""
    cfg = model.config
    if cfg.lora is None:
        return model
    flat = dict(nnx.to_flat_state(nnx.state(model)))
    graphdef, abstract = nnx.split(_abstract(type(model), dataclasses.replace(cfg, lora=None)))
    out = []
    for path, var in nnx.to_flat_state(abstract):
        value = flat[path].get_value()
        module = _module_at(model, path[:-1])
        adapters = getattr(module, "adapters", None)
        if adapters is not None and path[-1] in adapters:
            delta = adapters[path[-1]].delta()
            value = (value.astype(jnp.float32) + delta).astype(value.dtype)
        out.append((path, var.replace(value)))
    return nnx.merge(graphdef, nnx.from_flat_state(out))


def _abstract(cls: type, cfg: ModelConfig) -> Any:
    """A `cls(cfg)` model with ShapeDtypeStruct leaves (no memory)."""
    return nnx.eval_shape(lambda: cls(cfg, rngs=nnx.Rngs(0)))


def _module_at(model: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        model = model[key] if isinstance(key, int) else getattr(model, key)
    return model
