"""Decoder-only transformer for the Llama 3.x, Qwen2/2.5 and Qwen3 families, in Flax NNX.

Two call paths share the same weights:
  * full sequence (training, log-probs): `hidden`, `__call__` (logits), `token_logprobs`;
  * cached decode (sampling): `init_cache`, then `decode` at given positions, which writes the new
    keys/values into the cache and attends over it.

Every parameter carries `logical_axes` metadata (see rl/models/sharding.py); the main activations
are constrained by logical names when a mesh is set (`jax.set_mesh`).

Layouts: q/k/v kernels are (embed, heads, head_dim), o is (heads, head_dim, embed), MLP kernels are
(embed, mlp) / (mlp, embed), the token embedding is (vocab, embed) and an untied lm_head is
(embed, vocab). rl/models/hf_io.py converts to and from Hugging Face's (out, in) linear layout.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rl.models.config import ModelConfig
from rl.models.kv_cache import KVCacheLike
from rl.models.lora import Adapted
from rl.models.sharding import constrain

_MASKED = -1e30  # finite, so a fully masked (padding) query row gives a uniform softmax, not NaN
CACHE_AXES = ("batch", "cache_length", "kv_heads", "head_dim")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """Per-layer key/value cache; cache index == token position. Each array is (B, S, K, H)."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]

    @property
    def max_length(self) -> int:
        return self.k[0].shape[1]

    def layer(self, i: int) -> tuple[jax.Array, jax.Array]:
        return self.k[i], self.v[i]


def _param(
    rngs: nnx.Rngs,
    cfg: ModelConfig,
    shape: tuple[int, ...],
    axes: tuple[str, ...],
    init: str = "normal",
) -> nnx.Param:
    dtype = cfg.jnp_param_dtype
    if init == "normal":
        value = cfg.init_std * jax.random.normal(rngs.params(), shape, jnp.float32)
    elif init == "zeros":
        value = jnp.zeros(shape, jnp.float32)
    else:
        value = jnp.ones(shape, jnp.float32)
    return nnx.Param(value.astype(dtype), logical_axes=axes)


class RMSNorm(nnx.Module):
    """RMSNorm computed in float32, scaled in the input dtype (as Hugging Face Llama/Qwen)."""

    def __init__(self, dim: int, cfg: ModelConfig, rngs: nnx.Rngs):
        self.scale = _param(rngs, cfg, (dim,), ("norm",), init="ones")
        self.eps = cfg.rms_eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        scale = self.scale[...].astype(x.dtype).reshape((1,) * (x.ndim - 1) + (-1,))
        return scale * y.astype(x.dtype)


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
    s = jnp.where(mask_BxTxS[:, None, None, :, :], s, _MASKED)
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
    s_BxKxGxS = jnp.where(mask_BxS[:, None, None], s_BxKxGxS, _MASKED)
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
    s = jnp.where(mask, s, _MASKED)
    p = jnp.exp(s - jnp.max(s, axis=(1, 4), keepdims=True))
    l_j = jnp.sum(p, axis=-1)  # (B, M, K, G)
    v = v_BxMxKxCxH[:, :, :, None].astype(jnp.float32)
    o_j = jnp.sum(p[..., None] * v, axis=4)  # (B, M, K, G, H)
    total, out = l_j[:, 0], o_j[:, 0]
    for j in range(1, m):
        total, out = total + l_j[:, j], out + o_j[:, j]
    return (out / total[..., None]).astype(q_BxNxH.dtype).reshape(b, n, h)


def _write_cache(cache_BxSxKxH: jax.Array, new_BxTxKxH: jax.Array, start_B: jax.Array) -> jax.Array:
    update = lambda c, x, p: jax.lax.dynamic_update_slice_in_dim(c, x.astype(c.dtype), p, axis=0)
    return jax.vmap(update)(cache_BxSxKxH, new_BxTxKxH, start_B)


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class _DecodeStep:
    """Marks a head-major decode step (T == 1): over `blocks` blocks of `block` positions
    (`attend_blocks`), or over the whole cache when `blocks` is 0 (`attend_live`)."""

    blocks: int
    block: int


