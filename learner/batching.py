"""Complete groups -> arrays for the train step: one completion per row, or packed rows.

Sequence i: inputs = (prompt + response)[:-1], targets = (prompt + response)[1:]. The loss mask is
1 exactly where the target is a response token; the behaviour log-probs (the sampler's) sit at the
same positions.

Unpacked (`pack=False`): row i of every array holds sequence i; lengths pad to a power-of-two bucket
T and rows to a multiple of `rows`, so the step compiles once per bucket.

Packed (`pack=True`): the model arrays (inputs, targets, positions, segments) hold several
sequences per row, placed first-fit by decreasing length; a row's sequences carry segment ids
1, 2, ... (attention stays within a segment) and positions restarting at 0. The loss arrays
(loss_mask, advantages, behavior_logp) keep the unpacked layout, one sequence per row, and
`token_index` maps each of their positions to a flat index into the packed (B*T) model arrays: the
train step gathers the model's per-token log-probs into that layout (`unpack`) and computes the
loss and its aggregation on exactly the arrays an unpacked batch would give, so every
per-sequence aggregation stays exact. Padding positions point at index 0 and are masked.
The packed row length is chosen from quarter-octave multiples of T up to 4T (at most
`max_pack_length`, never below T) and the row count from multiples of `row_multiple` in
quarter-octave steps (1..8, 10, 12, 14, 16, 20, ... times it), whichever gives the smallest padded
area: a bounded set of shapes, so a bounded number of compiles.
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


def first_fit(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """First-fit decreasing: bins (lists of indices into `lengths`) of total length <= capacity.

    Longest first (ties by index); each goes into the first bin with room. Deterministic.
    """
    if lengths and max(lengths) > capacity:
        raise ValueError(f"first_fit: a length of {max(lengths)} exceeds the capacity {capacity}.")
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for b, r in enumerate(room):
            if lengths[i] <= r:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(capacity - lengths[i])
    return bins


def _row_ladder(n: int, multiple: int) -> int:
    """The smallest of multiple x {1, 2, ..., 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, ...} >= n."""
    k, step = 1, 1
    while k * multiple < n:
        k += step
        if k >= 8 * step:  # four steps per octave from 4 on
            step *= 2
    return k * multiple


# Packed row lengths, as multiples of the longest sequence's bucket T: quarter octaves up to 4T.
_ROW_LENGTHS = ((1, 1), (5, 4), (3, 2), (7, 4), (2, 1), (5, 2), (3, 1), (7, 2), (4, 1))


def _pack_layout(
    lengths: Sequence[int], t: int, max_rows: int, row_multiple: int, max_pack_length: int
) -> tuple[int, int, list[list[int]]]:
    """(row length, row count, bins) with the smallest padded area; ties go to the shorter row.

    The row count is at most `max_rows` (rounded up to `row_multiple`) where the bins fit.
    """
    best = None
    for num, den in _ROW_LENGTHS:
        cap = t * num // den
        if cap > max(t, max_pack_length) or cap * den != t * num:
            continue
        bins = first_fit(lengths, cap)
        rows = min(_row_ladder(len(bins), row_multiple), max(max_rows, len(bins)))
        rows = -(-rows // row_multiple) * row_multiple
        key = (rows * cap, cap)
        if best is None or key < best[0]:
            best = (key, cap, rows, bins)
    assert best is not None  # cap = t always qualifies
    return best[1], best[2], best[3]


def make_batch(
    groups: Sequence[Group],
    advantages: Sequence[Sequence[float]],
    *,
    rows: int,
    min_length_bucket: int = 32,
    pack: bool = False,
    row_multiple: int = 1,
    max_pack_length: int = 2048,
) -> Batch:
    """Turns the completions of `groups` into a Batch (see the module docstring).

    Args:
      groups: complete groups.
      advantages: one advantage per completion, group by group.
      rows: the sequence count is padded up to a multiple of this (padding sequences have an
        all-zero mask); unpacked, that is the row count.
      min_length_bucket: smallest sequence-length bucket.
      pack: pack several sequences per model row.
      row_multiple: packed: the row count is a multiple of this (the mesh's batch shards).
      max_pack_length: packed: rows longer than the longest sequence's bucket stay within this.
    """
    if not groups:
        raise ValueError("make_batch received an empty group list; expected at least one group.")
    if len(advantages) != len(groups):
        raise ValueError(f"Got {len(advantages)} advantage lists for {len(groups)} groups.")
    if min(rows, row_multiple, min_length_bucket, max_pack_length) < 1:
        raise ValueError(
            "make_batch: rows, row_multiple, min_length_bucket and max_pack_length must be >= 1; "
            f"received {rows}, {row_multiple}, {min_length_bucket}, {max_pack_length}."
        )
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
            seqs.append((c.prompt, c.tokens, c.logprobs, a))
    if not any(tokens for _, tokens, _, _ in seqs):
        raise ValueError(
            f"make_batch: the {len(seqs)} completions hold no response tokens; nothing to train on."
        )
    n_seq = -(-len(seqs) // rows) * rows
    lengths = [len(p) + len(r) - 1 for p, r, _, _ in seqs]
    t = length_bucket(max(lengths), min_length_bucket)
    if pack:
        row_len, n_rows, bins = _pack_layout(lengths, t, n_seq, row_multiple, max_pack_length)
    else:
        row_len, bins, n_rows = t, [[i] for i in range(len(seqs))], n_seq
    out = Batch(
        inputs=np.zeros((n_rows, row_len), np.int32),
        targets=np.zeros((n_rows, row_len), np.int32),
        positions=np.zeros((n_rows, row_len), np.int32),
        segments=np.zeros((n_rows, row_len), np.int32),
        loss_mask=np.zeros((n_seq, t), np.float32),
        advantages=np.zeros((n_seq,), np.float32),
        behavior_logp=np.zeros((n_seq, t), np.float32),
        token_index=np.zeros((n_seq, t), np.int32) if pack else None,
    )
    for row, members in enumerate(bins):
        offset = 0
        for segment, i in enumerate(members, start=1):
            prompt, response, logprobs, adv = seqs[i]
            seq = np.asarray(prompt + response, np.int32)
            n = len(seq) - 1
            span = slice(offset, offset + n)
            out.inputs[row, span] = seq[:-1]
            out.targets[row, span] = seq[1:]
            out.positions[row, span] = np.arange(n)
            out.segments[row, span] = segment
            if pack:
                out.token_index[i, :n] = row * row_len + offset + np.arange(n)
            start = len(prompt) - 1
            out.loss_mask[i, start:n] = 1.0
            out.behavior_logp[i, start:n] = logprobs
            out.advantages[i] = adv
            offset += n
    return out
