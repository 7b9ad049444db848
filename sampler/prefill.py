"""Prefill and insert: prompts' keys/values computed and written into the slots of their samples.

Cache index == token position. A request's prompt of length L is prefilled at positions 0..L-1;
insert leaves the slot about to feed prompt[L-1] at position L-1, so every response token, the first
included, is drawn by the decode step (sampler/decode.py). The slot's PRNG key is
    fold_in(fold_in(fold_in(key(seed), round), uid), sample),
so a sample's random stream depends on its request and index, not on its slot or on the prompts
admitted with it.

Two ways in, writing the same floats: `prefill_prompt` (one prompt, padded to its length bucket)
then `insert` (its keys/values copied into the slots of the samples it starts), JetStream's shape;
or the batched admission, the prompts admitted together in chunks of PREFILL_CHUNK prompts of one
length bucket (`pack_chunk`): each chunk's prefill (`prefill_rows`, one program per bucket), then
`insert_rows` writing its keys/values into the slots its samples start, their count padded to a
rung of `EngineConfig.slot_rungs` (a scatter, no model: one cheap program per bucket x rung). The
shapes are few and known from the config, so a run compiles them all at start (rl/compiles.py).
Both prefill in chunks of PREFILL_CHUNK prompts of one fixed shape. The functions without a `model`
argument run on the host and build the arrays the device functions take.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rl.models.transformer import Transformer
from rl.types import Request
from sampler.cache import DecodeState
from sampler.config import EngineConfig

# Prompts per prefill matmul (padded with empty prompts): one fixed row count, so a prompt's
# keys/values do not depend on how many prompts were admitted with it.
PREFILL_CHUNK = 8

# (request, slots, samples): sample samples[i] of the request starts in slots[i].
Item = tuple[Request, tuple[int, ...], tuple[int, ...]]


@dataclasses.dataclass(frozen=True)
class Prefix:
    """One prompt's prefilled keys/values, (bucket, K, H) per layer, and its length."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    length: int
    last_token: int


# ------------------------------------------------------------------------------------------ host


def check_insert(
    config: EngineConfig,
    vocab_size: int,
    slots: Sequence[int],
    request: Request,
    samples: Sequence[int] | None,
) -> tuple[int, ...]:
    """Validates one request's insertion; returns its sample indices (default 0..G-1)."""
    samples = tuple(range(request.group_size)) if samples is None else tuple(samples)
    if len(slots) != len(samples):
        raise ValueError(
            f"bulk_insert got {len(slots)} slots for {len(samples)} samples {list(samples)}; "
            "expected one slot per sample."
        )
    if len(set(samples)) != len(samples) or not all(0 <= i < request.group_size for i in samples):
        raise ValueError(
            f"bulk_insert samples must be distinct and in [0, {request.group_size}) (the "
            f"group size of request uid={request.uid}); received {list(samples)}."
        )
    if len(set(slots)) != len(slots) or not all(0 <= s < config.max_slots for s in slots):
        raise ValueError(
            f"bulk_insert slots must be distinct and in [0, {config.max_slots}); "
            f"received {list(slots)}."
        )
    config.check_request(request, vocab_size)
    return samples


def padded(tokens: Sequence[int], bucket: int) -> np.ndarray:
    """`tokens` as int32, zero-padded to `bucket`."""
    out = np.zeros((bucket,), np.int32)
    out[: len(tokens)] = tokens
    return out


