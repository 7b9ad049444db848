"""Decode attention over a KV cache layer: the seam where a kernel plugs in.

`DECODE_ATTENTION` names the implementations of one decode step's attention (a query per row
against a layer of the decode cache, rl/models/kv_cache.py); `EngineConfig.attention_kernel`
(config.engine.attention_kernel) picks one, and a user adds one by registering it:

  * "xla" (the default): the pure-JAX path that runs everywhere. It gathers a slot's live blocks
    (`layer.blocks`) and attends over them with `attend_blocks`, or over the whole cache with
    `attend_live` (rl/models/attention.py); a dense or a paged layer.
  * "pallas": `paged_attention`, a Pallas kernel (the generic `pl.pallas_call` API) that reads
    the pool pages a slot's block table names in place, with no gathered copy; paged layers only.
    On CPU it runs in Pallas interpret mode (chosen by the platform the program is compiled for;
    a test and reference vehicle, slower than "xla"); on GPU it is written for the Triton
    lowering, but has not been compiled or timed on a GPU yet. It equals "xla" to float32
    rounding (an online softmax sums in another order), not bitwise.
  * "pallas_tpu": `jax.experimental.pallas.ops.tpu.paged_attention`, JAX's own TPU kernel, over
    the pools in place: it wants both as (K, P, page, H), so an engine with this kernel lays its
    pools out kv-major (kv_cache.py; `KV_MAJOR_KERNELS` names the kernels that read so); paged
    layers only. Off a TPU it runs in Pallas's TPU interpret mode (a test vehicle: it rounds its
    matmuls' inputs to bfloat16 as a TPU's default precision does, so it equals "xla" to about
    1e-2, not 1e-5). It has not been compiled or timed on a TPU here (none was lent).
"""

from __future__ import annotations

import functools
from typing import Protocol

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention as tpu_paged_attention

from rl.models.attention import MASKED, attend_blocks, attend_live
from rl.models.kv_cache import HeadMajorLayer, PagedLayer
from rl.registry import Registry


class DecodeAttention(Protocol):
    def __call__(
        self,
        q_BxNxH: jax.Array,
        layer: HeadMajorLayer | PagedLayer,
        positions_B: jax.Array,
        *,
        blocks: int,
        block: int,
    ) -> jax.Array:
        """Row b's queries (N heads) against its cache positions <= positions_B[b], reading the
        first `blocks` blocks of `block` positions (0: the whole cache); returns (B, N, H)."""


DECODE_ATTENTION: Registry[DecodeAttention] = Registry("decode attention")
# The kernels that read kv-major pools (an engine with one lays its pools out so: sampler/cache.py);
# a user who registers another such kernel adds its name.
KV_MAJOR_KERNELS: set[str] = {"pallas_tpu"}
# The kernels that read a layer through `layer.blocks(n, block)`: a generate call gathers those
# blocks once for its fused steps (sampler/decode.py), not once per step.
GATHERING_KERNELS: set[str] = {"xla"}


@DECODE_ATTENTION.register("xla")
def xla_attention(
    q_BxNxH: jax.Array,
    layer: HeadMajorLayer | PagedLayer,
    positions_B: jax.Array,
    *,
    blocks: int,
    block: int,
) -> jax.Array:
    """The gathered blocks through `attend_blocks`, or the whole cache through `attend_live`."""
    if blocks:
        return attend_blocks(q_BxNxH, *layer.blocks(blocks, block), positions_B)
    return attend_live(q_BxNxH, *layer.view(), positions_B)


def _paged_layer(name: str, layer: HeadMajorLayer | PagedLayer) -> PagedLayer:
    if not isinstance(layer, PagedLayer):
        raise ValueError(
            f"Decode attention {name!r} reads a paged cache; received a {type(layer).__name__} "
            "(a dense cache: page_size 0). Expected page_size > 0 or attention_kernel 'xla'."
        )
    if layer.kv_major != (name in KV_MAJOR_KERNELS):
        want = "kv-major" if name in KV_MAJOR_KERNELS else "page-major"
        raise ValueError(
            f"Decode attention {name!r} reads {want} pools; received a layer with kv_major="
            f"{layer.kv_major} (rl/models/kv_cache.py). Expected the engine's own cache (it lays "
            "its pools out for its attention_kernel)."
        )
    return layer


