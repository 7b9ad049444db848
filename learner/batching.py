"""Complete groups -> arrays for the train step, on a fixed set of shapes (a compile budget).

Sequence i: inputs = (prompt + response)[:-1], targets = (prompt + response)[1:]. The loss mask is
1 exactly where the target is a response token; the behaviour log-probs (the sampler's) sit at the
same positions.

The learner's micro-batches (`MicroBatches`) take every shape from a small set fixed by the config,
so a run compiles its train step for each of them once, at start, and never after. A micro-batch
is a fixed token budget, `rows` x the longest length, in rows of a length L from the ladder
`lengths` (powers of two from `min_length_bucket` up to the bucket of the longest prompt +
response a run can give), `rows` x longest / L of them (rows double as L halves); it is formed
once the pending sequences fill it, in rows of the smallest L that holds the longest of them.
An update's last micro-batch holds what is left, often far less than the budget: with `halvings`
k it may take 1/2, ..., 1/2^k of the budget instead, in `rows` / 2^j rows of the longest length
(the smallest that holds it): k more compiled programs, a smaller padded area.
- Unpacked (`pack=False`): one sequence per row, the longest pending first.
- Packed (`pack=True`): several sequences per row, placed first-fit by decreasing length. A row's
  sequences carry segment ids 1, 2, ... (attention stays within a segment) and positions
  restarting at 0.
  The loss arrays (loss_mask, advantages, behavior_logp) keep an unpacked layout, one sequence per
  row, (`MicroBatches.sequences(L)`, L): `token_index` maps each of their positions to a flat index
  into the packed (rows*L) model arrays, the train step gathers the model's per-token log-probs
  into that layout (`unpack`) and computes the loss and its aggregation on exactly the arrays an
  unpacked batch would give, so every per-sequence aggregation stays exact. Padding positions
  point at index 0 and are masked.
The learner plans after every group it is given, so what a micro-batch holds depends only on the
order of the groups, never on how they were handed over (one at a time or all at once): pipelined
and synchronous runs form the same micro-batches.

`make_batch` builds one batch of all the given groups with shapes derived from them (tests,
benchmarks): unpacked rows padded to a multiple of `rows` and to the longest's bucket, or packed
rows of that bucket.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

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


class Shape(NamedTuple):
    """A micro-batch's model arrays: `rows` rows of `length` positions."""

    length: int
    rows: int


