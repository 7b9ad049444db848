"""Admission policies: which waiting request the sampler starts next. Pure and clock-free.

The sampler loop (and the simulator) call `next(free_slots)` whenever slots are free; a request is
admitted only whole (all G samples of its group at once, one shared prefill).
"""

from __future__ import annotations

import collections
from collections.abc import Iterable
from typing import Protocol

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


class FCFS:
    """First come, first served: submission order; the head waits until its group fits."""

    def __init__(self) -> None:
        self._waiting: collections.OrderedDict[tuple[int, int], Request] = collections.OrderedDict()

    def submit(self, requests: Iterable[Request]) -> None:
        for r in requests:
            if r.key in self._waiting:
                raise ValueError(f"Request (round, uid)={r.key} is already waiting.")
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


POLICIES = {"fcfs": FCFS}


def make_policy(name: str) -> AdmissionPolicy:
    if name not in POLICIES:
        raise ValueError(f"Unknown admission policy {name!r}; expected one of {sorted(POLICIES)}.")
    return POLICIES[name]()
