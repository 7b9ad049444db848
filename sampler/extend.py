"""Extend: a waiting sample's KV cache continued by tokens the environment wrote (multi-turn).

Between turns (rl/envs) a sample's slot holds its KV cache up to the turn it just ended, its stop
token the token to feed next. `extend` appends an observation of m tokens o_1..o_m as decoding
would have: it feeds (stop, o_1, ..., o_{m-1}) at the slot's next m positions through the model's
cached forward (their keys/values written after the ones already there, each attending to every
earlier position), and leaves the slot active, about to feed o_m at the position after them. So
the tokens the model then draws are those of a re-prefill of the whole conversation (prompt, turns
and observations; `Engine.reprefill`), from the KV already cached instead of recomputed, and the
random stream goes on by position as before.

Observations are padded to a prompt bucket (`EngineConfig.buckets`); the slots of one call come in
chunks of CHUNK rows of that shape through `lax.map` (a padding row's slot is out of range: its
writes are dropped), so a row's floats never depend on the rows beside it, and the programs, one
per bucket, are compiled at start.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from rl.models.transformer import KVCache, Transformer
from sampler import prefill
from sampler.cache import DecodeState

CHUNK = prefill.PREFILL_CHUNK  # rows per cached forward (prefill.chunks' size)

# (slot, fed tokens (the stop token, then the observation but its last), the observation's last)
Item = tuple[int, tuple[int, ...], int]


def chunks(items: Sequence[Item], bucket: Callable[[int], int]) -> list[tuple[int, Sequence[Item]]]:
    """`items` in calls of at most CHUNK rows of one bucket of fed tokens, shortest first."""
    fed = lambda item: len(item[1])
    return [
        (length, chunk)
        for length, group in prefill.by_bucket(items, bucket, length=fed)
        for chunk in prefill.chunks(group)
    ]


def pack(items: Sequence[Item], bucket: int, max_slots: int) -> tuple[np.ndarray, ...]:
    """The arrays of one call: slots (n,), fed tokens (n, bucket), their counts (n,) and the next
    token to feed (n,), n the items padded to a multiple of CHUNK (padding slots out of range)."""
    n = -(-len(items) // CHUNK) * CHUNK
    slots = np.full((n,), max_slots, np.int32)
    tokens = np.zeros((n, bucket), np.int32)
    counts = np.zeros((n,), np.int32)
    nxt = np.zeros((n,), np.int32)
    for row, (slot, fed, last) in enumerate(items):
        slots[row], counts[row], nxt[row] = slot, len(fed), last
        tokens[row, : len(fed)] = fed
    return slots, tokens, counts, nxt


def abstract(bucket: int) -> tuple[jax.ShapeDtypeStruct, ...]:
    """`pack`'s shapes for one chunk of CHUNK rows (what precompile compiles)."""
    s = jax.ShapeDtypeStruct
    return (
        s((CHUNK,), np.int32),
        s((CHUNK, bucket), np.int32),
        s((CHUNK,), np.int32),
        s((CHUNK,), np.int32),
    )


def extend_rows(
    model: Transformer,
    state: DecodeState,
    slots_N: jax.Array,
    tokens_NxE: jax.Array,
    counts_N: jax.Array,
    next_N: jax.Array,
) -> DecodeState:
    """Feeds tokens_NxE[i, :counts_N[i]] into slot slots_N[i] (module docstring); N is a multiple
    of CHUNK, the rows go CHUNK at a time."""
    n, e = tokens_NxE.shape
    positions_N = jnp.take(state.positions, slots_N, mode="clip")

    s = state.cache.max_length

    def one(chunk: tuple[jax.Array, ...]) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]:
        slots, tokens, start = chunk
        k, v = state.cache.rows(slots, s)
        # (C, K, H, S) and (C, K, S, H) rows to (C, S + E, K, H): room for the E fed positions
        pad = ((0, 0), (0, e), (0, 0), (0, 0))
        k = tuple(jnp.pad(x.transpose(0, 3, 1, 2), pad) for x in k)
        v = tuple(jnp.pad(x.transpose(0, 2, 1, 3), pad) for x in v)
        positions = start[:, None] + jnp.arange(e)[None, :]
        _, cache = model.decode(tokens, positions, KVCache(k=k, v=v))
        return (
            tuple(x[:, :s].transpose(0, 2, 3, 1) for x in cache.k),
            tuple(x[:, :s].transpose(0, 2, 1, 3) for x in cache.v),
        )

    chunked = lambda x: x.reshape(n // CHUNK, CHUNK, *x.shape[1:])
    k, v = jax.lax.map(one, (chunked(slots_N), chunked(tokens_NxE), chunked(positions_N)))
    rows = lambda xs: tuple(x.reshape(n, *x.shape[2:]) for x in xs)
    cache = state.cache.put_rows(slots_N, rows(k), rows(v))
    fill = lambda arr, value: arr.at[slots_N].set(value, mode="drop")
    return dataclasses.replace(
        state,
        cache=cache,
        tokens=fill(state.tokens, next_N),
        positions=fill(state.positions, positions_N + counts_N),
        active=fill(state.active, True),
    )


def check(items: Sequence[Item], max_slots: int, bucket_of: Callable[[int], int]) -> None:
    """Raises a clear error for items `extend` cannot take: slots distinct and in range, at least
    one fed token each, within the prompt buckets."""
    slots = [slot for slot, _, _ in items]
    if len(set(slots)) != len(slots) or not all(0 <= s < max_slots for s in slots):
        raise ValueError(
            f"extend: slots must be distinct and in [0, {max_slots}); received {slots}."
        )
    for slot, fed, _ in items:
        if not fed:
            raise ValueError(f"extend: slot {slot} feeds no token; expected the stop token first.")
        bucket_of(len(fed))  # raises past max_prefill_length
