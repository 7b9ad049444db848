"""Admission policies: which waiting request the sampler starts next. Pure and clock-free.

The sampler loop (and the simulator) call `next(free_slots)` whenever slots are free; a request is
admitted only whole (all G samples of its group at once, one shared prefill).
"""

from __future__ import annotations

import collections
import heapq
from collections.abc import Callable, Container, Iterable
from typing import Protocol

import numpy as np

from rl.registry import Registry
from rl.types import Request


class AdmissionPolicy(Protocol):
    def submit(self, requests: Iterable[Request]) -> None:
        """Adds requests to the waiting set."""

    def next(self, free_slots: int) -> Request | None:
        """Removes and returns the request to admit now, or None if none should start."""

    def remove(self, key: tuple[int, int]) -> Request | None:
        """Removes a waiting request by (round, uid); returns it, or None if it is not waiting."""

    def __len__(self) -> int:
        """Number of waiting requests."""

    def sequences(self) -> int:
        """Samples of the waiting requests (the slots they need)."""


class FCFS:
    """First come, first served: submission order; the head waits until its group fits."""

    def __init__(self) -> None:
        self._waiting: collections.OrderedDict[tuple[int, int], Request] = collections.OrderedDict()

    def submit(self, requests: Iterable[Request]) -> None:
        requests = _check_new(requests, self._waiting)
        for r in requests:
            self._waiting[r.key] = r

    def next(self, free_slots: int) -> Request | None:
        if not self._waiting:
            return None
        head = next(iter(self._waiting.values()))
        if head.group_size > free_slots:
            return None
        return self._waiting.pop(head.key)

    def remove(self, key: tuple[int, int]) -> Request | None:
        return self._waiting.pop(key, None)

    def __len__(self) -> int:
        return len(self._waiting)

    def sequences(self) -> int:
        return sum(r.group_size for r in self._waiting.values())


class Frontier:
    """Frontier-group dispatch (RolloutPipe FGD): logical order, not submission order.

    Waiting requests are ordered by (round, index), ties by submission order. `next` returns the
    earliest one if its whole group fits in `free_slots`, else None: the free slots are kept for
    the frontier and later groups never jump ahead of it, so the groups the next training batch
    needs start first.

    With one engine and requests submitted in logical order this equals `fcfs`. It differs when
    submissions arrive out of logical order: several rounds in flight, aborted or resubmitted
    prompts, or a round submitted in another order (e.g. longest prompt first).
    O(log n) per operation (a heap; removed requests are dropped lazily).
    """

    def __init__(self) -> None:
        self._waiting: dict[tuple[int, int], tuple[int, Request]] = {}  # key -> (seq, request)
        self._heap: list[tuple[int, int, int, tuple[int, int]]] = []  # (round, index, seq, key)
        self._seq = 0

    def submit(self, requests: Iterable[Request]) -> None:
        requests = _check_new(requests, self._waiting)
        for r in requests:
            self._waiting[r.key] = (self._seq, r)
            heapq.heappush(self._heap, (r.round, r.index, self._seq, r.key))
            self._seq += 1

    def next(self, free_slots: int) -> Request | None:
        head = self._head()
        if head is None or head.group_size > free_slots:
            return None
        heapq.heappop(self._heap)
        return self._waiting.pop(head.key)[1]

    def remove(self, key: tuple[int, int]) -> Request | None:
        entry = self._waiting.pop(key, None)
        if len(self._heap) > 2 * len(self._waiting) + 64:  # compact the lazily removed entries
            self._heap = [e for e in self._heap if self._live(e)]
            heapq.heapify(self._heap)
        return None if entry is None else entry[1]

    def __len__(self) -> int:
        return len(self._waiting)

    def sequences(self) -> int:
        return sum(r.group_size for _, r in self._waiting.values())

    def _live(self, entry: tuple[int, int, int, tuple[int, int]]) -> bool:
        w = self._waiting.get(entry[3])
        return w is not None and w[0] == entry[2]

    def _head(self) -> Request | None:
        while self._heap and not self._live(self._heap[0]):
            heapq.heappop(self._heap)
        return self._waiting[self._heap[0][3]][1] if self._heap else None


class ShuffledFCFS(FCFS):
    """FCFS over requests that arrive in a random order (seeded per submission).

    Models an engine fed by asynchronous clients (slime, AReaL and PipelineRL post requests
    concurrently; their arrival order is not the logical order), the situation frontier-group
    dispatch is for: `frontier` orders by (round, index) whatever the arrival order.
    """

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self._rng = np.random.default_rng(seed)

    def submit(self, requests: Iterable[Request]) -> None:
        requests = list(requests)
        super().submit([requests[i] for i in self._rng.permutation(len(requests))])


POLICIES: Registry[Callable[[], AdmissionPolicy]] = Registry("admission policy")
POLICIES.update(fcfs=FCFS, frontier=Frontier, shuffled=ShuffledFCFS)


def register_admission(
    name: str,
) -> Callable[[Callable[[], AdmissionPolicy]], Callable[[], AdmissionPolicy]]:
    """Decorator: registers an admission policy factory (a class) under a new `name`; a config's
    `admission` field then names it, and the driver, the simulator and the planner all use it."""

    def decorator(factory: Callable[[], AdmissionPolicy]) -> Callable[[], AdmissionPolicy]:
        if name in POLICIES:
            raise ValueError(
                f"Admission policy {name!r} is already registered; expected a new name."
            )
        POLICIES[name] = factory
        return factory

    return decorator


def _check_new(requests: Iterable[Request], waiting: Container[tuple[int, int]]) -> list[Request]:
    """Checks a whole submission before any of it is taken: a bad one changes nothing."""
    requests, seen = list(requests), set[tuple[int, int]]()
    for r in requests:
        if r.key in waiting or r.key in seen:
            raise ValueError(f"Request (round, uid)={r.key} is already waiting.")
        seen.add(r.key)
    return requests


def make_policy(name: str) -> AdmissionPolicy:
    return POLICIES.get(name)()  # an unknown name: a ValueError naming the known
