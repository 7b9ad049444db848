"""The decode step: k fused steps for every slot, and how much of the cache attention reads.

Each step feeds every slot's token at its position, draws the next token (sampler/sampling.py)
with the PRNG key fold_in(slot's key, position + 1) (the slot's key is its request's and sample's,
sampler/prefill.py), and ends a sequence at a stop token or at its last position. Attention reads
the first blocks of `EngineConfig.decode_block` positions (`attention_block`, 64 by default) that
the longest live sequence reaches (`live_blocks`: the count rounded up to a power of two, one
compile each), block by block (`attend_blocks` in rl/models/attention.py, exact for any count:
fixed-shape blocks, so a row's floats never depend on its neighbours); a dense cache's blocks are
slices of it, a paged cache's are its pages, and either is gathered once per generate call for its
k steps (rl/models/kv_cache.py `windowed`). With decode_block 0 it reads the whole cache every
step (`attend_live`, fused multiply-reduces over the cache's fixed shape).
`EngineConfig.attention_kernel` names the implementation (rl/models/paged_attention.py): "xla"
gathers the blocks as above, "pallas" reads a paged cache's pages in place.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from rl.models.kv_cache import WindowedKVCache, windowed
from rl.models.paged_attention import GATHERING_KERNELS
from rl.models.transformer import Transformer
from sampler.cache import DecodeState
from sampler.config import rungs
from sampler.sampling import sample_tokens


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StepResult:
    """What k fused decode steps produced; arrays are (k, B)."""

    tokens: jax.Array  # sampled token
    logprobs: jax.Array  # behaviour log-prob of that token (see sampler/sampling.py)
    valid: jax.Array  # the slot was active and produced this token
    finished: jax.Array  # this token ended the sequence (stop token or length)


def step(
    model: Transformer, state: DecodeState, *, blocks: int, block: int, kernel: str = "xla"
) -> tuple[DecodeState, StepResult]:
    """One decode step for every slot (attention over `blocks` blocks of `block`; 0: all; by
    the decode attention `kernel`)."""
    h, cache = model.decode_step(
        state.tokens, state.positions, state.cache, blocks=blocks, block=block, kernel=kernel
    )
    logits = model.logits(h)[:, 0]
    keys = jax.vmap(jax.random.fold_in)(state.keys, state.positions + 1)
    tok, logp = sample_tokens(logits, keys, state.temperature, state.top_k, state.top_p)
    valid = state.active
    stop = jnp.any(tok[:, None] == state.stop_ids, axis=-1)
    finished = valid & (stop | (state.positions + 1 >= state.last_position))
    state = dataclasses.replace(
        state,
        cache=cache,
        tokens=jnp.where(valid, tok, state.tokens),
        positions=jnp.where(valid, state.positions + 1, state.positions),
        active=valid & ~finished,
    )
    return state, StepResult(tokens=tok, logprobs=logp, valid=valid, finished=finished)


def generate(
    model: Transformer,
    state: DecodeState,
    *,
    blocks: int,
    block: int,
    steps: int,
    kernel: str = "xla",
) -> tuple[DecodeState, StepResult]:
    """`steps` decode steps for every slot, fused in one scan; inactive slots produce nothing.
    A decode attention that reads gathered blocks (`GATHERING_KERNELS`) reads a window of them
    gathered once for the call (rl/models/kv_cache.py `windowed`)."""
    if blocks and kernel in GATHERING_KERNELS:
        state = dataclasses.replace(state, cache=windowed(state.cache, blocks, block))
    state, result = jax.lax.scan(
        lambda s, _: step(model, s, blocks=blocks, block=block, kernel=kernel),
        state,
        None,
        length=steps,
    )
    if isinstance(state.cache, WindowedKVCache):
        state = dataclasses.replace(state, cache=state.cache.cache)
    return state, result


def block_rungs(*, block: int, cache_length: int) -> tuple[int, ...]:
    """Every count `live_blocks` can return (one generate program each): 0 (the whole cache) when
    `block` is 0, else the powers of two below the cache's blocks, then all of them."""
    return rungs(cache_length // block) if block else (0,)


def live_blocks(
    positions_B: np.ndarray,
    active_B: np.ndarray,
    last_position_B: np.ndarray,
    *,
    steps: int,
    block: int,
    cache_length: int,
) -> int:
    """Attention blocks of `block` positions a call of `steps` steps reads: enough for every active
    slot's last fed position, rounded up to a power of two (few compiles), at most the whole
    cache (host arrays); 0 (the whole cache) when `block` is 0."""
    if not block:
        return 0
    need = int(
        np.max(np.where(active_B, np.minimum(positions_B + steps, last_position_B), 1), initial=1)
    )
    blocks = 1 << (-(-need // block) - 1).bit_length()
    return min(blocks, cache_length // block)