def insert_args(
    prefix: Prefix, request: Request, max_new: int, config: EngineConfig
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`insert`'s ids, sampling and stop_ids for `prefix` of `request`; `max_new` tokens follow."""
    p = request.params
    stop = np.full((config.max_stop_tokens,), -1, np.int32)
    stop[: len(p.stop_token_ids)] = p.stop_token_ids
    ids = [config.seed, request.round, request.uid, max_new, prefix.length, prefix.last_token]
    sampling = np.asarray([p.temperature, p.top_k, p.top_p], np.float32)
    return np.asarray(ids, np.int32), sampling, stop


def by_bucket(
    items: Sequence[Any],
    bucket: Callable[[int], int],
    length: Callable[[Any], int] = lambda item: len(item[0].prompt),
) -> list[tuple[int, list[Any]]]:
    """`items` grouped by the bucket of their length (default: an Item's prompt length),
    shortest first."""
    out: dict[int, list[Any]] = {}
    for item in items:
        out.setdefault(bucket(length(item)), []).append(item)
    return sorted(out.items())


def chunks(items: Sequence[Any]) -> list[Sequence[Any]]:
    """`items` in calls of at most PREFILL_CHUNK rows."""
    return [items[i : i + PREFILL_CHUNK] for i in range(0, len(items), PREFILL_CHUNK)]


def pack_chunk(items: Sequence[Item], bucket: int, config: EngineConfig) -> tuple[np.ndarray, ...]:
    """The batched admission's arrays (tokens for `prefill_rows`; rows, slots, ids, sampling, stop
    for `insert_rows`) for at most PREFILL_CHUNK prompts of one bucket: PREFILL_CHUNK prompt rows,
    the slots padded to their rung (`EngineConfig.slot_rungs`; padding slots are out of range:
    dropped). The shapes come from a fixed set, so every program is compiled ahead
    (`abstract_chunk`)."""
    if len(items) > PREFILL_CHUNK:
        raise ValueError(f"pack_chunk takes at most {PREFILL_CHUNK} prompts; got {len(items)}.")
    rung = config.slot_rung(sum(len(s) for _, s, _ in items))
    shapes = abstract_chunk(bucket, rung, config)
    tokens, rows, slots, ids, sampling, stop = (np.zeros(x.shape, x.dtype) for x in shapes)
    slots[:] = config.max_slots
    stop[:] = -1
    n = 0
    for row, (r, s, samples) in enumerate(items):
        p = r.params
        tokens[row, : len(r.prompt)] = r.prompt
        for slot, i in zip(s, samples, strict=True):
            rows[n], slots[n] = row, slot
            ids[n] = (config.seed, r.round, r.uid, i, p.max_new_tokens, len(r.prompt), r.prompt[-1])
            sampling[n] = (p.temperature, p.top_k, p.top_p)
            stop[n, : len(p.stop_token_ids)] = p.stop_token_ids
            n += 1
    return tokens, rows, slots, ids, sampling, stop


def abstract_chunk(bucket: int, n: int, config: EngineConfig) -> tuple[jax.ShapeDtypeStruct, ...]:
    """The shapes and dtypes of `pack_chunk`'s arrays for prompt bucket `bucket` and `n` slots."""
    s = jax.ShapeDtypeStruct
    return (
        s((PREFILL_CHUNK, bucket), np.int32),
        s((n,), np.int32),
        s((n,), np.int32),
        s((n, 7), np.int32),
        s((n, 3), np.float32),
        s((n, config.max_stop_tokens), np.int32),
    )


# ---------------------------------------------------------------------------------------- device


def prefill_rows(model: Transformer, tokens_PxT: jax.Array, dtype: Any) -> tuple[tuple, tuple]:
    """Keys/values (P, T, K, H) per layer of P prompts, in chunks of `PREFILL_CHUNK` prompts.

    A prompt's keys/values must not depend on which prompts share its call (sampling is
    independent of the batch), and a matmul's rounding on XLA:CPU can depend on its row
    count; so every chunk has the same shape (padded with empty prompts) and the chunks go
    through `lax.map`.
    """
    p, t = tokens_PxT.shape
    c = PREFILL_CHUNK
    n = -(-p // c)
    chunks = jnp.pad(tokens_PxT, ((0, n * c - p), (0, 0))).reshape(n, c, t)

    def one(tokens_CxT: jax.Array) -> tuple[tuple, tuple]:
        _, (k, v) = model.prefill(tokens_CxT)
        cast = lambda x: x.astype(dtype)
        return tuple(map(cast, k)), tuple(map(cast, v))

    k, v = jax.lax.map(one, chunks)
    unchunk = lambda x: x.reshape(n * c, *x.shape[2:])[:p]
    return tuple(map(unchunk, k)), tuple(map(unchunk, v))


def prefill_prompt(model: Transformer, tokens_T: jax.Array, dtype: Any) -> tuple[tuple, tuple]:
    """Keys/values (T, K, H) per layer of one padded prompt."""
    k, v = prefill_rows(model, tokens_T[None], dtype)
    return tuple(x[0] for x in k), tuple(x[0] for x in v)


def insert(
    kv: tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]],
    state: DecodeState,
    slots_G: jax.Array,
    samples_G: jax.Array,
    ids: jax.Array,
    sampling: jax.Array,
    stop_ids: jax.Array,
) -> DecodeState:
    """Writes one prefix into slots_G for samples_G (`insert_args`: ids, sampling, stop_ids).

    Everything that varies per request is traced: one compile per (bucket, slot count)."""
    g = slots_G.shape[0]
    prefix_k, prefix_v = kv
    rows = lambda kv: tuple(jnp.broadcast_to(x[None], (g, *x.shape)) for x in kv)
    cache = state.cache.put(slots_G, rows(prefix_k), rows(prefix_v))
    seed, rnd, uid, max_new, length, last_token = (ids[i] for i in range(6))
    base = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), rnd), uid)
    keys_G = jax.vmap(lambda s: jax.random.fold_in(base, s))(samples_G)
    fill = lambda arr, value: arr.at[slots_G].set(value)
    return DecodeState(
        cache=cache,
        tokens=fill(state.tokens, last_token),
        positions=fill(state.positions, length - 1),
        active=fill(state.active, True),
        last_position=fill(state.last_position, length - 1 + max_new),
        keys=state.keys.at[slots_G].set(keys_G),
        temperature=fill(state.temperature, sampling[0]),
        top_k=fill(state.top_k, sampling[1].astype(jnp.int32)),
        top_p=fill(state.top_p, sampling[2]),
        stop_ids=state.stop_ids.at[slots_G].set(
            jnp.broadcast_to(stop_ids[None], (g, stop_ids.shape[0]))
        ),
    )


