"""The Ray runtime's sampler side as the Driver sees it: the replica router.

`ReplicaRouter` is the Driver's Sampler (rl.runtime.protocols) over N SamplerReplica actors: it
routes each request (one group) round-robin or to the least-loaded replica, keeps every request
until its group is delivered (so a dead replica's unfinished ones are re-sampled elsewhere, and a
second copy is dropped), applies tail batching's round cuts (rl.runtime.routing.RoutedCuts)
where every replica's groups meet, and merges the replicas' timeline events into the driver's
timeline (slot lanes numbered across replicas, args["replica"]) for per-replica metrics. Replicas
join and leave between rounds (`add_replica`, `remove_replica`: the sampler borrowing the
learner's devices) and, under async, mid-rollout (`add_replica(take_queued=True)`, `take_back`:
what ran on a replica taken back resumes on the others; a group it put on the queue actor
is delivered from there), and with a migration policy a
RayMigrator (rl.runtime.ray_migration) moves running requests between them; routing and the cuts
are guarded by one lock for that thread.
The Driver's Queue over the queue actor is rl.runtime.ray_queue.QueueClient.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
from collections.abc import Iterable
from typing import Any

import ray
from ray.exceptions import RayActorError

from rl.elastic.migration import Off
from rl.round_planner import RoundCut
from rl.runtime.ray_migration import RayMigrator
from rl.runtime.ray_queue import QueueClient
from rl.runtime.routing import RoutedCuts, Routing
from rl.timeline import Timeline, replica_lane
from rl.types import Group, Request
from sampler.loop import SamplerStats

__all__ = ["QueueClient", "ReplicaRouter"]  # QueueClient stays importable from here


class ReplicaRouter:
    """The Driver's Sampler over N replica actors; see the module docstring.

    Tail batching: a short round's RoundCut is decided here, on the groups in the order the
    driver takes them off the queue (with one replica, its completion order: the threaded
    runtime's cut, bit for bit). Once the cut is full, the round's other requests are aborted on
    every live replica and forgotten (never re-sampled); a copy emitted before the abort reached
    its replica is dropped on arrival (counted in stats.groups_cut).

    Args:
      replicas: SamplerReplica handles, by index.
      routing: "round_robin" or "least_loaded" (fewest requests submitted and not delivered).
      on_failure: "resample" (a dead replica's requests go to the others) or "stop".
      timeline: the driver's Timeline; replicas' events are merged into it.
      queue: the QueueActor the replicas put into: a request of a replica that leaves or dies
        whose group is there (QueueActor.keys) stays owned and is delivered from it, not
        sampled again; None: every such request is sampled again (its second copy dropped).
      migration: a long-tail migration policy (rl.elastic.migration), or None.
      migration_poll_s: seconds between the policy's looks at the replicas.
    """

    def __init__(
        self,
        replicas: list[Any],
        *,
        routing: str,
        on_failure: str,
        timeline: Timeline,
        queue: Any = None,
        migration: Any = None,
        migration_poll_s: float = 0.01,
    ):
        self.replicas, self.on_failure = list(replicas), on_failure
        self.timeline, self.queue = timeline, queue
        self._slots = dict(enumerate(ray.get([r.num_slots.remote() for r in replicas])))
        self._lanes: dict[int, int] = {}  # id(handle) -> its first slot lane
        self._next_offset = 0
        self._offset = [
            self._first_lane(r, n) for r, n in zip(replicas, self.replica_slots, strict=True)
        ]
        self.routing = Routing(routing, len(replicas))
        # Routing is shared with the migrator's thread (rl.runtime.ray_migration)
        self.lock = threading.RLock()
        self._params: tuple[Any, int] | None = None  # the latest weights, for a replica added
        self._publishing = threading.Lock()  # a publish, or a replica's first weights and start
        self._error: BaseException | None = None
        self._leaving: set[int] = set()  # recalled by a multiplexed pool, not yet released
        self.closed = False
        self._cuts = RoutedCuts(self.routing)  # tail batching: which groups of a short round train
        self._stats: dict[int, Any] = {}  # the last counters of each replica (a dead one's stay)
        self.resampled = 0  # requests re-submitted after their replica died
        self.migrator = None
        if migration is not None and not isinstance(migration, Off):
            self.migrator = RayMigrator(self, migration, poll_s=migration_poll_s)

    def _first_lane(self, handle: Any, slots: int) -> int:
        """`handle`'s first slot lane: a replica added again (a lent one, lent once more) writes
        on its own lanes, so the lanes never outnumber the most slots routed to at once."""
        offset = self._lanes.get(id(handle))
        if offset is None:
            offset = self._lanes[id(handle)] = self._next_offset
            self._next_offset += slots
        return offset

    @property
    def replica_slots(self) -> tuple[int, ...]:
        """Engine slots of each replica not removed (a dead one's stay), by index."""
        return tuple(n for _, n in sorted(self._slots.items()))

    @property
    def num_slots(self) -> int:
        return sum(self.replica_slots)

    def add_replica(self, handle: Any, *, take_queued: bool = False) -> int:
        """Routes to another replica (a handle with SamplerReplica's methods); it gets the latest
        weights and starts at once. Returns its index. With `take_queued` it takes requests still
        waiting on the others, up to its slots' worth, the most loaded replica's first (async
        borrowing's replica joins mid-rollout)."""
        if self.closed:
            raise RuntimeError("The sampler is closed: no replica joins it.")
        slots = ray.get(handle.num_slots.remote())
        # Weights and a running loop before any request is routed to it, and no publish between
        # its weights and its routing (set_params holds the same lock): a replica that fails
        # to start is never routed to, and one that starts has the latest weights.
        with self._publishing:
            try:
                if self._params is not None:
                    ray.get(handle.set_params.remote(*self._params))
                ray.get(handle.start.remote())
            except BaseException:
                with contextlib.suppress(RayActorError):  # (a later add starts it afresh)
                    ray.get(handle.close.remote())
                raise
            with self.lock:
                i = self.routing.add()
                self.replicas.append(handle)
                assert len(self.replicas) == i + 1
                self._slots[i] = slots
                self._offset.append(self._first_lane(handle, slots))
        if take_queued:
            with self.lock:
                others = sorted(
                    (j for j in self.alive if j != i), key=lambda j: (-self.routing.load[j], j)
                )
            room = slots
            for j in others:
                if room <= 0:
                    break
                taken = self.each("take_queued", room, replicas=[j]).get(j, [])
                room -= sum(r.group_size for r in taken)
                with self.lock:  # (a request a full round cut forgot meanwhile is not sampled)
                    taken = [r for r in taken if self.routing.owner(r.key) is not None]
                    for r in taken:
                        self.routing.move(r.key, i)
                if taken:
                    ray.get(handle.submit.remote(taken))
        return i

    def take_back(self, i: int) -> None:
        """Stops replica i mid-rollout (async borrowing: the learner's devices go back): its
        waiting requests go to the others, its running ones resume there, re-prefilled with their
        tokens so far (ReplicaCore.evict / resume: host data through the object store), and its
        complete groups are delivered; nothing is lost or sampled twice. A replica that dies
        meanwhile has its requests re-sampled on the others."""
        with self.lock:
            if i not in self.alive:
                raise ValueError(f"No live sampler replica {i}; live: {self.alive}.")
            if len(self.alive) == 1:
                raise ValueError(f"Replica {i} is the last one; a sampler needs one replica.")
            self.routing.retire(i)  # groups it emits while stopping are still delivered
        try:
            queued, runs = ray.get(self.replicas[i].evict.remote())
        except RayActorError:
            queued, runs = [], []
        self._collect([i])  # its evicted spans and last counters, before it is renewed
        for err in self.each("close", replicas=[i]).values():
            if err is not None:
                raise err
        resume: dict[int, list[Any]] = collections.defaultdict(list)
        with self.lock:
            lost = {r.key: r for r in self._remove(i)}
            del self._slots[i]
            for run in runs:
                if (r := lost.pop(run.run.request.key, None)) is not None:
                    resume[self.routing.route(r)].append(run)
            rest = [lost.pop(r.key) for r in queued if r.key in lost] + list(lost.values())
        for j, rs in resume.items():
            try:
                ray.get(self.replicas[j].resume.remote(rs))
            except RayActorError as e:
                self._lost(j, e)  # re-samples them with the rest of its requests
        if rest:
            self.submit(rest)

    # ------------------------------------- a multiplexed pool's moves (rl/runtime/pool.py)
    # What the pool reads every few milliseconds is estimated here, from the routing alone (no
    # call to the replicas): a replica's sequences are those of the requests it owns, undelivered.
    # Only the policy's timing reads the estimates; no request depends on them.

    def release_idle(self, i: int) -> bool:
        """Stops replica i if it owns no undelivered request and is not the last; returns
        whether it did (checked and removed under the routing lock: nothing is routed to it in
        between). Its loop is stopped and a fresh one readied (HostedReplica.close)."""
        with self.lock:
            if i not in self._routed() or len(self._routed()) == 1 or self.routing.load[i]:
                return False
            self.routing.remove(i)
            del self._slots[i]
            self._leaving.discard(i)
        self._collect([i])  # its last spans and counters
        for err in self.each("close", replicas=[i]).values():
            if err is not None and self._error is None:
                self._error = err
        return True

    def recall(self, i: int) -> bool:
        """Replica i is wanted by another pipeline: nothing is routed to it from now on and its
        waiting requests go to the others; what runs there finishes (no migration), after which
        `release_idle(i)` stops it. False for a replica not live, or when none would stay."""
        with self.lock:
            stay = [j for j in self.alive if j != i]
            if i not in self.alive or not stay:
                return False
            self._leaving.add(i)
            self.routing.retire(i)
        taken = self.each("take_queued", 1 << 30, replicas=[i]).get(i, [])
        by_replica: dict[int, list[Request]] = collections.defaultdict(list)
        with self.lock:
            for r in taken:
                if self.routing.owner(r.key) is None:
                    continue  # (a full round cut forgot it meanwhile)
                j = min(stay, key=lambda j: (self.routing.load[j], j))
                self.routing.move(r.key, j)
                by_replica[j].append(r)
        for j, rs in by_replica.items():
            try:
                ray.get(self.replicas[j].submit.remote(rs))
            except RayActorError as e:
                self._lost(j, e)
        return True

    def keep(self, i: int) -> None:
        """Replica i, recalled, stays (nobody waits for it any more): it is routed to again."""
        with self.lock:
            if i in self._leaving and i in self._slots:
                self._leaving.discard(i)
                self.routing.rejoin(i)

    @property
    def leaving(self) -> frozenset[int]:
        with self.lock:
            return frozenset(self._leaving)

    def pending(self) -> int:
        """Requests routed and not delivered."""
        with self.lock:
            return len(self.routing.outstanding)

    def _routed(self) -> list[int]:
        """The replicas routed to and those recalled, not yet released (the lock held)."""
        return sorted([*self.alive, *self._leaving])

    def _sequences(self) -> dict[int, tuple[int, int]]:
        """Each routed replica's (sequences it owns, its slots) (the lock held)."""
        seqs: collections.Counter[int] = collections.Counter()
        for j, r in self.routing.outstanding.values():
            seqs[j] += r.kept
        return {i: (seqs[i], self._slots[i]) for i in self._routed()}

    def usage(self) -> dict[int, tuple[int, int]]:
        """Each replica's (busy slots, free slots), estimated (see above)."""
        with self.lock:
            return {i: (min(q, n), max(n - q, 0)) for i, (q, n) in self._sequences().items()}

    def free_slots(self) -> int:
        leaving = self.leaving
        return sum(free for i, (_, free) in self.usage().items() if i not in leaving)

    def busy_slots(self) -> int:
        return sum(busy for busy, _ in self.usage().values())

    def waiting_sequences(self) -> int:
        """Samples beyond their replicas' slots, estimated (see above)."""
        with self.lock:
            return sum(max(q - n, 0) for q, n in self._sequences().values())

    def idle_replicas(self) -> list[int]:
        """Replicas that own no undelivered request."""
        with self.lock:
            return [i for i in self._routed() if not self.routing.load[i]]

    def waiting(self) -> int:
        """Requests waiting for admission, over the live replicas."""
        return sum(self.each("waiting").values())

    def remove_replica(self, i: int) -> None:
        """Stops routing to replica i and stops its loop; its undelivered requests are
        re-sampled on the others. Its counters and timeline events are kept."""
        with self.lock:
            if i not in self.alive:
                raise ValueError(f"No live sampler replica {i}; live: {self.alive}.")
            if len(self.alive) == 1:
                raise ValueError(f"Replica {i} is the last one; a sampler needs one replica.")
        self._collect([i])  # its last spans and counters, before it stops
        for err in self.each("close", replicas=[i]).values():
            if err is not None:
                raise err
        with self.lock:
            lost = self._remove(i)
            del self._slots[i]
        if lost:
            self.submit(lost)

    def _remove(self, i: int) -> list[Request]:
        """Takes replica i out of routing (the lock held); returns its requests to sample again:
        those whose groups are not on the queue (or in the driver's hands). Those that are stay
        owned by a live replica, and are delivered from the queue."""
        lost = self.routing.remove(i)
        if not lost or self.queue is None or not self.alive:
            return lost
        held = ray.get(self.queue.keys.remote())
        for r in lost:
            if r.key in held:
                self.routing.route(r)
        return [r for r in lost if r.key not in held]

    @property
    def alive(self) -> list[int]:
        return self.routing.alive

    @property
    def routed(self) -> collections.Counter[int]:
        """Requests routed to each replica."""
        return self.routing.routed

    def lane(self, name: str, i: int) -> str:
        """Replica i's timeline lane `name` (its slots offset among all replicas')."""
        return replica_lane(name, i, self._offset[i])

    def each(self, method: str, *args: Any, replicas: Iterable[int] | None = None) -> dict:
        """Calls `method` on replicas (default: the live ones); answers of those that answered,
        by index; a dead one is handled (its requests re-sampled or the run stopped)."""
        idx = list(self.alive if replicas is None else replicas)
        refs = {i: getattr(self.replicas[i], method).remote(*args) for i in idx}
        out = {}
        for i, ref in refs.items():
            try:
                out[i] = ray.get(ref)
            except RayActorError as e:
                self._lost(i, e)
        return out

    def _lost(self, i: int, e: BaseException) -> None:
        with self.lock:
            if i not in self.alive and i not in self._leaving:
                return
            self._leaving.discard(i)
            lost = self._remove(i)
        why = f"sampler replica {i} died ({type(e).__name__}: {str(e).splitlines()[0]})"
        if self.on_failure == "stop" or not self.alive:
            if self._error is None:
                extra = "" if self.alive else "; no replica is left"
                self._error = RuntimeError(
                    f"The {why}{extra}; the run stopped (config.ray.on_replica_failure="
                    f"{self.on_failure!r})."
                )
            return
        logging.warning("%s: re-sampling its unfinished requests on replicas %s", why, self.alive)
        self.resampled += len(lost)
        if lost:
            self.submit(lost)

    @property
    def error(self) -> BaseException | None:
        for err in self.each("error").values():
            if err is not None and self._error is None:
                self._error = err
        return self._error

    def fail(self, error: BaseException) -> None:
        """Stops the run with `error` (the migrator's thread reports its failure here)."""
        if self._error is None:
            self._error = error

    def _collect(self, replicas: Iterable[int] | None = None) -> None:
        """Merges replicas' (default: the live ones) new timeline events and keeps their counters."""
        for i, (stats, spans, instants) in self.each("stats", replicas=replicas).items():
            self._merge(i, spans, instants)
            self._stats[i] = stats

    @property
    def stats(self) -> Any:
        self._collect()
        with self.lock:
            return self._cuts.settle(SamplerStats.total(self._stats.values()))

    def _merge(self, i: int, spans: list[Any], instants: list[Any]) -> None:
        for s in spans:
            lane = self.lane(s.lane, i)
            self.timeline.span(lane, s.name, s.start, s.end, **s.args, replica=i)
        for t in instants:
            self.timeline.instant(t.lane, t.name, t.t, **t.args, replica=i)

    def start(self) -> None:
        self.each("start")
        if self.migrator is not None:
            self.migrator.start()

    def set_params(self, params: Any, version: int) -> None:
        with self._publishing:  # (a replica being added gets these or comes after them)
            self._params = (params, version)
            self.each("set_params", params, version)

    def submit(self, requests: Iterable[Request], cut: RoundCut | None = None) -> None:
        """Routes requests to replicas; with `cut` (one round's requests), the router keeps the
        first `cut.target` groups of the round to arrive and aborts the rest (class docstring)."""
        if self._error is not None:
            raise self._error
        requests = list(requests)
        by_replica: dict[int, list[Request]] = collections.defaultdict(list)
        with self.lock:
            if cut is not None:
                self._cuts.add(cut, requests)
            for r in requests:
                by_replica[self.routing.route(r)].append(r)
        for i, rs in by_replica.items():
            try:
                ray.get(self.replicas[i].submit.remote(rs))
            except RayActorError as e:
                self._lost(i, e)  # re-samples rs with the rest of its requests

    def accept(self, group: Group) -> bool:
        """Marks a delivered group; False for a second copy or a group its round's full cut
        refuses (see QueueClient). The group that fills a cut aborts the round's others."""
        with self.lock:  # the migrator's thread reads who owns a request under it
            keep, abort = self._cuts.deliver(group)
        if abort:
            self.each("abort", abort)
        return keep

    def request_stop(self) -> None:
        if self.migrator is not None:
            self.migrator.stop()
        self.each("request_stop")

    def close(self) -> None:
        self.closed = True
        if self.migrator is not None:
            self.migrator.stop()
        for err in self.each("close").values():
            if err is not None:
                raise err