class Attention(Adapted):
    PROJECTIONS = {"q": 1, "k": 1, "v": 1, "o": 2}

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d, n, k, h = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.q = _param(rngs, cfg, (d, n, h), ("embed", "q_heads", "head_dim"))
        self.k = _param(rngs, cfg, (d, k, h), ("embed", "kv_heads", "head_dim"))
        self.v = _param(rngs, cfg, (d, k, h), ("embed", "kv_heads", "head_dim"))
        self.o = _param(rngs, cfg, (n, h, d), ("q_heads", "head_dim", "embed"))
        if cfg.qkv_bias:
            self.q_bias = _param(rngs, cfg, (n, h), ("q_heads", "head_dim"), init="zeros")
            self.k_bias = _param(rngs, cfg, (k, h), ("kv_heads", "head_dim"), init="zeros")
            self.v_bias = _param(rngs, cfg, (k, h), ("kv_heads", "head_dim"), init="zeros")
        if cfg.o_bias:
            self.o_bias = _param(rngs, cfg, (d,), ("embed",), init="zeros")
        if cfg.qk_norm:
            self.q_norm = RMSNorm(h, cfg, rngs)
            self.k_norm = RMSNorm(h, cfg, rngs)
        self.config = cfg

    def _project(self, x: jax.Array, name: str) -> jax.Array:
        w = getattr(self, name)
        y = self.adapted(name, x, jnp.einsum("btd,dnh->btnh", x, w[...].astype(x.dtype)))
        if self.config.qkv_bias:
            y = y + getattr(self, f"{name}_bias")[...].astype(x.dtype)[None, None]
        return y

    def __call__(
        self,
        x_BxTxD: jax.Array,
        positions_BxT: jax.Array,
        mask: Any,
        kv: tuple[jax.Array, jax.Array] | None,
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:
        """`kv`: None (full sequence; returns its own keys/values), a (B, S, K, H) cache pair with
        `mask` (B, T, S), or a decode cache's layer (rl/models/kv_cache.py) with `mask` a
        `_DecodeStep`."""
        cfg = self.config
        q = constrain(self._project(x_BxTxD, "q"), ("batch", "length", "q_heads", "head_dim"))
        k = constrain(self._project(x_BxTxD, "k"), ("batch", "length", "kv_heads", "head_dim"))
        v = constrain(self._project(x_BxTxD, "v"), ("batch", "length", "kv_heads", "head_dim"))
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        inv_freq = rope_inv_freq(cfg)
        q, k = apply_rope(q, positions_BxT, inv_freq), apply_rope(k, positions_BxT, inv_freq)
        if isinstance(mask, _DecodeStep):
            pos_B = positions_BxT[:, 0]
            kv = kv.write(k[:, 0], v[:, 0], pos_B)
            if mask.blocks:
                out = attend_blocks(q[:, 0], *kv.blocks(mask.blocks, mask.block), pos_B)
            else:
                out = attend_live(q[:, 0], *kv.view(), pos_B)
            out = out[:, None]
        elif kv is None:
            out, kv = attend_full(q, k, v, mask), (k, v)
        else:
            start_B = positions_BxT[:, 0]
            kv = (_write_cache(kv[0], k, start_B), _write_cache(kv[1], v, start_B))
            out = attend(q, kv[0].astype(q.dtype), kv[1].astype(q.dtype), mask)
        out = self.adapted(
            "o", out, jnp.einsum("btnh,nhd->btd", out, self.o[...].astype(out.dtype))
        )
        if cfg.o_bias:
            out = out + self.o_bias[...].astype(out.dtype)[None, None]
        return out, kv


class MLP(Adapted):
    PROJECTIONS = {"gate": 1, "up": 1, "down": 1}

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d, f = cfg.d_model, cfg.mlp_dim
        self.gate = _param(rngs, cfg, (d, f), ("embed", "mlp"))
        self.up = _param(rngs, cfg, (d, f), ("embed", "mlp"))
        self.down = _param(rngs, cfg, (f, d), ("mlp", "embed"))

    def __call__(self, x_BxTxD: jax.Array) -> jax.Array:
        x = x_BxTxD
        g = self.adapted("gate", x, jnp.einsum("btd,df->btf", x, self.gate[...].astype(x.dtype)))
        u = self.adapted("up", x, jnp.einsum("btd,df->btf", x, self.up[...].astype(x.dtype)))
        h = constrain(jax.nn.silu(g) * u, ("batch", "length", "mlp"))
        return self.adapted("down", h, jnp.einsum("btf,fd->btd", h, self.down[...].astype(h.dtype)))


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg.d_model, cfg, rngs)
        self.attn = Attention(cfg, rngs)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg, rngs)
        self.mlp = MLP(cfg, rngs)

    def __call__(
        self,
        x: jax.Array,
        positions: jax.Array,
        mask: jax.Array,
        kv: tuple[jax.Array, jax.Array] | None,
    ) -> tuple[jax.Array, Any]:
        h, kv = self.attn(self.attn_norm(x), positions, mask, kv)
        x = x + h
        x = x + self.mlp(self.mlp_norm(x))
        return constrain(x, ("batch", "length", "embed")), kv


