"""The learner's micro-batches: a fixed set of shapes (a compile budget) and the plan that fills them.

Every shape comes from a small set fixed by the config, so a run compiles its train step for each
of them once, at start, and never after. A micro-batch is a fixed token budget, `rows` x the
longest length, in rows of a length L from the ladder `lengths` (powers of two from
`min_length_bucket` up to the bucket of the longest prompt + response a run can give), `rows` x
longest / L of them (rows double as L halves); it is formed once the pending sequences fill it, in
rows of the smallest L that holds the longest of them. An update's last micro-batch holds what is
left, often far less than the budget: with `halvings` k it may take any whole multiple of 1/2^k of
the budget instead (1/2 for k = 1; 1/4, 1/2, 3/4 for k = 2), in rows of the longest length (the
smallest that holds it): 2^k - 1 more compiled programs, its padding under 1/2^k of the budget
where a whole number of rows holds what is left. Unpacked (`pack=False`) a row holds one
sequence, packed several (learner/batching.py lays them out).

The learner plans after every group it is given, so what a micro-batch holds depends only on the
order of the groups, never on how they were handed over (one at a time or all at once): pipelined
and synchronous runs form the same micro-batches.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

import jax
import numpy as np

from learner.batching import Batch, Seq, build, first_fit, length_bucket


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
      halvings: an update's last micro-batch may take m x `rows` / 2^halvings rows of the
        longest length, 0 < m < 2^halvings (config.learner.flush_halvings: the budget halved that
        many times is the step), where that is a whole number of rows and a multiple of
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
        first: m x `rows` / 2^halvings for 0 < m < 2^halvings, those whole numbers and whole
        multiples of `row_multiple` (what the plan uses) and of `shards` (a mesh's batch shards:
        what runs there)."""
        parts = 1 << self.halvings
        return [
            m * self.rows // parts
            for m in range(1, parts)
            if m * self.rows % parts == 0
            and (m * self.rows // parts) % self.row_multiple == 0
            and (m * self.rows // parts) % shards == 0
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
