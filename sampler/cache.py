"""The decode state: every slot's KV cache rows and sampling state, their layout, size and placement.

Layout (issue 19): the cache is head-major, keys (slots, kv heads, head dim, positions) and values
(slots, kv heads, positions, head dim) per layer, so a decode step attends without transposing it
(rl/models/transformer.py's HeadMajorKVCache). Cache index == token position.

Memory: the KV cache takes 2 * n_layers * length * n_kv_heads * head_dim * itemsize bytes per slot
(`CacheLayout.bytes_per_slot`; length is max_length rounded up to whole attention blocks, if any),
sharded over `data` (slots) and `tp` (kv heads).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from rl.models.config import DTYPES, ModelConfig
from rl.models.sharding import Rules, logical_to_spec
from rl.models.transformer import HEAD_MAJOR_K_AXES, HEAD_MAJOR_V_AXES, HeadMajorKVCache
from sampler.config import EngineConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecodeState:
    """Everything the device needs per slot. B = max_slots."""

    cache: HeadMajorKVCache
    tokens: jax.Array  # (B,) int32: the token to feed next
    positions: jax.Array  # (B,) int32: its position
    active: jax.Array  # (B,) bool: slot holds an unfinished sequence
    last_position: jax.Array  # (B,) int32: position of the final allowed response token
    keys: jax.Array  # (B,) PRNG keys of the slot's request and sample
    temperature: jax.Array  # (B,) float32
    top_k: jax.Array  # (B,) int32
    top_p: jax.Array  # (B,) float32
    stop_ids: jax.Array  # (B, max_stop_tokens) int32, -1 padded


# The per-slot fields of DecodeState besides the cache.
PER_SLOT = (
    "tokens",
    "positions",
    "active",
    "last_position",
    "keys",
    "temperature",
    "top_k",
    "top_p",
    "stop_ids",
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CacheLayout:
    """The shapes of one engine's decode state: `slots` rows of `length` cache positions."""

    slots: int
    length: int  # positions per slot: max_length rounded up to whole attention blocks
    n_layers: int
    n_kv_heads: int
    head_dim: int
    dtype: Any  # the cache's jnp dtype
    max_stop_tokens: int

    @classmethod
    def of(cls, config: EngineConfig, model: ModelConfig) -> CacheLayout:
        block = config.attention_block
        length = -(-config.max_length // block) * block if block else config.max_length
        return cls(
            slots=config.max_slots,
            length=length,
            n_layers=model.n_layers,
            n_kv_heads=model.n_kv_heads,
            head_dim=model.head_dim,
            dtype=DTYPES[config.cache_dtype or model.dtype],
            max_stop_tokens=config.max_stop_tokens,
        )

    @staticmethod
    def axes(kind: str) -> tuple[str, ...]:
        """Logical axes of a key ("k") or value ("v") cache array."""
        return HEAD_MAJOR_K_AXES if kind == "k" else HEAD_MAJOR_V_AXES

    @staticmethod
    def position_axis(kind: str) -> int:
        """The axis of a key ("k") or value ("v") cache array that indexes positions."""
        return CacheLayout.axes(kind).index("cache_length")

    def shape(self, kind: str) -> tuple[int, ...]:
        sizes = dict(
            batch=self.slots,
            cache_length=self.length,
            kv_heads=self.n_kv_heads,
            head_dim=self.head_dim,
        )
        return tuple(sizes[a] for a in self.axes(kind))

    @property
    def bytes_per_slot(self) -> int:
        itemsize = jnp.dtype(self.dtype).itemsize
        return 2 * self.n_layers * self.length * self.n_kv_heads * self.head_dim * itemsize

    def init(self) -> DecodeState:
        """An empty decode state: every slot free."""
        b = self.slots
        zeros = lambda kind: jnp.zeros(self.shape(kind), self.dtype)
        return DecodeState(
            cache=HeadMajorKVCache(
                k=tuple(zeros("k") for _ in range(self.n_layers)),
                v=tuple(zeros("v") for _ in range(self.n_layers)),
            ),
            tokens=jnp.zeros((b,), jnp.int32),
            positions=jnp.zeros((b,), jnp.int32),
            active=jnp.zeros((b,), bool),
            last_position=jnp.zeros((b,), jnp.int32),
            keys=jax.random.split(jax.random.key(0), b),
            temperature=jnp.ones((b,), jnp.float32),
            top_k=jnp.zeros((b,), jnp.int32),
            top_p=jnp.ones((b,), jnp.float32),
            stop_ids=jnp.full((b, self.max_stop_tokens), -1, jnp.int32),
        )

    def shardings(self, mesh: Mesh, rules: Rules) -> DecodeState:
        """Where each array of the decode state lives on `mesh`: slots over `data`, heads `tp`."""
        abstract = jax.eval_shape(self.init)

        def named(x: Any, names: tuple[str | None, ...]) -> NamedSharding:
            return NamedSharding(mesh, logical_to_spec(names, mesh, rules, shape=x.shape))

        cache = HeadMajorKVCache(
            k=tuple(named(x, self.axes("k")) for x in abstract.cache.k),
            v=tuple(named(x, self.axes("v")) for x in abstract.cache.v),
        )
        per_slot = {
            name: named(
                getattr(abstract, name),
                ("batch",) + (None,) * (getattr(abstract, name).ndim - 1),
            )
            for name in PER_SLOT
        }
        return DecodeState(cache=cache, **per_slot)

    def shards(self, mesh: Mesh, rules: Rules) -> int:
        """How many pieces the cache is split into on `mesh`."""
        n = 1
        for axes in logical_to_spec(self.axes("v"), mesh, rules, shape=self.shape("v")):
            for a in (axes,) if isinstance(axes, str) else (axes or ()):
                n *= mesh.shape[a]
        return n


def check_memory(
    layout: CacheLayout,
    config: EngineConfig,
    model: ModelConfig,
    mesh: Mesh | None,
    rules: Rules,
) -> None:
    """Raises, with the sizes, if the parameters and the KV cache do not fit a device."""
    devices = mesh.devices.flatten() if mesh is not None else jax.devices()[:1]
    stats = devices[0].memory_stats() or {}
    limit = config.memory_budget_bytes or stats.get("bytes_limit")
    if not limit:
        return  # the CPU backend reports no limit
    shards = 1 if mesh is None else layout.shards(mesh, rules)
    need = config.max_slots * layout.bytes_per_slot // shards
    param_bytes = model.num_params() * jnp.dtype(model.jnp_param_dtype).itemsize
    free = limit - stats.get("bytes_in_use", 0) - param_bytes // len(devices)
    if need > free:
        raise ValueError(
            f"KV cache does not fit: {config.max_slots} slots x max_length "
            f"{config.max_length} need {need / 2**30:.2f} GiB per device "
            f"({layout.bytes_per_slot / 2**20:.1f} MiB per slot before sharding), but about "
            f"{free / 2**30:.2f} GiB is free after the parameters. Lower max_slots or max_length."
        )


def free(state: DecodeState, mask_B: jax.Array) -> DecodeState:
    """`state` with the slots of `mask_B` (B,) deactivated (they may be inserted into at once):
    one program for any set of slots."""
    return dataclasses.replace(state, active=state.active & ~mask_B)