@dataclasses.dataclass(frozen=True)
class MicroBatches:
    """The learner's micro-batch shapes, a fixed set, and the plan that fills them (module doc).

    Attributes:
      rows: model rows of a micro-batch of the longest length (config.learner.micro_batch_rows);
        shorter rows come in more rows, to the same tokens (`rows_for`).
      lengths: the row lengths, ascending: powers of two from min_length_bucket up to the bucket of
        max_positions (the longest sequence a run can give the learner: prompt + response - 1).
      pack: several sequences per row.
      halvings: an update's last micro-batch may take `rows` / 2^j rows of the longest length,
        j <= halvings (config.learner.flush_halvings), where that is a whole multiple of
        `row_multiple` (the learner's own mesh's batch shards).
    """

    rows: int
    lengths: tuple[int, ...]
    pack: bool
    halvings: int = 0
    row_multiple: int = 1

    @classmethod
    def from_config(
        cls,
        *,
        rows: int,
        min_length_bucket: int,
        max_positions: int,
        pack: bool,
        halvings: int = 0,
        row_multiple: int = 1,
    ) -> MicroBatches:
        """`max_positions`: the longest sequence's model positions (max prompt + response - 1)."""
        if min(rows, min_length_bucket, max_positions, row_multiple) < 1 or halvings < 0:
            raise ValueError(
                "MicroBatches: rows, min_length_bucket, max_positions and row_multiple must be "
                f">= 1 and halvings >= 0; received {rows}, {min_length_bucket}, {max_positions}, "
                f"{row_multiple}, {halvings}."
            )
        top = length_bucket(max_positions, min_length_bucket)
        lengths, b = [], min_length_bucket
        while b <= top:
            lengths.append(b)
            b *= 2
        return cls(
            rows=rows,
            lengths=tuple(lengths),
            pack=pack,
            halvings=halvings,
            row_multiple=row_multiple,
        )

    def rows_for(self, length: int) -> int:
        """Model rows of a micro-batch of rows of `length`: as many as make `rows` x the longest
        length, a fixed token budget (rows double as the length halves)."""
        return self.rows * self.lengths[-1] // length

    def flush_rows(self, shards: int = 1) -> list[int]:
        """The last micro-batch's smaller row counts in rows of the longest length, smallest
        first: `rows` / 2^j for j = halvings .. 1, those whole multiples of `row_multiple` (what
        the plan uses) and of `shards` (a mesh's batch shards: what runs there)."""
        return [
            self.rows >> j
            for j in range(self.halvings, 0, -1)
            if self.rows % (1 << j) == 0
            and (self.rows >> j) % self.row_multiple == 0
            and (self.rows >> j) % shards == 0
        ]

    def shapes(self, shards: int = 1) -> list[Shape]:
        """Every micro-batch shape a run can form on a mesh of `shards` batch shards (what is
        compiled ahead there)."""
        full = [Shape(length, self.rows_for(length)) for length in self.lengths]
        return full + [Shape(self.lengths[-1], r) for r in self.flush_rows(shards)]

    def on(self, shape: Shape, shards: int) -> Shape:
        """`shape` on a mesh of `shards` batch shards: a flush shape whose rows they do not
        divide (a borrowed mesh's) takes the full budget's rows of that length, the same bins."""
        return (
            shape if shape.rows % shards == 0 else Shape(shape.length, self.rows_for(shape.length))
        )

    def sequences(self, shape: Shape) -> int:
        """Sequences a micro-batch of `shape` holds at most (the loss layout's rows): unpacked,
        one per row; packed, up to one per 16 positions, at most 8 per row."""
        return shape.rows * (min(8, max(1, shape.length // 16)) if self.pack else 1)

    def length_for(self, n: int) -> int:
        """The shortest row length that holds a sequence of `n` positions."""
        for length in self.lengths:
            if n <= length:
                return length
        raise ValueError(
            f"A sequence of {n} positions (prompt + response - 1) is longer than the learner's "
            f"longest row ({self.lengths[-1]}); expected a learner.max_length (a run sets it to "
            "config.engine.max_length) that holds every prompt + response."
        )

    def _fit(self, pending: Sequence[int], shape: Shape) -> list[list[int]]:
        return first_fit(
            pending,
            shape.length,
            max_bins=shape.rows,
            max_per_bin=None if self.pack else 1,
            max_items=self.sequences(shape),
        )

    def plan(self, lengths: Sequence[int], *, final: bool) -> list[tuple[Shape, list[list[int]]]]:
        """The micro-batches to form now from pending sequences of these `lengths` (in order).

        Returns (shape, bins of indices into `lengths`) per micro-batch; indices in no bin stay
        pending. A micro-batch is formed once the pending sequences no longer all fit in one
        (or for whatever is left when `final`: the update), in rows of the shortest length that
        holds the longest of them. (Longer rows would pack better but attend over more
        positions: on near-uniform lengths they made packing 0.83x unpacked, the shortest 1.04x.)
        The last, when `final`, takes the smallest flush shape that holds what is left, if any.
        """
        out: list[tuple[Shape, list[list[int]]]] = []
        left = list(range(len(lengths)))
        while left:
            pending = [lengths[i] for i in left]
            length = self.length_for(max(pending))
            shape = Shape(length, self.rows_for(length))
            bins = self._fit(pending, shape)
            if sum(map(len, bins)) == len(left):
                if not final:
                    break  # they all fit in one micro-batch: wait for more
                for rows in self.flush_rows():  # the update's last: the smallest that holds it
                    flush = Shape(self.lengths[-1], rows)
                    fit = self._fit(pending, flush)
                    if sum(map(len, fit)) == len(left):
                        shape, bins = flush, fit
                        break
            out.append((shape, [[left[j] for j in b] for b in bins]))
            chosen = {left[j] for b in bins for j in b}
            left = [i for i in left if i not in chosen]
        return out

    def batch(self, seqs: Sequence[Seq], shape: Shape, bins: Sequence[Sequence[int]]) -> Batch:
        """The micro-batch of `seqs` placed as `plan` said (bins index `seqs`), on its shape.

        Its sequences are taken in placement order: loss row k holds the k-th placed."""
        chosen = [seqs[i] for b in bins for i in b]
        starts = np.cumsum([0] + [len(b) for b in bins])
        placed = [list(range(starts[r], starts[r + 1])) for r in range(len(bins))]
        return build(
            chosen,
            placed,
            rows=shape.rows,
            length=shape.length,
            sequences=self.sequences(shape),
            pack=self.pack,
        )

    def abstract(self, shape: Shape) -> Batch:
        """The micro-batch of `shape` as shapes and dtypes (for compiling ahead)."""
        model = jax.ShapeDtypeStruct((shape.rows, shape.length), np.int32)
        n = self.sequences(shape)
        loss = jax.ShapeDtypeStruct((n, shape.length), np.float32)
        return Batch(
            inputs=model,
            targets=model,
            positions=model,
            segments=model,
            loss_mask=loss,
            advantages=jax.ShapeDtypeStruct((n,), np.float32),
            behavior_logp=loss,
            token_index=jax.ShapeDtypeStruct((n, shape.length), np.int32) if self.pack else None,
        )


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
