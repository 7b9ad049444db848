"""The attention math of the decoder (rl/models/transformer.py), and RoPE.

  * `attend_full`: a full causal sequence (training, prefill), through
    `jax.nn.dot_product_attention` in causal query blocks (`query_blocks`);
  * `attend`: queries against a (B, S, K, H) cache with an explicit mask (prefill into a cache);
  * `attend_live`, `attend_blocks`: one decode step against the head-major decode cache
    (rl/models/kv_cache.py), over the whole cache or over its first blocks only.

Grouped-query throughout: K key/value heads serve N = K * G query heads. Scores and softmax are
float32.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rl.models.config import ModelConfig

MASKED = -1e30  # finite, so a fully masked (padding) query row gives a uniform softmax, not NaN


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Inverse RoPE frequencies (head_dim/2,), float32, with Llama-3 scaling when configured."""
    h = cfg.head_dim
    inv = (
        1.0 / (np.float32(cfg.rope_theta) ** (np.arange(0, h, 2, dtype=np.float32) / np.float32(h)))
    ).astype(np.float32)
    s = cfg.rope_scaling
    if s is None:
        return inv
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / s.factor, inv)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def apply_rope(x_BxTxNxH: jax.Array, positions_BxT: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotary embedding in the half-split layout (Hugging Face `rotate_half`)."""
    freqs_BxTxF = (
        positions_BxT.astype(jnp.float32)[:, :, None] * jnp.asarray(inv_freq)[None, None, :]
    )
    cos = jnp.cos(freqs_BxTxF)[:, :, None, :].astype(x_BxTxNxH.dtype)
    sin = jnp.sin(freqs_BxTxF)[:, :, None, :].astype(x_BxTxNxH.dtype)
    x1, x2 = jnp.split(x_BxTxNxH, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def attend(
    q_BxTxNxH: jax.Array, k_BxSxKxH: jax.Array, v_BxSxKxH: jax.Array, mask_BxTxS: jax.Array
) -> jax.Array:
    """Grouped-query softmax attention; scores and softmax in float32."""
    b, t, n, h = q_BxTxNxH.shape
    kv = k_BxSxKxH.shape[2]
    q = q_BxTxNxH.reshape(b, t, kv, n // kv, h)
    s = jnp.einsum("btkgh,bskh->bkgts", q, k_BxSxKxH, preferred_element_type=jnp.float32) * (
        h**-0.5
    )
    s = jnp.where(mask_BxTxS[:, None, None, :, :], s, MASKED)
    p = jax.nn.softmax(s, axis=-1).astype(v_BxSxKxH.dtype)
    out = jnp.einsum("bkgts,bskh->btkgh", p, v_BxSxKxH)
    return out.reshape(b, t, n, h)


def _attention_impl(dtype: Any) -> str:
    """cuDNN fused attention on GPU for half precision (its supported dtypes), XLA otherwise."""
    if jax.default_backend() == "gpu" and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16):
        return "cudnn"
    return "xla"


_QUERY_BLOCK_MIN = 32  # positions per causal query block, at least
_QUERY_BLOCKS_MAX = 8


def query_blocks(t: int) -> int:
    """How many causal query blocks `attend_full` splits a sequence of `t` positions into.

    The largest power of two n <= 8 that divides t and leaves blocks of >= 32 positions (1 below
    64 positions). Block i's queries attend only keys [0, (i + 1) * t / n): a causal mask makes
    the rest zero, so n blocks do (n + 1) / (2n) of the one-block score and value work (62.5% at
    4 blocks), for n attention calls in the program.
    """
    n = 1
    while n < _QUERY_BLOCKS_MAX and t % (2 * n) == 0 and t // (2 * n) >= _QUERY_BLOCK_MIN:
        n *= 2
    return n


def attend_full(
    q_BxTxNxH: jax.Array, k_BxSxKxH: jax.Array, v_BxSxKxH: jax.Array, mask_BxTxS: jax.Array
) -> jax.Array:
    """Causal attention of a full sequence (training, prefill) through
    `jax.nn.dot_product_attention`, in `query_blocks(T)` query blocks.

    `mask_BxTxS` must be causal (S == T, nothing above the diagonal: training's segment masks and
    prefill's are): block i reads only the keys up to its last query. Same math as `attend`
    (scores and softmax in float32); the implementation is chosen by platform and dtype
    (`_attention_impl`).
    """
    t = q_BxTxNxH.shape[1]
    n = query_blocks(t)
    size = t // n
    impl = _attention_impl(q_BxTxNxH.dtype)
    outs = []
    for i in range(n):
        lo, hi = i * size, (i + 1) * size
        outs.append(
            jax.nn.dot_product_attention(
                q_BxTxNxH[:, lo:hi],
                k_BxSxKxH[:, :hi],
                v_BxSxKxH[:, :hi],
                mask=mask_BxTxS[:, None, lo:hi, :hi],
                implementation=impl,
            )
        )
    return outs[0] if n == 1 else jnp.concatenate(outs, axis=1)


def attend_live(
    q_BxNxH: jax.Array, k_BxKxHxS: jax.Array, v_BxKxSxH: jax.Array, positions_B: jax.Array
) -> jax.Array:
    """One decode step's attention over the whole cache; row b attends to positions <=
    positions_B[b].

    Scores, softmax and the weighted sum are elementwise products and reductions in float32, not
    dots: XLA:CPU runs (B, K) batches of G x H by H x S dots far below its peak, while a fused
    multiply-reduce reads the cache once. The shapes are the cache's, whatever the rows' positions,
    so a row's result depends on its own data only (XLA:CPU's reductions round differently for
    different lengths: a live-prefix read of varying length would not be exact; see
    `attend_blocks`).
    """
    b, n, h = q_BxNxH.shape
    kv, s = k_BxKxHxS.shape[1], k_BxKxHxS.shape[3]
    q_BxKxGxH = q_BxNxH.reshape(b, kv, n // kv, h).astype(jnp.float32)
    k = k_BxKxHxS[:, :, None].astype(jnp.float32)
    s_BxKxGxS = jnp.sum(q_BxKxGxH[..., None] * k, axis=3) * h**-0.5
    mask_BxS = jnp.arange(s)[None, :] <= positions_B[:, None]
    s_BxKxGxS = jnp.where(mask_BxS[:, None, None], s_BxKxGxS, MASKED)
    p = jnp.exp(s_BxKxGxS - jnp.max(s_BxKxGxS, axis=-1, keepdims=True))
    v = v_BxKxSxH[:, :, None].astype(jnp.float32)
    out_BxKxGxH = jnp.sum(p[..., None] * v, axis=3) / jnp.sum(p, axis=-1)[..., None]
    return out_BxKxGxH.astype(q_BxNxH.dtype).reshape(b, n, h)


def attend_blocks(
    q_BxNxH: jax.Array, k_BxMxKxHxC: jax.Array, v_BxMxKxCxH: jax.Array, positions_B: jax.Array
) -> jax.Array:
    """One decode step's attention over the first M blocks of C cache positions only.

    Block j holds positions [j * C, (j + 1) * C) (a dense cache's slices or a paged cache's
    pages: rl/models/kv_cache.py `blocks`). Row b attends to positions <= positions_B[b]. As in
    `attend_live`, scores and the weighted sum are float32 multiply-reduces; the reductions over
    positions run within a block (a fixed length) and the blocks' sums are added in block order,
    while the maximum is exact in any order. A block beyond a row's position changes nothing (its
    scores are the mask value, its terms exact zeros), so a row's result does not depend on M (how
    far its neighbours have got): tokens stay independent of the batch.
    """
    b, n, h = q_BxNxH.shape
    m, kv, c = k_BxMxKxHxC.shape[1], k_BxMxKxHxC.shape[2], k_BxMxKxHxC.shape[4]
    q = q_BxNxH.reshape(b, 1, kv, n // kv, h, 1).astype(jnp.float32)
    k = k_BxMxKxHxC[:, :, :, None].astype(jnp.float32)
    s = jnp.sum(q * k, axis=4) * h**-0.5  # (B, M, K, G, C)
    mask = jnp.arange(m * c).reshape(1, m, 1, 1, c) <= positions_B[:, None, None, None, None]
    s = jnp.where(mask, s, MASKED)
    p = jnp.exp(s - jnp.max(s, axis=(1, 4), keepdims=True))
    l_j = jnp.sum(p, axis=-1)  # (B, M, K, G)
    v = v_BxMxKxCxH[:, :, :, None].astype(jnp.float32)
    o_j = jnp.sum(p[..., None] * v, axis=4)  # (B, M, K, G, H)
    total, out = l_j[:, 0], o_j[:, 0]
    for j in range(1, m):
        total, out = total + l_j[:, j], out + o_j[:, j]
    return (out / total[..., None]).astype(q_BxNxH.dtype).reshape(b, n, h)


def write_cache(cache_BxSxKxH: jax.Array, new_BxTxKxH: jax.Array, start_B: jax.Array) -> jax.Array:
    update = lambda c, x, p: jax.lax.dynamic_update_slice_in_dim(c, x.astype(c.dtype), p, axis=0)
    return jax.vmap(update)(cache_BxSxKxH, new_BxTxKxH, start_B)
