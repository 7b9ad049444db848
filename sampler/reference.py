"""Naive decoding without a KV cache: every step recomputes the full forward pass.

The reference the engine is tested against (greedy tokens, log-probs) and the benchmark's
no-cache baseline. Rows are padded to one fixed length so there is a single compile.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from rl.models.transformer import Transformer


@jax.jit
def _next_tokens(model: Transformer, tokens_BxL: jax.Array, lengths_B: jax.Array) -> jax.Array:
    b, length = tokens_BxL.shape
    positions = jnp.broadcast_to(jnp.arange(length)[None], (b, length))
    segments = (positions < lengths_B[:, None]).astype(jnp.int32)
    h = model.hidden(tokens_BxL, positions, segments)
    last = jnp.take_along_axis(h, (lengths_B - 1)[:, None, None], axis=1)
    return jnp.argmax(model.logits(last)[:, 0], axis=-1).astype(jnp.int32)


def greedy_nocache(
    model: Transformer, prompts: Sequence[Sequence[int]], new_tokens: Sequence[int], max_length: int
) -> list[list[int]]:
    """Greedy continuations of `prompts` (new_tokens[i] tokens each) by full recompute per step."""
    b = len(prompts)
    buf = np.zeros((b, max_length), np.int32)
    lengths = np.array([len(p) for p in prompts], np.int32)
    if np.any(lengths + np.asarray(new_tokens) > max_length):
        raise ValueError(f"prompt + new_tokens exceeds max_length ({max_length}).")
    for i, p in enumerate(prompts):
        buf[i, : len(p)] = p
    out: list[list[int]] = [[] for _ in range(b)]
    for _ in range(max(new_tokens)):
        nxt = np.asarray(_next_tokens(model, jnp.asarray(buf), jnp.asarray(lengths)))
        for i in range(b):
            if len(out[i]) < new_tokens[i]:
                out[i].append(int(nxt[i]))
                buf[i, lengths[i]] = nxt[i]
                lengths[i] += 1
    return out
