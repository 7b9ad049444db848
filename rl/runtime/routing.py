"""Which sampler replica serves a request: the routing both replica samplers share.

`Routing` is pure bookkeeping (no Ray, no threads): the threaded replica sampler
(rl.runtime.replicas) and the Ray runtime's router (rl.runtime.ray_router) keep every request from
submission until its group is delivered in one, so a replica's load, a dead or removed replica's
unfinished requests and a migrated request's new owner are tracked the same way in both.
`RoutedCuts` applies tail batching's round cuts on top of it, where the replicas' groups meet (the
Ray router's take from the queue, the threaded sampler's emit), for both.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Sequence
from typing import Any

from rl.round_planner import RoundCut, RoundCuts
from rl.types import Group, Request

Key = tuple[int, int]  # (round, uid)

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
        self._retired: set[int] = set()
        self._next = replicas
        self.outstanding: dict[tuple[int, int], tuple[int, Request]] = {}
        self.load: collections.Counter[int] = collections.Counter()
        self.routed: collections.Counter[int] = collections.Counter()  # requests per replica
        self._rr = itertools.count()

    @property
    def next_index(self) -> int:
        """The index `add` gives next."""
        return self._next

    def add(self) -> int:
        """A new replica; returns its index (indices are never reused)."""
        i, self._next = self._next, self._next + 1
        self.alive.append(i)
        return i

    def retire(self, i: int) -> None:
        """No new request goes to replica i; what it holds stays its own until `remove`."""
        if i not in self.alive:
            raise ValueError(f"Replica {i} is not routed to; live replicas: {self.alive}.")
        self.alive.remove(i)
        self._retired.add(i)

    def rejoin(self, i: int) -> None:
        """Retired replica i is routed to again."""
        if i not in self._retired:
            raise ValueError(f"Replica {i} is not retired; retired: {sorted(self._retired)}.")
        self._retired.discard(i)
        self.alive = sorted([*self.alive, i])

    def remove(self, i: int) -> list[Request]:
        """Takes replica i (live or retired) out of routing; returns its undelivered requests (by
        key) and forgets them, so they can be routed again."""
        if i not in self.alive and i not in self._retired:
            raise ValueError(f"Replica {i} is not routed to; live replicas: {self.alive}.")
        if i in self._retired:
            self._retired.discard(i)
        else:
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


class RoutedCuts:
    """Tail batching's round cuts (rl.round_planner.RoundCut) decided in one place for all replicas.

    A round's cut keeps the first `cut.target` of its groups delivered here. The group that fills
    it makes the Routing forget the round's other requests (never re-sampled, e.g. after a replica
    dies) and returns them, to be aborted on every live replica; a copy of an aborted request
    emitted before its replica got the abort is dropped on arrival and counted in `groups_cut`.

    Args:
      routing: the Routing that owns every request from submission until its group is delivered.
    """

    def __init__(self, routing: Routing):
        self.routing = routing
        self._cuts = RoundCuts()
        self._aborted: set[Key] = set()  # forgotten by a full cut; a late copy is counted
        self.groups_cut = 0  # complete groups dropped here because their round's cut was full

    def add(self, cut: RoundCut, requests: Sequence[Request]) -> None:
        """Registers `cut` for one round's `requests`, before they are routed."""
        self._cuts.add(cut, requests)
        # a copy of an older round's aborted request still arriving is dropped uncounted
        round = requests[0].round
        self._aborted = {k for k in self._aborted if k[0] >= round - 1}

    def deliver(self, group: Group) -> tuple[bool, list[Key]]:
        """Marks `group` delivered.

        Returns:
          (whether the group goes on to the learner: False for a second copy or a group its
          round's full cut refuses; the request keys to abort on every live replica, already
          forgotten by the Routing: those left when this group filled its round's cut).
        """
        key = group.request.key
        if self.routing.deliver(key) is None:
            if key in self._aborted:
                self._aborted.discard(key)
                self.groups_cut += 1
            return False, []
        kept, abort, refused = self._cuts.apply([group])
        self.groups_cut += refused
        dropped = [k for k in abort if self.routing.deliver(k) is not None]
        self._aborted.update(dropped)
        return bool(kept), dropped

    def settle(self, stats: Any) -> Any:
        """The replicas' summed SamplerStats with the groups dropped here (which the replicas
        counted as emitted) counted as cut instead."""
        stats.groups_emitted -= self.groups_cut
        stats.groups_cut += self.groups_cut
        return stats
