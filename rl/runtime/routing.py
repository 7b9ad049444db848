"""Which sampler replica serves a request: the routing both replica samplers share.

`Routing` is pure bookkeeping (no Ray, no threads): the threaded replica sampler
(rl.runtime.replicas) and the Ray runtime's router (rl.runtime.ray_router) keep every request from
submission until its group is delivered in one, so a replica's load, a dead or removed replica's
unfinished requests and a migrated request's new owner are tracked the same way in both.
"""

from __future__ import annotations

import collections
import itertools

from rl.types import Request

ROUTINGS = ("round_robin", "least_loaded")


class Routing:
    """Request -> replica, and who owns each request until its group is delivered.

    Args:
      routing: "round_robin" or "least_loaded" (fewest requests routed and not delivered; ties to
        the lowest index).
      replicas: how many replicas there are at the start (indices 0..n-1).
    """

    def __init__(self, routing: str, replicas: int):
        if routing not in ROUTINGS:
            raise ValueError(f"routing={routing!r}; expected one of {ROUTINGS}.")
        if replicas < 1:
            raise ValueError(f"Routing needs >= 1 replica; received {replicas}.")
        self.routing = routing
        self.alive = list(range(replicas))
        self._next = replicas
        self.outstanding: dict[tuple[int, int], tuple[int, Request]] = {}
        self.load: collections.Counter[int] = collections.Counter()
        self.routed: collections.Counter[int] = collections.Counter()  # requests per replica
        self._rr = itertools.count()

    def add(self) -> int:
        """A new replica; returns its index (indices are never reused)."""
        i, self._next = self._next, self._next + 1
        self.alive.append(i)
        return i

    def remove(self, i: int) -> list[Request]:
        """Takes replica i out of routing; returns its undelivered requests (by key) and forgets
        them, so they can be routed again."""
        if i not in self.alive:
            raise ValueError(f"Replica {i} is not routed to; live replicas: {self.alive}.")
        self.alive.remove(i)
        lost = sorted((r for j, r in self.outstanding.values() if j == i), key=lambda r: r.key)
        for r in lost:
            del self.outstanding[r.key]
        self.load.pop(i, None)
        return lost

    def route(self, request: Request) -> int:
        """Picks the replica for `request` and records it as its owner."""
        if not self.alive:
            raise RuntimeError("No sampler replica is left to route a request to.")
        if self.routing == "least_loaded":
            i = min(self.alive, key=lambda j: (self.load[j], j))
        else:
            i = self.alive[next(self._rr) % len(self.alive)]
        self.outstanding[request.key] = (i, request)
        self.load[i] += 1
        self.routed[i] += 1
        return i

    def owner(self, key: tuple[int, int]) -> int | None:
        """The replica request `key` is routed to; None once its group is delivered (or the
        request was forgotten)."""
        owner = self.outstanding.get(key)
        return None if owner is None else owner[0]

    def move(self, key: tuple[int, int], dst: int) -> None:
        """Request `key` migrated to replica `dst` (its group is delivered from there)."""
        src, request = self.outstanding[key]
        self.load[src] -= 1
        self.load[dst] += 1
        self.outstanding[key] = (dst, request)

    def deliver(self, key: tuple[int, int]) -> int | None:
        """Marks request `key`'s group delivered; returns its replica, None for a second copy."""
        owner = self.outstanding.pop(key, None)
        if owner is None:
            return None
        self.load[owner[0]] -= 1
        return owner[0]