def _pages_read(layer: PagedLayer, blocks: int, block: int) -> int:
    """Table columns the first `blocks` blocks of `block` positions span (0 blocks: all)."""
    return blocks * block // layer.page if blocks else layer.table.shape[1]


@DECODE_ATTENTION.register("pallas")
def pallas_attention(
    q_BxNxH: jax.Array,
    layer: HeadMajorLayer | PagedLayer,
    positions_B: jax.Array,
    *,
    blocks: int,
    block: int,
) -> jax.Array:
    """`paged_attention` over the first `blocks * block` positions' pages (0: the table's)."""
    layer = _paged_layer("pallas", layer)
    pages = _pages_read(layer, blocks, block)
    return paged_attention(q_BxNxH, layer.k, layer.v, layer.table, positions_B, pages=pages)


@DECODE_ATTENTION.register("pallas_tpu")
def pallas_tpu_attention(
    q_BxNxH: jax.Array,
    layer: HeadMajorLayer | PagedLayer,
    positions_B: jax.Array,
    *,
    blocks: int,
    block: int,
) -> jax.Array:
    """JAX's TPU paged-attention kernel over the first `blocks * block` positions' pages (0: the
    table's), `pages_per_compute_block` = the attention block's pages (0: up to 8).

    The kernel takes unscaled scores and every table entry in [0, P): queries are scaled here,
    and entries of pages a slot does not hold point at page 0, which the kernel reads only for a
    row whose position reaches them: a free slot (its output is never used), never a live one.
    """
    layer = _paged_layer("pallas_tpu", layer)
    pages = _pages_read(layer, blocks, block)
    pool = layer.k.shape[1]
    table = layer.table[:, :pages]
    table = jnp.where((table >= 0) & (table < pool), table, 0)
    lengths = jnp.clip(positions_B + 1, 1, pages * layer.page).astype(jnp.int32)
    step = block // layer.page if blocks else 8
    per_block = max(d for d in range(1, min(step, pages) + 1) if pages % d == 0)
    q = q_BxNxH * jnp.asarray(q_BxNxH.shape[-1] ** -0.5, q_BxNxH.dtype)
    call = functools.partial(tpu_paged_attention, pages_per_compute_block=per_block)

    def interpreted(*args: jax.Array) -> jax.Array:
        with pltpu.force_tpu_interpret_mode():
            return call(*args)

    # the kernel on a TPU, interpreted on whatever else the program is compiled for
    return jax.lax.platform_dependent(
        q, layer.k, layer.v, lengths, table, tpu=call, default=interpreted
    )


