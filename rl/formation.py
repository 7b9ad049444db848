"""Batch formation: which complete groups make up each optimizer step. Pure and clock-free.

The learner (and the simulator) feed groups in the order they come off the queue; a former returns
the batches that are ready. Two orders:

- `fifo`: completion order (as the RolloutPipe paper): a batch is the next `size` groups to finish.
- `ordered`: logical order: batch k holds the groups with `request.index` in
  [start + k*size, start + (k+1)*size), released only after batch k-1, so the learner sees exactly
  the batches of the synchronous baseline (frontier-group dispatch makes them finish first).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from rl.registry import Registry
from rl.types import Group


class BatchFormer(Protocol):
    def add(self, group: Group) -> list[tuple[Group, ...]]:
        """Takes one complete group; returns the batches it completed, in release order."""

    def flush(self) -> tuple[Group, ...] | None:
        """Returns the buffered groups as a final partial batch, or None if none are buffered."""

    @property
    def pending(self) -> int:
        """Number of groups taken but not yet released in a batch."""


def _check(size: int, num_groups: int | None, start: int = 0) -> None:
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"Batch size must be an int >= 1; received {size!r}.")
    if num_groups is not None and (not isinstance(num_groups, int) or num_groups < 0):
        raise ValueError(f"num_groups must be None or an int >= 0; received {num_groups!r}.")
    if not isinstance(start, int) or start < 0:
        raise ValueError(f"start must be an int >= 0; received {start!r}.")


class FifoBatches:
    """Completion-order batches: every `size` groups taken form the next batch.

    Args:
        size: groups per batch (U, the groups per optimizer step).
        num_groups: if given, the round's total: the last batch is released when the
            `num_groups`-th group arrives, smaller if `num_groups % size`; a group past it raises.
    """

    def __init__(self, size: int, num_groups: int | None = None) -> None:
        _check(size, num_groups)
        self.size, self.num_groups = size, num_groups
        self._buf: list[Group] = []
        self._taken = 0

    def add(self, group: Group) -> list[tuple[Group, ...]]:
        if self.num_groups is not None and self._taken >= self.num_groups:
            raise ValueError(
                f"Group (round, uid)={group.request.key} arrived after all {self.num_groups} "
                "groups of the round; expected no more."
            )
        self._buf.append(group)
        self._taken += 1
        if len(self._buf) == self.size or self._taken == self.num_groups:
            return [self._release()]
        return []

    def flush(self) -> tuple[Group, ...] | None:
        return self._release() if self._buf else None

    @property
    def pending(self) -> int:
        return len(self._buf)

    def _release(self) -> tuple[Group, ...]:
        batch, self._buf = tuple(self._buf), []
        return batch


class OrderedBatches:
    """Logical-order batches: batch k is indices [start + k*size, start + (k+1)*size), in order.

    Groups may arrive in any order; each batch is released, sorted by index, once all its groups
    have arrived and every earlier batch has been released. One former serves one round.

    Args:
        size: groups per batch (U).
        num_groups: the round's number of groups, if known; when it is not a multiple of `size`
            the last batch is smaller. None: the round is open-ended (end it with `flush`).
        start: the index of batch 0's first group (e.g. to resume mid-round).
    """

    def __init__(self, size: int, num_groups: int | None = None, start: int = 0) -> None:
        _check(size, num_groups, start)
        self.size, self.num_groups, self.start = size, num_groups, start
        self._end = None if num_groups is None else start + num_groups
        self._next = start  # first index of the next batch to release
        self._buf: dict[int, Group] = {}
        self._round: int | None = None

    @property
    def next_index(self) -> int:
        """The first index of the next unreleased batch (a `start` to resume from)."""
        return self._next

    @property
    def pending(self) -> int:
        return len(self._buf)

    def add(self, group: Group) -> list[tuple[Group, ...]]:
        i, key = group.request.index, group.request.key
        if self._round is None:
            self._round = group.request.round
        elif group.request.round != self._round:
            raise ValueError(
                f"Group (round, uid)={key} is from round {group.request.round}; this former "
                f"serves round {self._round} (use one former per round)."
            )
        if i < self.start or (self._end is not None and i >= self._end):
            raise ValueError(
                f"Group (round, uid)={key} has index {i}; expected {self.start} <= index < "
                f"{'inf' if self._end is None else self._end}."
            )
        if i < self._next:
            raise ValueError(
                f"Group (round, uid)={key} has index {i}, whose batch was already released "
                f"(indices < {self._next}); a duplicate or late group."
            )
        if i in self._buf:
            raise ValueError(
                f"Duplicate index {i}: group (round, uid)={key} arrived while "
                f"{self._buf[i].request.key} with the same index is buffered."
            )
        self._buf[i] = group
        batches = []
        while (hi := self._batch_end()) > self._next and all(
            j in self._buf for j in range(self._next, hi)
        ):
            batches.append(self._release(hi))
        return batches

    def flush(self) -> tuple[Group, ...] | None:
        """Releases the buffered groups as the (partial) next batch, or None if none are buffered.

        Raises:
            ValueError: the buffered groups are not a gap-free run from `next_index` (a group
                before one of them never arrived).
        """
        if not self._buf:
            return None
        missing = [j for j in range(self._next, max(self._buf)) if j not in self._buf]
        if missing:
            raise ValueError(
                f"flush() with {len(missing)} groups missing (indices {missing[:8]}...) before "
                f"buffered index {max(self._buf)}; expected a gap-free run from {self._next}."
            )
        return self._release(self._batch_end())

    def _batch_end(self) -> int:
        hi = self._next + self.size
        return hi if self._end is None else min(hi, self._end)

    def _release(self, hi: int) -> tuple[Group, ...]:
        batch = tuple(self._buf.pop(j) for j in sorted(j for j in self._buf if j < hi))
        self._next = hi
        return batch


def logical_batches(groups: list[Group], size: int) -> list[tuple[Group, ...]]:
    """The synchronous baseline's batches: a whole round's groups in logical order (by
    `request.index`), `size` at a time (the last one smaller if `size` does not divide them)."""
    _check(size, None)
    done = sorted(groups, key=lambda g: g.request.index)
    return [tuple(done[k : k + size]) for k in range(0, len(done), size)]


MakeFormer = Callable[[int, "int | None"], BatchFormer]
FORMERS: Registry[MakeFormer] = Registry("batch former")
FORMERS.update(fifo=FifoBatches, ordered=OrderedBatches)


def register_former(name: str) -> Callable[[MakeFormer], MakeFormer]:
    """Decorator: registers a batch former factory `(size, num_groups) -> BatchFormer` under a new
    `name`; a config's `batching` field then names it and every runtime's cgp schedule uses it."""

    def decorator(factory: MakeFormer) -> MakeFormer:
        if name in FORMERS:
            raise ValueError(f"Batch former {name!r} is already registered; expected a new name.")
        FORMERS[name] = factory
        return factory

    return decorator


def make_former(name: str, size: int, num_groups: int | None = None) -> BatchFormer:
    """Builds a batch former by name.

    Args:
        name: "fifo" (completion order), "ordered" (logical order) or a registered name.
        size: groups per batch (U).
        num_groups: the round's number of groups, if known (the last batch may be smaller).
    """
    return FORMERS.get(name)(size, num_groups)  # an unknown name: a ValueError naming the known