def insert_rows(
    state: DecodeState,
    kv: tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]],
    rows_N: jax.Array,
    slots_N: jax.Array,
    ids_Nx7: jax.Array,
    sampling_Nx3: jax.Array,
    stop_NxS: jax.Array,
) -> DecodeState:
    """Writes prompt rows_N[i] of `kv` (`prefill_rows`' keys/values of a chunk of prompts) into
    slots_N[i] (out of range: dropped); the arrays are `pack_chunk`'s. No model: the chunk's prefill
    is its own program, compiled once per bucket, and this one is a scatter."""
    k, v = kv
    rows = lambda kv: tuple(x[rows_N] for x in kv)
    cache = state.cache.put(slots_N, rows(k), rows(v))
    seed, rnd, uid, sample, max_new, length, last_token = (ids_Nx7[:, i] for i in range(7))
    keys_N = jax.vmap(
        lambda s, r, u, i: jax.random.fold_in(
            jax.random.fold_in(jax.random.fold_in(jax.random.key(s), r), u), i
        )
    )(seed, rnd, uid, sample)
    fill = lambda arr, value: arr.at[slots_N].set(value, mode="drop")
    return DecodeState(
        cache=cache,
        tokens=fill(state.tokens, last_token),
        positions=fill(state.positions, length - 1),
        active=fill(state.active, True),
        last_position=fill(state.last_position, length - 1 + max_new),
        keys=fill(state.keys, keys_N),
        temperature=fill(state.temperature, sampling_Nx3[:, 0]),
        top_k=fill(state.top_k, sampling_Nx3[:, 1].astype(jnp.int32)),
        top_p=fill(state.top_p, sampling_Nx3[:, 2]),
        stop_ids=fill(state.stop_ids, stop_NxS),
    )
