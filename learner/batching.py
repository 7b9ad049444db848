"""Complete groups -> the train step's arrays: one sequence per row, or several packed.

Sequence i: inputs = (prompt + response)[:-1], targets = (prompt + response)[1:]. The loss mask is
1 exactly where the target is a response token; the behaviour log-probs (the sampler's) sit at the
same positions.
- Unpacked: one sequence per row.
- Packed: several sequences per row, placed first-fit by decreasing length (`first_fit`). A row's
  sequences carry segment ids 1, 2, ... (attention stays within a segment) and positions
  restarting at 0.
  The loss arrays (loss_mask, advantages, behavior_logp) keep an unpacked layout, one sequence per
  row, (sequences, L): `token_index` maps each of their positions to a flat index into the packed
  (rows*L) model arrays, the train step gathers the model's per-token log-probs into that layout
  (`unpack`) and computes the loss and its aggregation on exactly the arrays an unpacked batch
  would give, so every per-sequence aggregation stays exact. Padding positions point at index 0
  and are masked.

The learner's micro-batches take their shapes from a fixed set and are planned by
learner/micro_batches.py; `build` lays sequences out on one of them. `make_batch` builds one batch
of all the given groups with shapes derived from them (tests, benchmarks): unpacked rows padded to
a multiple of `rows` and to the longest's bucket, or packed rows of that bucket.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np

from rl.types import Group


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Batch:
    inputs: np.ndarray  # (B, T) int32
    targets: np.ndarray  # (B, T) int32
    positions: np.ndarray  # (B, T) int32
    segments: np.ndarray  # (B, T) int32: segment id (1, 2, ... per packed sequence), 0 padding
    loss_mask: np.ndarray  # (N, S) float32: 1 where the target is a response token
    advantages: np.ndarray  # (N,) float32
    behavior_logp: np.ndarray  # (N, S) float32: sampler log-probs at loss positions
    # (N, S) int32 flat index into the (B, T) arrays of each sequence position; None: unpacked
    # (N, S) == (B, T), sequence i is row i.
    token_index: np.ndarray | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.loss_mask.sum())

    @property
    def padded_fraction(self) -> float:
        """Share of the model's (B, T) positions that hold no token of any sequence."""
        return 1.0 - float((self.segments > 0).sum()) / self.segments.size


def length_bucket(n: int, minimum: int) -> int:
    b = minimum
    while b < n:
        b *= 2
    return b


def unpack(x_BxT: jax.Array, token_index_NxS: jax.Array) -> jax.Array:
    """Per-token values of packed rows -> one row per sequence (Batch.token_index's layout)."""
    return x_BxT.reshape(-1)[token_index_NxS]


def first_fit(
    lengths: Sequence[int],
    capacity: int,
    *,
    max_bins: int | None = None,
    max_per_bin: int | None = None,
    max_items: int | None = None,
) -> list[list[int]]:
    """First-fit decreasing: bins (lists of indices into `lengths`) of total length <= capacity.

    Longest first (ties by index); each goes into the first bin with room. Deterministic. With
    limits (bins, items per bin, items in all), an item that finds no room is left out.
    """
    if lengths and max(lengths) > capacity:
        raise ValueError(f"first_fit: a length of {max(lengths)} exceeds the capacity {capacity}.")
    bins: list[list[int]] = []
    room: list[int] = []
    placed = 0
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        if max_items is not None and placed == max_items:
            break
        for b, r in enumerate(room):
            if lengths[i] <= r and (max_per_bin is None or len(bins[b]) < max_per_bin):
                bins[b].append(i)
                room[b] -= lengths[i]
                placed += 1
                break
        else:
            if max_bins is None or len(bins) < max_bins:
                bins.append([i])
                room.append(capacity - lengths[i])
                placed += 1
    return bins


@dataclasses.dataclass(frozen=True)
class Seq:
    """One completion as the learner trains it."""

    prompt: tuple[int, ...]
    response: tuple[int, ...]
    logprobs: tuple[float, ...]  # the sampler's, one per response token
    advantage: float
    masked: bool = False  # no loss (the overlong filter's truncated responses)
    observed: tuple[bool, ...] = ()  # response tokens the environment wrote: no loss (rl/envs)

    def __len__(self) -> int:  # the model positions it takes: (prompt + response)[:-1]
        return len(self.prompt) + len(self.response) - 1