def _kernel(pos_ref, table_ref, q_ref, k_ref, v_ref, o_ref, *, pages: int, pool: int):
    """One (row, kv head): its G query heads against the pages its table names, page by page.

    Refs: pos (1,), table (pages,), q and o (G, H), k (P, H, C), v (P, C, H). Pages past the row's
    position are not read; a table entry outside [0, P) reads as zeros (kv_cache.py's rule).
    """
    g, h = q_ref.shape
    c = k_ref.shape[-1]
    q_GxHx1 = q_ref[...].astype(jnp.float32)[:, :, None]
    pos = pos_ref[0]
    live = jnp.minimum(jnp.maximum(pos // c + 1, 1), pages)

    def page(j, carry):
        m_G, l_G, acc_GxH = carry
        p = table_ref[j]
        held = (p >= 0) & (p < pool)
        p = jnp.minimum(jnp.maximum(p, 0), pool - 1)
        k_HxC = jnp.where(held, k_ref[p].astype(jnp.float32), 0.0)
        v_CxH = jnp.where(held, v_ref[p].astype(jnp.float32), 0.0)
        s_GxC = jnp.sum(q_GxHx1 * k_HxC[None], axis=1) * h**-0.5
        at_1xC = j * c + jax.lax.broadcasted_iota(jnp.int32, (1, c), 1)
        s_GxC = jnp.where(at_1xC <= pos, s_GxC, MASKED)
        m_new = jnp.maximum(m_G, jnp.max(s_GxC, axis=1))
        scale_G = jnp.exp(m_G - m_new)
        p_GxC = jnp.exp(s_GxC - m_new[:, None])
        l_G = l_G * scale_G + jnp.sum(p_GxC, axis=1)
        o_GxH = jnp.sum(p_GxC[:, :, None] * v_CxH[None], axis=1)
        return m_new, l_G, acc_GxH * scale_G[:, None] + o_GxH

    init = (
        jnp.full((g,), jnp.finfo(jnp.float32).min, jnp.float32),
        jnp.zeros((g,), jnp.float32),
        jnp.zeros((g, h), jnp.float32),
    )
    _, l_G, acc_GxH = jax.lax.fori_loop(0, live, page, init)
    o_ref[...] = (acc_GxH / l_G[:, None]).astype(o_ref.dtype)


def paged_attention(
    q_BxNxH: jax.Array,
    k_PxKxHxC: jax.Array,
    v_PxKxCxH: jax.Array,
    table_BxM: jax.Array,
    positions_B: jax.Array,
    *,
    pages: int | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """One decode step's grouped-query attention read from a page pool through a block table.

    The grid is (B, K): one program per row and kv head, holding that head's G = N / K query
    heads (padded to a power of two) and walking the row's pages j = 0 .. positions_B[b] // C
    (at most `pages`) with an online softmax in float32; page j's keys and values are read from
    the pool at table[b, j], in place. Scores and weighted sums are multiply-reduces, as in
    `attend_blocks` (small G is no shape for a matrix unit). For Triton, G (padded), H and C must
    be powers of two; each pool is one block the kernel indexes in place (pointer arithmetic, no
    copy). Interpret mode slices that block out of the pool per program: a copy, a reference
    vehicle, not a fast path.

    Args:
      q_BxNxH: queries, N = K * G heads (head n = kv head n // G).
      k_PxKxHxC: the key pool, P pages of C positions (rl/models/kv_cache.py's layout).
      v_PxKxCxH: the value pool.
      table_BxM: row b's position p lives at offset p % C of page table[b, p // C]; entries
        outside [0, P) read as zeros.
      positions_B: row b attends to its positions <= positions_B[b] (>= 0).
      pages: table columns the rows may read (a static bound; default all M).
      interpret: Pallas interpret mode; default: on where the program is compiled for a CPU.

    Returns:
      (B, N, H) in q's dtype: `attend_blocks` over the same positions, up to float32 rounding.
    """
    b, n, h = q_BxNxH.shape
    pool, kv, _, c = k_PxKxHxC.shape
    g = n // kv
    pages = table_BxM.shape[1] if pages is None else pages
    if n % kv or not 0 < pages <= table_BxM.shape[1] or table_BxM.shape[0] != b:
        raise ValueError(
            f"paged_attention: expected N a multiple of K, B table rows and 0 < pages <= M; "
            f"received N={n}, K={kv}, table {table_BxM.shape} for B={b}, pages={pages}."
        )
    gp = pl.next_power_of_2(g)
    q = q_BxNxH.reshape(b, kv, g, h)
    if gp != g:
        q = jnp.pad(q, ((0, 0), (0, 0), (0, gp - g), (0, 0)))
    call = functools.partial(
        pl.pallas_call,
        functools.partial(_kernel, pages=pages, pool=pool),
        grid=(b, kv),
        in_specs=[
            pl.BlockSpec((None, 1), lambda i, j: (i, 0)),  # positions (B, 1)
            pl.BlockSpec((None, pages), lambda i, j: (i, 0)),  # table (B, pages)
            pl.BlockSpec((None, None, gp, h), lambda i, j: (i, j, 0, 0)),  # q (B, K, G, H)
            pl.BlockSpec((pool, None, h, c), lambda i, j: (0, j, 0, 0)),  # k pool
            pl.BlockSpec((pool, None, c, h), lambda i, j: (0, j, 0, 0)),  # v pool
        ],
        out_specs=pl.BlockSpec((None, None, gp, h), lambda i, j: (i, j, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((b, kv, gp, h), q_BxNxH.dtype),
        name="paged_decode_attention",
    )
    args = (
        positions_B.astype(jnp.int32)[:, None],
        table_BxM[:, :pages].astype(jnp.int32),
        q,
        k_PxKxHxC,
        v_PxKxCxH,
    )
    if interpret is not None:
        out = call(interpret=interpret)(*args)
    else:  # interpreted where the program is compiled for a CPU
        out = jax.lax.platform_dependent(
            *args, cpu=call(interpret=True), default=call(interpret=False)
        )
    return out[:, :, :g].reshape(b, n, h)
