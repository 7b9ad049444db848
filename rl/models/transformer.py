"""Decoder-only transformer for the Llama 3.x, Qwen2/2.5 and Qwen3 families, in Flax NNX.

Two call paths share the same weights (the attention math and RoPE: rl/models/attention.py):
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
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from rl.models.attention import (
    apply_rope,
    attend,
    attend_full,
    rope_inv_freq,
    write_cache,
)
from rl.models.config import ModelConfig
from rl.models.kv_cache import KVCacheLike
from rl.models.lora import Adapted
from rl.models.paged_attention import DECODE_ATTENTION
from rl.models.sharding import constrain

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


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class _DecodeStep:
    """Marks a head-major decode step (T == 1): over `blocks` blocks of `block` positions
    (`attend_blocks`), or over the whole cache when `blocks` is 0 (`attend_live`), through the
    decode attention named `kernel` (rl/models/paged_attention.py)."""

    blocks: int
    block: int
    kernel: str = "xla"


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
            attention = DECODE_ATTENTION.get(mask.kernel)
            out = attention(q[:, 0], kv, pos_B, blocks=mask.blocks, block=mask.block)[:, None]
        elif kv is None:
            out, kv = attend_full(q, k, v, mask), (k, v)
        else:
            start_B = positions_BxT[:, 0]
            kv = (write_cache(kv[0], k, start_B), write_cache(kv[1], v, start_B))
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
        kernel: str = "xla",
    ) -> tuple[jax.Array, KVCacheLike]:
        """One token per row at `positions_B`, attending to the whole cache (`blocks` 0) or only
        to its first `blocks * block` positions (every row's position must be below that; see
        `attend_blocks`), through the decode attention named `kernel`
        (rl/models/paged_attention.py `DECODE_ATTENTION`).

        Returns:
          (final-normed hidden states (B, 1, d_model), updated cache).
        """
        step = _DecodeStep(blocks=blocks, block=block, kernel=kernel)
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
