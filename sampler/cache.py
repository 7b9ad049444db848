"""The decode state: every slot's KV cache and sampling state, their layout, size and placement.

Layout (issue 19): the cache is head-major, keys (.., kv heads, head dim, positions) and values
(.., kv heads, positions, head dim) per layer, so a decode step attends without transposing it
(rl/models/kv_cache.py). Cache index == token position. Dense (`page_size` 0): a row of `length`
positions per slot, (slots, K, H, length); paged: a pool of `pages` pages of `page` positions,
(pages, K, H, page) (kv-major, for JAX's TPU paged-attention kernel: (K, pages, page, H)), and a
block table (slots, length / page) naming each slot's pages (which pages a slot holds is
sampler/paged.py's).

Memory: 2 * n_layers * n_kv_heads * head_dim * itemsize bytes per position (`bytes_per_token`):
dense, `length` positions per slot (max_length rounded up to whole attention blocks, if any);
paged, `page` positions per page of the pool. Slots are sharded over `data`, kv heads over `tp`
(a page pool is replicated over `data`: a paged replica wants a mesh without a data axis, and
`check_memory` warns when it has one; the GPU recipes run one replica per GPU).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from absl import logging
from jax.sharding import Mesh, NamedSharding

from rl.models.config import DTYPES, ModelConfig
from rl.models.kv_cache import (
    HEAD_MAJOR_K_AXES,
    HEAD_MAJOR_V_AXES,
    KV_MAJOR_AXES,
    PAGED_K_AXES,
    PAGED_V_AXES,
    TABLE_AXES,
    HeadMajorKVCache,
    KVCacheLike,
    PagedKVCache,
)
from rl.models.paged_attention import KV_MAJOR_KERNELS
from rl.models.sharding import Rules, logical_to_spec
from sampler.config import EngineConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecodeState:
    """Everything the device needs per slot. B = max_slots."""

    cache: KVCacheLike
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
    """The shapes of one engine's decode state: `slots` rows of `length` cache positions, dense or
    in `pages` pages of `page` positions (page 0: dense)."""

    slots: int
    length: int  # positions per slot: max_length rounded up to whole attention blocks or pages
    n_layers: int
    n_kv_heads: int
    head_dim: int
    dtype: Any  # the cache's jnp dtype
    max_stop_tokens: int
    page: int = 0
    pages: int = 0
    kv_major: bool = False  # paged pools laid out (K, P, page, H), as the attention kernel reads

    @classmethod
    def of(cls, config: EngineConfig, model: ModelConfig) -> CacheLayout:
        block = config.decode_block
        length = -(-config.max_length // block) * block if block else config.max_length
        return cls(
            slots=config.max_slots,
            length=length,
            n_layers=model.n_layers,
            n_kv_heads=model.n_kv_heads,
            head_dim=model.head_dim,
            dtype=DTYPES[config.cache_dtype or model.dtype],
            max_stop_tokens=config.max_stop_tokens,
            page=config.page_size,
            pages=config.pool_pages if config.page_size else 0,
            kv_major=bool(config.page_size) and config.attention_kernel in KV_MAJOR_KERNELS,
        )

    def axes(self, kind: str) -> tuple[str | None, ...]:
        """Logical axes of a key ("k") or value ("v") cache array (a pool's, when paged)."""
        if self.page and self.kv_major:
            return KV_MAJOR_AXES
        if self.page:
            return PAGED_K_AXES if kind == "k" else PAGED_V_AXES
        return HEAD_MAJOR_K_AXES if kind == "k" else HEAD_MAJOR_V_AXES

    def shape(self, kind: str) -> tuple[int, ...]:
        """A key ("k") or value ("v") cache array's shape (a pool's, when paged)."""
        heads = (self.n_kv_heads, self.head_dim)
        if self.page and self.kv_major:
            return (self.n_kv_heads, self.pages, self.page, self.head_dim)
        if self.page:
            kv = (*heads, self.page) if kind == "k" else (self.n_kv_heads, self.page, self.head_dim)
            return (self.pages, *kv)
        if kind == "k":
            return (self.slots, *heads, self.length)
        return (self.slots, self.n_kv_heads, self.length, self.head_dim)

    @property
    def bytes_per_token(self) -> int:
        """KV bytes of one position over every layer."""
        itemsize = jnp.dtype(self.dtype).itemsize
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * itemsize

    @property
    def bytes_per_slot(self) -> int:
        """KV bytes a dense slot reserves (a paged slot: those of a max_length sequence)."""
        return self.length * self.bytes_per_token

    @property
    def bytes(self) -> int:
        """KV bytes of the whole cache (dense rows or the page pool)."""
        positions = self.pages * self.page if self.page else self.slots * self.length
        return positions * self.bytes_per_token

    def init(self) -> DecodeState:
        """An empty decode state: every slot free (and, paged, holding no page)."""
        b = self.slots
        zeros = lambda kind: jnp.zeros(self.shape(kind), self.dtype)
        k = tuple(zeros("k") for _ in range(self.n_layers))
        v = tuple(zeros("v") for _ in range(self.n_layers))
        if self.page:
            table = jnp.full((b, self.length // self.page), self.pages, jnp.int32)
            cache = PagedKVCache(k=k, v=v, table=table, kv_major=self.kv_major)
        else:
            cache = HeadMajorKVCache(k=k, v=v)
        return DecodeState(
            cache=cache,
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

        k = tuple(named(x, self.axes("k")) for x in abstract.cache.k)
        v = tuple(named(x, self.axes("v")) for x in abstract.cache.v)
        if self.page:
            table = named(abstract.cache.table, TABLE_AXES)
            cache = PagedKVCache(k=k, v=v, table=table, kv_major=self.kv_major)
        else:
            cache = HeadMajorKVCache(k=k, v=v)
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
    """Raises, with the sizes, if the parameters and the KV cache do not fit a device; warns when
    a page pool is held whole by every data shard of the mesh."""
    data = 1 if mesh is None else mesh.shape.get("data", 1)
    if layout.page and data > 1:
        logging.warning(
            "A paged KV cache on a sampler replica of data=%d: each of its %d data shards holds "
            "the whole page pool (%.2f GiB, replicated, not split); %d replicas of data=1 "
            "(mesh.sampler_replicas) would hold %dx the sequences in the same memory.",
            data,
            data,
            layout.bytes / 2**30 / layout.shards(mesh, rules),
            data,
            data,
        )
    devices = mesh.devices.flatten() if mesh is not None else jax.devices()[:1]
    stats = devices[0].memory_stats() or {}
    limit = config.memory_budget_bytes or stats.get("bytes_limit")
    if not limit:
        return  # the CPU backend reports no limit
    shards = 1 if mesh is None else layout.shards(mesh, rules)
    need = layout.bytes // shards
    param_bytes = model.num_params() * jnp.dtype(model.jnp_param_dtype).itemsize
    free = limit - stats.get("bytes_in_use", 0) - param_bytes // len(devices)
    if need > free:
        size = (
            f"{layout.pages} pages of {layout.page} positions"
            if layout.page
            else f"{config.max_slots} slots x max_length {config.max_length}"
        )
        raise ValueError(
            f"KV cache does not fit: {size} need {need / 2**30:.2f} GiB per device "
            f"({layout.bytes_per_token / 2**10:.1f} KiB per position before sharding), but about "
            f"{free / 2**30:.2f} GiB is free after the parameters. Lower "
            f"{'kv_pages' if layout.page else 'max_slots or max_length'}."
        )


def free(state: DecodeState, mask_B: jax.Array) -> DecodeState:
    """`state` with the slots of `mask_B` (B,) deactivated (they may be inserted into at once):
    one program for any set of slots."""
    return dataclasses.replace(state, active=state.active & ~mask_B)