def _run_block(
    block: Block, x: jax.Array, positions: jax.Array, mask: jax.Array, kv: Any
) -> tuple[jax.Array, Any]:
    return block(x, positions, mask, kv)


_REMAT = {
    "full": None,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


class Transformer(nnx.Module):
    """The decoder. Build with `Transformer(cfg, rngs=nnx.Rngs(seed))` or rl.models.create_model."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.config = cfg
        self.embed = _param(rngs, cfg, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"))
        self.layers = nnx.List([Block(cfg, rngs) for _ in range(cfg.n_layers)])
        self.final_norm = RMSNorm(cfg.d_model, cfg, rngs)
        if not cfg.tie_embeddings:
            self.lm_head = _param(rngs, cfg, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"))
        if cfg.lora is not None:  # after every base weight: the base is the same with or without
            for block in self.layers:
                block.attn.attach(cfg.lora, rngs)
                block.mlp.attach(cfg.lora, rngs)

    def unembedding(self) -> jax.Array:
        """The (embed, vocab) output projection."""
        return self.embed[...].T if self.config.tie_embeddings else self.lm_head[...]

    def _stack(
        self,
        tokens_BxT: jax.Array,
        positions_BxT: jax.Array,
        mask_BxTxS: jax.Array,
        cache: KVCache | KVCacheLike | None,
    ) -> tuple[jax.Array, list[Any]]:
        """Runs the blocks; returns final-normed hidden states and each layer's keys/values (its
        updated cache layer, or the sequence's own (B, T, K, H) keys/values when `cache` is
        None)."""
        cfg = self.config
        x = jnp.take(self.embed[...], tokens_BxT, axis=0).astype(cfg.jnp_dtype)
        x = constrain(x, ("batch", "length", "embed"))
        run = _run_block if cfg.remat == "none" else nnx.remat(_run_block, policy=_REMAT[cfg.remat])
        layers = []
        for i, block in enumerate(self.layers):
            kv = None if cache is None else cache.layer(i)
            x, kv = run(block, x, positions_BxT, mask_BxTxS, kv)
            layers.append(kv)
        return self.final_norm(x), layers

    def hidden(
        self, tokens_BxT: jax.Array, positions_BxT: jax.Array, segment_ids_BxT: jax.Array
    ) -> jax.Array:
        """Final-normed hidden states of a full sequence.

        Args:
          tokens_BxT: token ids.
          positions_BxT: RoPE positions (restart at 0 for each packed segment).
          segment_ids_BxT: > 0 for real tokens (one id per packed sequence), 0 for padding. A token
            attends to earlier-or-equal indices of its own segment.

        Returns:
          (B, T, d_model) hidden states in the compute dtype.
        """
        t = tokens_BxT.shape[1]
        idx = jnp.arange(t)
        causal_TxT = idx[:, None] >= idx[None, :]
        same_BxTxT = (segment_ids_BxT[:, :, None] == segment_ids_BxT[:, None, :]) & (
            segment_ids_BxT[:, None, :] > 0
        )
        mask = same_BxTxT & causal_TxT[None]
        h, _ = self._stack(tokens_BxT, positions_BxT, mask, None)
        return h

    def prefill(
        self, tokens_BxT: jax.Array
    ) -> tuple[jax.Array, tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]]:
        """Prompts from position 0, right-padded (padding attends nothing real tokens see).

        Returns:
          (final-normed hidden states (B, T, d_model), (keys, values) per layer, each
          (B, T, K, H) in the compute dtype).
        """
        t = tokens_BxT.shape[1]
        positions = jnp.broadcast_to(jnp.arange(t), tokens_BxT.shape)
        causal = jnp.arange(t)[:, None] >= jnp.arange(t)[None, :]
        mask = jnp.broadcast_to(causal[None], (tokens_BxT.shape[0], t, t))
        h, layers = self._stack(tokens_BxT, positions, mask, None)
        return h, (tuple(k for k, _ in layers), tuple(v for _, v in layers))

    def logits(self, h_BxTxD: jax.Array) -> jax.Array:
        """float32 logits of hidden states (materialises B*T*V: use token_logprobs for training)."""
        w = self.unembedding()
        out = jnp.einsum(
            "btd,dv->btv", h_BxTxD, w.astype(h_BxTxD.dtype), preferred_element_type=jnp.float32
        )
        return constrain(out, ("batch", "length", "vocab"))

    def __call__(
        self, tokens_BxT: jax.Array, positions_BxT: jax.Array, segment_ids_BxT: jax.Array
    ) -> jax.Array:
        return self.logits(self.hidden(tokens_BxT, positions_BxT, segment_ids_BxT))

    def token_logprobs(
        self,
        tokens_BxT: jax.Array,
        positions_BxT: jax.Array,
        segment_ids_BxT: jax.Array,
        targets_BxT: jax.Array,
        *,
        temperature: float = 1.0,
        with_entropy: bool = False,
    ) -> jax.Array | tuple[jax.Array, jax.Array]:
        """log softmax(logits / temperature)[target] per token, without materialising B*T*V logits.

        Returns:
          logp_BxT (float32), and entropy_BxT of the same distribution when `with_entropy`.
        """
        h = self.hidden(tokens_BxT, positions_BxT, segment_ids_BxT)
        return chunked_logprobs(
            h,
            self.unembedding(),
            targets_BxT,
            chunk=self.config.logits_chunk,
            temperature=temperature,
            with_entropy=with_entropy,
        )

    def init_cache(self, batch: int, max_length: int, dtype: Any = None) -> KVCache:
        """An empty KV cache for `batch` sequences of up to `max_length` positions."""
        cfg = self.config
        shape = (batch, max_length, cfg.n_kv_heads, cfg.head_dim)
        dtype = cfg.jnp_dtype if dtype is None else dtype
        zeros = lambda: constrain(jnp.zeros(shape, dtype), CACHE_AXES)
        return KVCache(
            k=tuple(zeros() for _ in range(cfg.n_layers)),
            v=tuple(zeros() for _ in range(cfg.n_layers)),
        )

    def decode(
        self, tokens_BxT: jax.Array, positions_BxT: jax.Array, cache: KVCache
    ) -> tuple[jax.Array, KVCache]:
        """Runs T new tokens per row against the cache (prefill when T > 1, a decode step when T == 1).

        Positions of a row must be contiguous (p, p+1, ..., p+T-1) with p + T <= cache.max_length; the
        new keys/values are written at those cache indices and each token attends to cache indices
        <= its own position (earlier entries of the row must have been written).

        Returns:
          (final-normed hidden states (B, T, d_model), updated cache). Use `logits` on what you need.
        """
        s = cache.max_length
        mask = jnp.arange(s)[None, None, :] <= positions_BxT[:, :, None]
        h, layers = self._stack(tokens_BxT, positions_BxT, mask, cache)
        return h, KVCache(k=tuple(k for k, _ in layers), v=tuple(v for _, v in layers))

    def decode_step(
        self,
        tokens_B: jax.Array,
        positions_B: jax.Array,
        cache: KVCacheLike,
        *,
        blocks: int = 0,
        block: int = 0,
    ) -> tuple[jax.Array, KVCacheLike]:
        """One token per row at `positions_B`, attending to the whole cache (`blocks` 0) or only
        to its first `blocks * block` positions (every row's position must be below that; see
        `attend_blocks`).

        Returns:
          (final-normed hidden states (B, 1, d_model), updated cache).
        """
        step = _DecodeStep(blocks=blocks, block=block)
        h, layers = self._stack(tokens_B[:, None], positions_B[:, None], step, cache)
        return h, cache.with_layers(layers)


def chunked_logprobs(
    h_BxTxD: jax.Array,
    w_DxV: jax.Array,
    targets_BxT: jax.Array,
    *,
    chunk: int,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Per-token log-probs (and entropy) of `targets` under softmax(h @ w / temperature).

    The sequence is processed in chunks under `jax.checkpoint`, so neither the forward nor the
    backward pass holds more than B * chunk * V logits at once; a sequence of one chunk is
    processed whole, its logits kept for the backward pass (no recompute).
    """
    if isinstance(temperature, (int, float)) and not temperature > 0:
        raise ValueError(f"temperature must be > 0 for log-probs; received {temperature}.")
    b, t, d = h_BxTxD.shape
    c = min(chunk, t)
    n = -(-t // c)
    pad = n * c - t
    h = jnp.pad(h_BxTxD, ((0, 0), (0, pad), (0, 0))).reshape(b, n, c, d).transpose(1, 0, 2, 3)
    tgt = jnp.pad(targets_BxT, ((0, 0), (0, pad))).reshape(b, n, c).transpose(1, 0, 2)

    def one(args: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        h_BxCxD, t_BxC = args
        logits = jnp.einsum(
            "bcd,dv->bcv", h_BxCxD, w_DxV.astype(h_BxCxD.dtype), preferred_element_type=jnp.float32
        )
        logits = constrain(logits / temperature, ("batch", "length", "vocab"))
        lse_BxC = jax.nn.logsumexp(logits, axis=-1)
        logp = jnp.take_along_axis(logits, t_BxC[:, :, None], axis=-1)[:, :, 0] - lse_BxC
        if not with_entropy:
            return logp, jnp.zeros_like(logp)
        p = jnp.exp(logits - lse_BxC[:, :, None])
        return logp, lse_BxC - jnp.sum(p * logits, axis=-1)

    if n == 1:  # one chunk holds no more logits than the chunk bound allows: keep them
        logp, ent = jax.tree.map(lambda x: x[None], one((h[0], tgt[0])))
    else:
        logp, ent = jax.lax.map(jax.checkpoint(one), (h, tgt))
    logp = logp.transpose(1, 0, 2).reshape(b, n * c)[:, :t]
    if not with_entropy:
        return logp
    return logp, ent.transpose(1, 0, 2).reshape(b, n * c)[:, :t]


def abstract_model(cfg: ModelConfig) -> Transformer:
    """The model with ShapeDtypeStruct leaves: shapes, dtypes and logical axes, no memory."""
    return nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