def sequences_of(groups: Sequence[Group], advantages: Sequence[Sequence[float]]) -> list[Seq]:
    """Every completion of `groups`, in order, with its advantage (one list per group)."""
    if len(advantages) != len(groups):
        raise ValueError(f"Got {len(advantages)} advantage lists for {len(groups)} groups.")
    seqs = []
    for g, adv in zip(groups, advantages, strict=True):
        if len(adv) != len(g.completions):
            raise ValueError(
                f"Group uid={g.request.uid} has {len(g.completions)} completions but "
                f"{len(adv)} advantages."
            )
        for c, a in zip(g.completions, adv, strict=True):
            if len(c.logprobs) != len(c.tokens):
                raise ValueError(
                    f"Completion uid={c.uid} sample={c.sample}: {len(c.tokens)} tokens but "
                    f"{len(c.logprobs)} log-probs."
                )
            seqs.append(
                Seq(
                    tuple(c.prompt),
                    tuple(c.tokens),
                    tuple(c.logprobs),
                    float(a),
                    observed=c.observation_mask,
                )
            )
    return seqs


def build(
    seqs: Sequence[Seq],
    bins: Sequence[Sequence[int]],
    *,
    rows: int,
    length: int,
    sequences: int,
    pack: bool,
) -> Batch:
    """The Batch of `seqs` placed row by row as `bins` says (indices into `seqs`).

    Model arrays (rows, length); loss arrays (sequences, length), seqs[i] in loss row i. Unpacked
    (`pack` False), bins[r] is [r]: sequence r alone in model row r.
    """
    if len(bins) > rows or len(seqs) > sequences:
        raise ValueError(
            f"build: {len(bins)} rows and {len(seqs)} sequences do not fit a batch of {rows} "
            f"rows and {sequences} sequences."
        )
    out = Batch(
        inputs=np.zeros((rows, length), np.int32),
        targets=np.zeros((rows, length), np.int32),
        positions=np.zeros((rows, length), np.int32),
        segments=np.zeros((rows, length), np.int32),
        loss_mask=np.zeros((sequences, length), np.float32),
        advantages=np.zeros((sequences,), np.float32),
        behavior_logp=np.zeros((sequences, length), np.float32),
        token_index=np.zeros((sequences, length), np.int32) if pack else None,
    )
    for row, members in enumerate(bins):
        offset = 0
        for segment, i in enumerate(members, start=1):
            s = seqs[i]
            tokens = np.asarray(s.prompt + s.response, np.int32)
            n = len(tokens) - 1
            if offset + n > length:
                raise ValueError(
                    f"build: row {row} holds {offset + n} positions; at most {length}."
                )
            span = slice(offset, offset + n)
            out.inputs[row, span] = tokens[:-1]
            out.targets[row, span] = tokens[1:]
            out.positions[row, span] = np.arange(n)
            out.segments[row, span] = segment
            if pack:
                out.token_index[i, :n] = row * length + offset + np.arange(n)
            if not s.masked:
                out.loss_mask[i, len(s.prompt) - 1 : n] = 1.0
                if s.observed:  # observation tokens are inputs, never targets of the loss
                    out.loss_mask[i, len(s.prompt) - 1 : n][np.asarray(s.observed)] = 0.0
            out.behavior_logp[i, len(s.prompt) - 1 : n] = s.logprobs
            out.advantages[i] = s.advantage
            offset += n
    return out


def make_batch(
    groups: Sequence[Group],
    advantages: Sequence[Sequence[float]],
    *,
    rows: int,
    min_length_bucket: int = 32,
    pack: bool = False,
    row_multiple: int = 1,
) -> Batch:
    """One Batch of every completion of `groups`, its shapes derived from them (module docstring).

    Args:
      groups: complete groups.
      advantages: one advantage per completion, group by group.
      rows: the sequence count is padded up to a multiple of this (padding sequences have an
        all-zero mask); unpacked, that is the row count.
      min_length_bucket: smallest sequence-length bucket.
      pack: pack several sequences per model row (rows of the longest sequence's bucket).
      row_multiple: packed: the row count is a multiple of this (the mesh's batch shards).
    """
    if not groups:
        raise ValueError("make_batch received an empty group list; expected at least one group.")
    if min(rows, row_multiple, min_length_bucket) < 1:
        raise ValueError(
            "make_batch: rows, row_multiple and min_length_bucket must be >= 1; received "
            f"{rows}, {row_multiple}, {min_length_bucket}."
        )
    seqs = sequences_of(groups, advantages)
    if not any(s.response for s in seqs):
        raise ValueError(
            f"make_batch: the {len(seqs)} completions hold no response tokens; nothing to train on."
        )
    n_seq = -(-len(seqs) // rows) * rows
    t = length_bucket(max(map(len, seqs)), min_length_bucket)
    if pack:
        bins = first_fit([len(s) for s in seqs], t)
        n_rows = -(-len(bins) // row_multiple) * row_multiple
    else:
        bins, n_rows = [[i] for i in range(len(seqs))], n_seq
    return build(seqs, bins, rows=n_rows, length=t, sequences=n_seq, pack=pack)
