"""The decode engine's KV caches: dense head-major rows per slot, or pages shared from a pool.

Both hold keys head-major, (.., K, H, positions), and values (.., K, positions, H), so a decode step
attends without transposing (`attend_live` / `attend_blocks` in rl/models/attention.py). Cache
index == token position. Both offer the same operations, so the engine's programs (prefill insert,
decode, extend, export and import of running slots) are written once:

  * `put(slots, k, v)`: prefilled keys/values (N, T, K, H) written at positions 0..T-1 of slots;
  * `rows(slots, length)` / `put_rows(slots, k, v)`: slots' positions 0..length-1 as head-major
    rows (N, K, H, length) and (N, K, length, H), read out or written back;
  * `layer(i)` (a `Layer`: `write` one position per slot, `view` the first positions of every
    slot) and `with_layers` for the decode step.

`HeadMajorKVCache` reserves max_length positions for every slot: (B, K, H, S) and (B, K, S, H) per
layer. `PagedKVCache` keeps a pool of P pages of `page` positions per layer, (P, K, H, page) and
(P, K, page, H), and a block table (B, M): slot b's position p lives at offset p % page of page
table[b, p // page]. A kv-major paged cache (`kv_major`: for a decode attention that reads pools
so, JAX's TPU paged-attention kernel, rl/models/paged_attention.py) lays both pools out
(K, P, page, H) instead; what it holds, and every operation's result, is the same. Table entries
of pages a slot does not hold are P (out of range): writes there are dropped and reads give zeros,
so a free slot's writes never land in another's page. Which pages a slot holds, and which slots
share a page (a group's prompt), is the host's business (sampler/paged.py). A view gathers a
slot's pages into the dense layout: the attention that reads it, and so every token and log-prob,
is bitwise the dense cache's at equal block size.

`windowed(cache, n, block)` gathers every layer's first n blocks once, for the k fused steps of
one generate call (`WindowedKVCache`): each step writes its key and value to the cache and to the
window, and attention reads the window, so the copy of the live positions is made once per call,
not once per step (on XLA:CPU the per-step gather cost as much as the attention reading it). It
reads what a gather would give because within a call no live row writes a page another row
reads: a group's shared pages lie wholly before each sample's first decode position.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

HEAD_MAJOR_K_AXES = ("batch", "kv_heads", "head_dim", "cache_length")
HEAD_MAJOR_V_AXES = ("batch", "kv_heads", "cache_length", "head_dim")
# A page pool's axes: pages replicated (the table's gathers and scatters are global), heads on tp.
PAGED_K_AXES = (None, "kv_heads", "head_dim", None)
PAGED_V_AXES = (None, "kv_heads", None, "head_dim")
KV_MAJOR_AXES = ("kv_heads", None, None, "head_dim")  # a kv-major pool's, keys' and values' alike
TABLE_AXES = ("batch", None)


def _cast(x: jax.Array, like: jax.Array) -> jax.Array:
    return x.astype(like.dtype)


# ------------------------------------------------------------------------------------------ dense


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class HeadMajorLayer:
    """One layer of a dense head-major cache: keys (B, K, H, S), values (B, K, S, H)."""

    k: jax.Array
    v: jax.Array

    def write(self, k_BxKxH: jax.Array, v_BxKxH: jax.Array, pos_B: jax.Array) -> HeadMajorLayer:
        """Every row's key/value at its position (a position past the end is clamped to the
        last, as dynamic_update_slice does)."""

        def one(cache: jax.Array, new: jax.Array, axis: int) -> jax.Array:
            update = lambda c, x, p: jax.lax.dynamic_update_slice_in_dim(
                c, jnp.expand_dims(x, axis).astype(c.dtype), p, axis=axis
            )
            return jax.vmap(update)(cache, new, pos_B)

        return HeadMajorLayer(k=one(self.k, k_BxKxH, 2), v=one(self.v, v_BxKxH, 1))

    def view(self) -> tuple[jax.Array, jax.Array]:
        """The whole cache: keys (B, K, H, S) and values (B, K, S, H), no copy."""
        return self.k, self.v

    def blocks(self, n: int, block: int) -> tuple[jax.Array, jax.Array]:
        """The first `n` blocks of `block` positions, block-major: keys (B, n, K, H, block) and
        values (B, n, K, block, H) (`attend_blocks`' layout; a copy)."""
        b, kv, h, s = self.k.shape
        if n * block > s:
            raise ValueError(f"{n} blocks of {block} exceed the cache's {s} positions.")
        k = self.k[..., : n * block].reshape(b, kv, h, n, block).transpose(0, 3, 1, 2, 4)
        v = self.v[:, :, : n * block].reshape(b, kv, n, block, h).transpose(0, 2, 1, 3, 4)
        return k, v


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class HeadMajorKVCache:
    """The dense decode cache: keys (B, K, H, S) and values (B, K, S, H) per layer.

    Decode attention contracts with (B, K) as leading batch dimensions and never transposes the
    cache (the (B, S, K, H) layout of rl/models/transformer.py's `KVCache` costs two whole-cache
    transposes per layer and step on XLA:CPU); keys put positions last so that a step's scores
    are sums over head_dim rows, vectorised along positions (`attend_live`).
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]

    @property
    def max_length(self) -> int:
        return self.v[0].shape[2]

    def layer(self, i: int) -> HeadMajorLayer:
        return HeadMajorLayer(k=self.k[i], v=self.v[i])

    def with_layers(self, layers: list[HeadMajorLayer]) -> HeadMajorKVCache:
        return HeadMajorKVCache(k=tuple(x.k for x in layers), v=tuple(x.v for x in layers))

    def put(
        self,
        slots_N: jax.Array,
        k_NxTxKxH: tuple[jax.Array, ...],
        v_NxTxKxH: tuple[jax.Array, ...],
    ) -> HeadMajorKVCache:
        """Writes prefilled keys/values (N, T, K, H) per layer at positions 0..T-1 of slots_N
        (slots >= B are padding: dropped)."""
        k = tuple(x.transpose(0, 2, 3, 1) for x in k_NxTxKxH)
        v = tuple(x.transpose(0, 2, 1, 3) for x in v_NxTxKxH)
        return self.put_rows(slots_N, k, v)

    def rows(
        self, slots_N: jax.Array, length: int
    ) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]:
        """Positions 0..length-1 of slots_N (clipped into range): keys (N, K, H, length) and
        values (N, K, length, H) per layer."""
        take = lambda c: jnp.take(c, slots_N, axis=0, mode="clip")
        return (
            tuple(take(c)[..., :length] for c in self.k),
            tuple(take(c)[:, :, :length] for c in self.v),
        )

    def put_rows(
        self,
        slots_N: jax.Array,
        k_NxKxHxL: tuple[jax.Array, ...],
        v_NxKxLxH: tuple[jax.Array, ...],
    ) -> HeadMajorKVCache:
        """Writes head-major rows at positions 0..L-1 of slots_N (out of range: dropped)."""
        t = v_NxKxLxH[0].shape[2]
        return HeadMajorKVCache(
            k=tuple(
                c.at[slots_N, :, :, :t].set(_cast(x, c), mode="drop")
                for c, x in zip(self.k, k_NxKxHxL, strict=True)
            ),
            v=tuple(
                c.at[slots_N, :, :t].set(_cast(x, c), mode="drop")
                for c, x in zip(self.v, v_NxKxLxH, strict=True)
            ),
        )


# ------------------------------------------------------------------------------------------ paged


def _pages_of(table_BxM: jax.Array, slots_N: jax.Array, positions_T: jax.Array) -> jax.Array:
    """(N, T) page of each slot's position (slots out of range: the out-of-range page P; a slot's
    table entry P where it holds no page)."""
    b = table_BxM.shape[0]
    rows = jnp.take(table_BxM, slots_N, axis=0, mode="clip")
    pages = jnp.take(rows, positions_T, axis=1, mode="clip")
    return jnp.where((slots_N < b)[:, None], pages, jnp.iinfo(jnp.int32).max)


def _gather(pool: jax.Array, pages: jax.Array, kv_major: bool, kind: str) -> jax.Array:
    """The pool's `pages` (out-of-range pages read as zeros) page-major: keys ("k") (..., K, H,
    page), values (..., K, page, H), ... = pages.shape."""
    if not kv_major:
        return jnp.take(pool, pages, axis=0, mode="fill", fill_value=0)
    x = jnp.moveaxis(jnp.take(pool, pages, axis=1, mode="fill", fill_value=0), 0, -3)
    return x.swapaxes(-1, -2) if kind == "k" else x


def _put(
    pool: jax.Array, pages: jax.Array, offsets: jax.Array, x: jax.Array, kv_major: bool, kind: str
) -> jax.Array:
    """The pool with x (*index, K, H) written at offsets of pages (broadcast to `index`; pages out
    of range: dropped)."""
    x = _cast(x, pool)
    if kv_major:
        return pool.at[:, pages, offsets].set(jnp.moveaxis(x, -2, 0), mode="drop")
    if kind == "k":
        return pool.at[pages, :, :, offsets].set(x, mode="drop")
    return pool.at[pages, :, offsets].set(x, mode="drop")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PagedLayer:
    """One layer of a paged cache: pools (P, K, H, page) and (P, K, page, H) (kv-major: both
    (K, P, page, H)), the table (B, M)."""

    k: jax.Array
    v: jax.Array
    table: jax.Array
    kv_major: bool = dataclasses.field(default=False, metadata=dict(static=True))

    @property
    def page(self) -> int:
        return self.v.shape[2]

    def write(self, k_BxKxH: jax.Array, v_BxKxH: jax.Array, pos_B: jax.Array) -> PagedLayer:
        """Every row's key/value at its position, in the page its table names (none: dropped)."""
        column = (pos_B // self.page)[:, None]
        pages_B = jnp.take_along_axis(self.table, column, axis=1, mode="clip")[:, 0]
        off_B = pos_B % self.page
        return dataclasses.replace(
            self,
            k=_put(self.k, pages_B, off_B, k_BxKxH, self.kv_major, "k"),
            v=_put(self.v, pages_B, off_B, v_BxKxH, self.kv_major, "v"),
        )

    def view(self) -> tuple[jax.Array, jax.Array]:
        """Every slot's positions (all its table's), gathered from its pages: keys (B, K, H, S),
        values (B, K, S, H), S = the table's width x page."""
        return _rows(self, self.table, self.table.shape[1] * self.page)

    def blocks(self, n: int, block: int) -> tuple[jax.Array, jax.Array]:
        """Every slot's first `n` blocks of `block` positions (a multiple of the page), gathered
        from its pages block-major: keys (B, n, K, H, block), values (B, n, K, block, H)
        (`attend_blocks`' layout; with one page per block the gather is the layout)."""
        per, width = block // self.page, self.table.shape[1]
        if per * self.page != block or n * per > width:
            raise ValueError(
                f"{n} blocks of {block} positions do not fit whole pages of {self.page} in a "
                f"table of {width}."
            )
        pages = self.table[:, : n * per]
        k = _gather(self.k, pages, self.kv_major, "k")  # (B, n * per, K, H, page)
        v = _gather(self.v, pages, self.kv_major, "v")  # (B, n * per, K, page, H)
        if per == 1:
            return k, v
        b, _, kv, h, page = k.shape
        k = k.reshape(b, n, per, kv, h, page).transpose(0, 1, 3, 4, 2, 5)
        v = v.reshape(b, n, per, kv, page, h).transpose(0, 1, 3, 2, 4, 5)
        return k.reshape(b, n, kv, h, block), v.reshape(b, n, kv, block, h)


def _rows(layer: PagedLayer, table_NxM: jax.Array, length: int) -> tuple[jax.Array, jax.Array]:
    """The rows of a table's slots, positions 0..length-1 (length a multiple of the page or at
    most the table's span), gathered from one layer's pools."""
    page = layer.page
    m = -(-length // page)
    pages = _gather(layer.k, table_NxM[:, :m], layer.kv_major, "k")  # (N, m, K, H, page)
    n, _, kh, h, _ = pages.shape
    k = pages.transpose(0, 2, 3, 1, 4).reshape(n, kh, h, m * page)[..., :length]
    pages = _gather(layer.v, table_NxM[:, :m], layer.kv_major, "v")  # (N, m, K, page, H)
    v = pages.transpose(0, 2, 1, 3, 4).reshape(n, kh, m * page, h)[:, :, :length]
    return k, v


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PagedKVCache:
    """The paged decode cache: per layer a pool of pages, keys (P, K, H, page) and values
    (P, K, page, H) (kv-major: both (K, P, page, H)); one block table (B, M) for every layer
    (module docstring)."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    table: jax.Array  # (B, M) int32: page of each slot's positions [j * page, (j + 1) * page)
    kv_major: bool = dataclasses.field(default=False, metadata=dict(static=True))

    @property
    def page(self) -> int:
        return self.v[0].shape[2]

    @property
    def max_length(self) -> int:
        return self.table.shape[1] * self.page

    def layer(self, i: int) -> PagedLayer:
        return PagedLayer(k=self.k[i], v=self.v[i], table=self.table, kv_major=self.kv_major)

    def with_layers(self, layers: list[PagedLayer]) -> PagedKVCache:
        return dataclasses.replace(self, k=tuple(x.k for x in layers), v=tuple(x.v for x in layers))

    def _scatter(self, slots_N: jax.Array, t: int, k_NxTxKxH: Any, v_NxTxKxH: Any) -> PagedKVCache:
        positions = jnp.arange(t)
        pages_NxT = _pages_of(self.table, slots_N, positions // self.page)
        off_T = positions[None] % self.page
        put = lambda kind: lambda c, x: _put(c, pages_NxT, off_T, x, self.kv_major, kind)
        return dataclasses.replace(
            self,
            k=tuple(map(put("k"), self.k, k_NxTxKxH)),
            v=tuple(map(put("v"), self.v, v_NxTxKxH)),
        )

    def put(
        self,
        slots_N: jax.Array,
        k_NxTxKxH: tuple[jax.Array, ...],
        v_NxTxKxH: tuple[jax.Array, ...],
    ) -> PagedKVCache:
        """Writes prefilled keys/values (N, T, K, H) per layer at positions 0..T-1 of slots_N,
        into the pages their table rows name (positions in no page, and slots >= B: dropped)."""
        return self._scatter(slots_N, k_NxTxKxH[0].shape[1], k_NxTxKxH, v_NxTxKxH)

    def rows(
        self, slots_N: jax.Array, length: int
    ) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]:
        """Positions 0..length-1 of slots_N (clipped into range) gathered from their pages: keys
        (N, K, H, length) and values (N, K, length, H) per layer."""
        table = jnp.take(self.table, slots_N, axis=0, mode="clip")
        out = [_rows(self.layer(i), table, length) for i in range(len(self.k))]
        return tuple(k for k, _ in out), tuple(v for _, v in out)

    def put_rows(
        self,
        slots_N: jax.Array,
        k_NxKxHxL: tuple[jax.Array, ...],
        v_NxKxLxH: tuple[jax.Array, ...],
    ) -> PagedKVCache:
        """Writes head-major rows at positions 0..L-1 of slots_N, into their pages."""
        k = tuple(x.transpose(0, 3, 1, 2) for x in k_NxKxHxL)
        v = tuple(x.transpose(0, 2, 1, 3) for x in v_NxKxLxH)
        return self._scatter(slots_N, v_NxKxLxH[0].shape[2], k, v)


# ---------------------------------------------------------------------------------------- window


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class WindowLayer:
    """A cache layer with its first n blocks gathered once (`windowed`): a step writes its key and
    value to both, and attention reads the gathered blocks (`blocks`), not the cache.

    Keys (B, n, K, H, block) and values (B, n, K, block, H): `layer.blocks(n, block)` when the
    window was made, kept equal to it by every `write` since (a write past the window is dropped
    there; the caller's live rows never write past it: sampler/decode.py `live_blocks`).
    """

    layer: HeadMajorLayer | PagedLayer
    k: jax.Array
    v: jax.Array

    def write(self, k_BxKxH: jax.Array, v_BxKxH: jax.Array, pos_B: jax.Array) -> WindowLayer:
        block = self.v.shape[3]
        rows, j, off = jnp.arange(pos_B.shape[0]), pos_B // block, pos_B % block
        return WindowLayer(
            layer=self.layer.write(k_BxKxH, v_BxKxH, pos_B),
            k=self.k.at[rows, j, :, :, off].set(_cast(k_BxKxH, self.k), mode="drop"),
            v=self.v.at[rows, j, :, off].set(_cast(v_BxKxH, self.v), mode="drop"),
        )

    def blocks(self, n: int, block: int) -> tuple[jax.Array, jax.Array]:
        """The gathered blocks (n and block must be the window's)."""
        if (n, block) != (self.k.shape[1], self.v.shape[3]):
            raise ValueError(
                f"A window of {self.k.shape[1]} blocks of {self.v.shape[3]} positions was asked "
                f"for {n} blocks of {block}."
            )
        return self.k, self.v


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class WindowedKVCache:
    """A decode cache with every layer's first n blocks gathered once, for the k fused steps of
    one generate call (sampler/decode.py): the gather (a copy of every live position) is paid
    once per call, not once per step, and `cache` stays written as the steps go."""

    cache: HeadMajorKVCache | PagedKVCache
    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]

    def layer(self, i: int) -> WindowLayer:
        return WindowLayer(layer=self.cache.layer(i), k=self.k[i], v=self.v[i])

    def with_layers(self, layers: list[WindowLayer]) -> WindowedKVCache:
        return WindowedKVCache(
            cache=self.cache.with_layers([x.layer for x in layers]),
            k=tuple(x.k for x in layers),
            v=tuple(x.v for x in layers),
        )


def windowed(cache: HeadMajorKVCache | PagedKVCache, n: int, block: int) -> WindowedKVCache:
    """`cache` with every layer's first `n` blocks of `block` positions gathered (`blocks`)."""
    gathered = [cache.layer(i).blocks(n, block) for i in range(len(cache.k))]
    return WindowedKVCache(
        cache=cache, k=tuple(k for k, _ in gathered), v=tuple(v for _, v in gathered)
    )


KVCacheLike = HeadMajorKVCache | PagedKVCache | WindowedKVCache
