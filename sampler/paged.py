"""The paged KV cache's host side: which pages each slot holds, and who waits when they run out.

The device side is rl/models/kv_cache.py's `PagedKVCache`: a pool of pages per layer and a block
table (slots, width) naming the page of each slot's positions [j * page, (j + 1) * page); an
entry equal to the pool's size means "no page". `PagePool` owns that table on the host and the
engine copies it to the device before a program reads it (`dirty`).

  * A sequence starting at length L (a prompt, or a prompt and its tokens so far) gets the pages
    of positions 0..L-1. Started as a group (one request's G samples admitted together), the pages
    wholly before position L-1 are the group's: written once by its shared prefill (every sample
    writes the same floats), held by all G slots, reference-counted, never copied. The page of
    position L-1 is each sample's own, since its first decode step rewrites L-1 and then diverges.
  * A running sequence gets pages as it grows: before a generate call of k steps, every running
    slot holds the pages of the positions that call writes.
  * When the pool runs short, the youngest running sequences (the most recently started) are
    preempted: swapped out (their cache rows and sampling state copied to the host, their pages
    released) and swapped back in, oldest first, once their pages fit again with a page of growth
    left for every running sequence. A swapped sequence resumes exactly where it stopped: the
    same floats, the same random stream, so preemption changes no token (vLLM recomputes instead;
    a recomputed prefill rounds differently from decoding, so its tokens would change).
  * New sequences are admitted only when nothing is swapped out and their pages fit
    (`admission_budget`), so an admission never preempts.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np


@dataclasses.dataclass
class Swapped:
    """A preempted sequence: its exported state on the host and what it needs to come back."""

    order: int  # when it started (older first)
    state: Any  # its SlotState (sampler/slot_export.py), host arrays
    written: int  # positions 0..written-1 hold its KV


class PagePool:
    """Pages of `page` positions, `pages` in all, for `slots` slots of at most `width` pages."""

    def __init__(self, *, pages: int, page: int, slots: int, width: int):
        self.pages, self.page, self.width = pages, page, width
        self.table = np.full((slots, width), pages, np.int32)
        self.held = np.zeros((slots,), np.int64)  # pages in each slot's row (a prefix of it)
        self.refs = np.zeros((pages,), np.int64)
        self._free = list(range(pages - 1, -1, -1))  # pop() hands out the lowest page first
        self.order: dict[int, int] = {}  # slot -> when its sequence started
        self.swapped: dict[int, Swapped] = {}
        self._started = 0
        self.dirty = True  # the table changed since the device last got it
        self.preemptions = 0
        self.shared_pages = 0  # pages a group's samples hold together (over every start)

    # ----------------------------------------------------------------------------------- sizes

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return self.pages - len(self._free)

    def pages_for(self, positions: int) -> int:
        """Pages that positions 0..positions-1 span."""
        return -(-positions // self.page)

    def start_cost(self, length: int, samples: int) -> int:
        """Pages `samples` samples of one prompt of `length` tokens take when started together."""
        return self.group_cost(length, samples, self.page)

    @staticmethod
    def group_cost(length: int, samples: int, page: int) -> int:
        """`start_cost` for pages of `page` positions."""
        shared = (length - 1) // page
        return shared + samples * (-(-length // page) - shared)

    def need(self, slot: int, positions: int) -> int:
        """Pages `slot` lacks to hold positions 0..positions-1."""
        return max(0, self.pages_for(positions) - int(self.held[slot]))

    def reclaim(self, slot: int) -> int:
        """Pages freed if `slot` released its pages now (those no other slot holds)."""
        row = self.table[slot, : self.held[slot]]
        return int(np.sum(self.refs[row] == 1))

    # ---------------------------------------------------------------------------------- changes

    def _take(self) -> int:
        page = self._free.pop()
        self.refs[page] = 1
        return page

    def start(self, slots: list[int] | tuple[int, ...], length: int, *, order: int | None = None):
        """`slots` (free: holding no page) start sequences whose positions 0..length-1 are
        written now, sharing the pages wholly before position length-1 (module docstring).
        `order`: keep that start time (a sequence re-prefilled in place); None: now."""
        if length > self.width * self.page:
            raise ValueError(
                f"PagePool.start: {length} positions exceed a slot's {self.width} pages of "
                f"{self.page}."
            )
        if self.start_cost(length, len(slots)) > self.free:
            raise RuntimeError(
                f"PagePool.start: {self.start_cost(length, len(slots))} pages needed, "
                f"{self.free} free (the caller makes room first)."
            )
        shared = [self._take() for _ in range((length - 1) // self.page)]
        for page in shared:
            self.refs[page] = len(slots)
        if len(slots) > 1:
            self.shared_pages += len(shared)
        for slot in slots:
            if self.held[slot]:
                raise RuntimeError(f"PagePool.start: slot {slot} still holds pages.")
            own = [self._take() for _ in range(self.pages_for(length) - len(shared))]
            row = shared + own
            self.table[slot, : len(row)] = row
            self.held[slot] = len(row)
            if order is None:
                self._started += 1
            self.order[slot] = self._started if order is None else order
        self.dirty = True

    def grow(self, slot: int, positions: int) -> None:
        """`slot` holds the pages of positions 0..positions-1 (the caller made room)."""
        n = self.need(slot, positions)
        if n > self.free:
            raise RuntimeError(f"PagePool.grow: slot {slot} needs {n} pages, {self.free} free.")
        for _ in range(n):
            self.table[slot, self.held[slot]] = self._take()
            self.held[slot] += 1
        if n:
            self.dirty = True

    def release(self, slot: int) -> None:
        """`slot` lets go of its pages (a page is free once no slot holds it); its sequence
        and any swapped-out copy of it are forgotten."""
        for page in self.table[slot, : self.held[slot]]:
            self.refs[page] -= 1
            if self.refs[page] == 0:
                self._free.append(int(page))
        if self.held[slot]:
            self.table[slot] = self.pages
            self.held[slot] = 0
            self.dirty = True
        self.order.pop(slot, None)
        self.swapped.pop(slot, None)

    # -------------------------------------------------------------------------------- decisions

    def youngest(self, running: set[int]) -> int:
        """The running slot whose sequence started last (the first to preempt)."""
        return max(running, key=lambda s: self.order[s])

    def admission_budget(self) -> int:
        """Pages new sequences may take now: none while a sequence waits swapped out (it comes
        back first), else the free pages less a page of growth per running sequence."""
        if self.swapped:
            return 0
        return max(0, self.free - len(self.order))

    def resumable(self, running: int) -> list[int]:
        """Swapped-out slots to bring back now, oldest first, while each fits with a page of
        growth left for every running sequence (`running` of them, and those resumed)."""
        out, free = [], self.free
        for slot in sorted(self.swapped, key=lambda s: self.swapped[s].order):
            need = self.pages_for(self.swapped[slot].written + 1)
            if need + running + len(out) + 1 > free:
                break
            out.append(slot)
            free -= need
        return out

    def check(self) -> None:
        """Raises if the books disagree: every page held as often as counted, free pages held by
        no slot (a test's invariant)."""
        counts = np.zeros_like(self.refs)
        for slot, n in enumerate(self.held):
            np.add.at(counts, self.table[slot, :n], 1)
        if not np.array_equal(counts, self.refs):
            raise AssertionError("PagePool: reference counts disagree with the table.")
        free = set(self._free)
        if len(free) != len(self._free) or any(self.refs[p] for p in free):
            raise AssertionError("PagePool: a free page is held or listed twice.")
        if len(free) + int(np.sum(self.refs > 0)) != self.pages:
            raise AssertionError("PagePool: a page is neither free nor held (leaked).")
