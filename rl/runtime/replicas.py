"""N sampler replicas in one process: the threaded runtime's Sampler (rl.runtime.protocols).

Each replica is an Engine on its own devices and a SamplerLoop in its own thread. Requests are
routed at submission (rl.runtime.routing: round-robin or least-loaded, the Ray router's logic);
every replica emits its complete groups onto the one queue. With one replica this is that replica's
SamplerLoop with nothing added but args["replica"] = 0 on its slot spans.

Migration (JigsawRL, rl.elastic.migration): at each step boundary of replica i (on its thread) the
policy sees every replica (`SamplerLoop.view`) and the moves whose source is i are executed at
once: free slots are reserved on the destination, the request's running samples are exported from
i (KV rows, positions, sampling state; Engine.export_slots) and adopted by the destination, which
imports them before its next decode step; the group completes there. Each move is a span
"migrate" on the source replica's lane sampler/[replica{i}/]migrate (args round, uid, sequences,
bytes, src, dst); rl.metrics.migration_metrics sums them per round.

Work stealing: at each step boundary a replica with free slots and nothing waiting takes
requests waiting on the replica with the longest queue (`_steal`; their routing moves with
them). So a replica freed by migration, or one that just joined, takes the next requests, and
none idles while another's queue waits; otherwise it is idle (`idle_replicas`).

Tail batching (rl.round_planner): a round's RoundCut is decided where the replicas' groups meet, in
`emit`, on the shared Routing (rl.runtime.routing.RoutedCuts, as the Ray router): the first
`cut.target` groups of the round emitted go on; the one that fills the cut forgets the round's
other requests (never re-sampled) and aborts them on every live replica, at once; a copy emitted
before its replica got the abort is dropped (stats.groups_cut). A migration runs under the same
lock, so an abort reaches the replica that holds the request, never one it is leaving. With one
replica at submission the loop also gets a copy of the cut and aborts at completion, before the
rewards, as it always did (it emits exactly the groups the shared cut then keeps).

Elastic replicas: `add_replica(engine)` starts another replica (it gets the latest weights) and
`remove_replica(i)` stops one, its undelivered requests re-sampled on the others (per-request
randomness makes them identical; a group delivered twice is dropped); `release_idle(i)` stops one
only if it holds nothing (a multiplexed pool's move, rl/runtime/pool.py), and `recall(i)` readies
one for that: nothing more is routed to it or stolen by it, its queue goes to the others and the
migration policy sees it leaving (`tail` evacuates it); `keep(i)` undoes a recall. All are safe
between the replicas' decode steps, from any thread; after `close` no replica is added.

Lanes: replica i's slot s is lane sampler/slot{offset_i + s} (an offset per engine: a lent
engine added again writes on the same lanes) and its slot
spans carry args["replica"] = i; replica 0 keeps the plain sampler/prefill and sampler/groups
lanes, replica i > 0 writes sampler/replica{i}/... (as the Ray router merges them).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from rl.elastic.migration import MigrationPolicy, Off
from rl.envs import EnvRunner
from rl.round_planner import RoundCut
from rl.runtime.routing import RoutedCuts, Routing
from rl.timeline import SLOT_PREFIX, replica_lane
from rl.types import Group, Request
from sampler.loop import SamplerLoop, SamplerStats

if TYPE_CHECKING:
    from rl.admission import AdmissionPolicy
    from sampler.engine import Engine


class ReplicaTimeline:
    """A replica's view of the run's Timeline: its lanes renamed, args["replica"] added to slots."""

    def __init__(self, timeline: Any, replica: int, offset: int):
        self.timeline, self.replica, self.offset = timeline, replica, offset

    def _lane(self, lane: str) -> str:
        if self.replica == 0 and not lane.startswith(SLOT_PREFIX):
            return lane
        return replica_lane(lane, self.replica, self.offset)

    def span(self, lane: str, name: str, start: float, end: float, **args: Any) -> None:
        if lane.startswith(SLOT_PREFIX):
            args["replica"] = self.replica
        self.timeline.span(self._lane(lane), name, start, end, **args)

    def instant(self, lane: str, name: str, t: float, **args: Any) -> None:
        self.timeline.instant(self._lane(lane), name, t, **args)


class ReplicaSampler:
    """The Driver's Sampler over N in-process replicas; see the module docstring.

    Args:
      engines: one Engine per replica, each on its own devices.
      make_admission: a fresh admission policy (one per replica).
      reward_fn, emit, group_atomic, recompute_kv, timeline, clock, environment: as for
        SamplerLoop; `emit` gets each group once.
      version: the weights' version before the first set_params.
      routing: "round_robin" or "least_loaded".
      migration: the migration policy (default: none).
      spare: engines that may join later (`add_replica`), whose slot lanes are reserved now.
    """

    def __init__(
        self,
        engines: Iterable[Engine],
        *,
        make_admission: Callable[[], AdmissionPolicy],
        reward_fn: Any,
        emit: Callable[[Group], None],
        version: int = 0,
        group_atomic: bool = True,
        recompute_kv: bool = False,
        routing: str = "round_robin",
        migration: MigrationPolicy | None = None,
        timeline: Any = None,
        clock: Callable[[], float] = time.monotonic,
        environment: EnvRunner | None = None,
        spare: Iterable[Engine] = (),
    ):
        engines = list(engines)
        if not engines:
            raise ValueError("ReplicaSampler needs at least one engine; received none.")
        self.routing = Routing(routing, max(1, len(engines)))
        self._cuts = RoutedCuts(self.routing)  # tail batching's round cuts over the replicas
        self._make_admission, self._reward_fn, self._emit = make_admission, reward_fn, emit
        self._group_atomic, self._recompute_kv = group_atomic, recompute_kv
        self.migration = Off() if migration is None else migration
        self.timeline, self.clock = timeline, clock
        self.environment = environment
        self._params: tuple[Any, int] = (None, version)
        # routing, cuts and the replica table; taken before a loop's lock, never inside one
        self._lock = threading.Lock()
        self._topology = threading.RLock()  # held by a migration, add_replica, remove_replica
        self.loops: dict[int, SamplerLoop] = {}  # live replicas by index
        self._leaving: set[int] = set()  # recalled by a multiplexed pool: emptied, then released
        self._removed: list[SamplerLoop] = []  # stopping: their counters stay in `stats`
        self._retired = SamplerStats()  # counters of the replicas stopped and dropped
        self._retired_error: BaseException | None = None
        self._offsets: dict[int, int] = {}
        self._next_offset = 0
        self._lanes: dict[int, int] = {}  # id(engine) -> its first slot lane
        self._started = self._closed = False
        for i, engine in enumerate(engines):
            self._build(i, engine)
        for engine in spare:
            self._lane(engine)

    # ------------------------------------------------------------------------------ replicas

    def _lane(self, engine: Engine) -> int:
        """`engine`'s first slot lane (an engine added again draws on its own lanes)."""
        offset = self._lanes.get(id(engine))
        if offset is None:
            offset = self._lanes[id(engine)] = self._next_offset
            self._next_offset += engine.max_concurrent_decodes
        return offset

    def _build(self, i: int, engine: Engine, *, route: bool = False) -> SamplerLoop:
        """Replica i's loop on `engine`; `route`: i is new to the routing, which starts routing
        to it only now that its loop is in place."""
        offset = self._lane(engine)
        published = self._params
        params, version = published
        loop = SamplerLoop(
            engine,
            None if params is None else engine.place_params(params),
            admission=self._make_admission(),
            reward_fn=self._reward_fn,
            emit=self._deliver,
            version=version,
            group_atomic=self._group_atomic,
            recompute_kv=self._recompute_kv,
            timeline=None if self.timeline is None else ReplicaTimeline(self.timeline, i, offset),
            clock=self.clock,
            on_boundary=lambda: self._boundary(i),
            environment=self.environment,
        )
        with self._lock:
            if route and self.routing.add() != i:
                raise RuntimeError(
                    f"Replica {i} added out of turn (add_replica holds the topology)."
                )
            self.loops[i], self._offsets[i] = loop, offset
            latest = self._params
        if latest is not published:  # weights published while the loop was built
            loop.set_params(engine.place_params(latest[0]), latest[1])
        return loop

    def add_replica(self, engine: Engine, *, take_queued: bool = False) -> int:
        """Starts another replica on `engine` (with the latest weights); returns its index.

        With `take_queued`, it takes requests still waiting on the others, up to its slots'
        worth, the most loaded replica's first (requests are routed at submission, so a replica
        joining mid-rollout would otherwise wait for later submissions or stealing)."""
        with self._topology:
            if self._closed:
                raise RuntimeError("ReplicaSampler.add_replica: the sampler is closed.")
            i = self.routing.next_index  # (one add at a time: the topology lock)
            loop = self._build(i, engine, route=True)
            if take_queued:
                with self._lock:
                    room, taken = loop.num_slots, []
                    for j in sorted(self.loops, key=lambda j: -self.routing.load[j]):
                        if j != i and room > 0:
                            got = self.loops[j].take_queued(room)
                            room -= sum(r.group_size for r in got)
                            taken += got
                    for r in taken:
                        self.routing.move(r.key, i)
                    if taken:
                        loop.submit(taken)
            if self._started:
                loop.start()
        return i

    def take_back(self, i: int) -> None:
        """Stops replica i mid-rollout (lent devices go back to the learner): its waiting requests
        are routed to the others, its running requests resume on them (re-prefilled with their
        tokens so far: SamplerLoop.resume) and its complete groups are delivered; nothing is lost
        or sampled twice."""
        with self._topology, self._lock:  # no migration from or into it after this
            if i not in self.loops:
                raise ValueError(f"No live sampler replica {i}; live: {sorted(self.loops)}.")
            if len(self.loops) == 1:
                raise ValueError(f"Replica {i} is the last one; a sampler needs one replica.")
            loop = self.loops.pop(i)
            self._removed.append(loop)
            if i in self._leaving:  # (retired already)
                self._leaving.discard(i)
            else:
                self.routing.retire(i)  # groups it emits while stopping are still delivered
        # outside the locks: its thread may be emitting a group, or waiting for the topology
        # lock at its step boundary (where it then finds itself gone)
        loop.close()
        queued, runs, scoring = loop.evict()
        with self._lock:
            lost = {r.key: r for r in self.routing.remove(i)}
            for run in runs:
                if lost.pop(run.request.key, None) is not None:
                    self.loops[self.routing.route(run.request)].resume([run])
            for c in scoring:
                if lost.pop(c.request.key, None) is not None:
                    self.routing.route(c.request)  # delivered below
            # waiting requests (and anything else undelivered) are sampled on the others
            self._route([lost.pop(r.key) for r in queued if r.key in lost] + list(lost.values()))
        for c in scoring:
            self._deliver(c.group())
        self._drop(loop)

    def remove_replica(self, i: int) -> None:
        """Stops replica i; its undelivered requests are re-sampled on the other replicas."""
        with self._topology:
            with self._lock:
                if i not in self.loops:
                    raise ValueError(f"No live sampler replica {i}; live: {sorted(self.loops)}.")
                if len(self.loops) == 1:
                    raise ValueError(f"Replica {i} is the last one; a sampler needs one replica.")
                loop = self.loops.pop(i)
                self._removed.append(loop)
                self._leaving.discard(i)
                # re-routed at once: a round cut filling meanwhile forgets and aborts them too
                self._route(self.routing.remove(i))
        loop.close()  # outside the locks: its thread may be emitting a group
        self._drop(loop)

    def release_idle(self, i: int) -> bool:
        """Stops replica i if nothing waits, runs or is scored on it and it is not the last;
        returns whether it did. Checked and removed under the routing lock, so no request is
        routed to it in between (no sample is lost or sampled again)."""
        with self._topology:
            with self._lock:
                loop = self.loops.get(i)
                if loop is None or len(self.loops) == 1 or self.routing.load[i] or not loop.idle:
                    return False  # (a group emitted but not yet delivered is still routed to i)
                del self.loops[i]
                self._removed.append(loop)
                self._leaving.discard(i)
                self.routing.remove(i)
        loop.close()  # outside the locks: its thread may be at its step boundary
        self._drop(loop)
        return True

    def recall(self, i: int) -> bool:
        """Replica i is wanted elsewhere (a multiplexed pool recalls it: rl/runtime/pool.py): no
        request is routed to it or taken by it from now on, its waiting requests go to the
        others, and the migration policy sees it `leaving` (`tail` moves what runs there to the
        others); once idle, `release_idle(i)` stops it. Returns whether it did: not for a
        replica that is not live or is leaving already, nor when no other replica would stay."""
        with self._topology, self._lock:
            stay = [j for j in self.loops if j != i and j not in self._leaving]
            if i not in self.loops or i in self._leaving or not stay:
                return False
            self._leaving.add(i)
            self.routing.retire(i)
            for r in self.loops[i].take_queued(1 << 30):
                j = min(stay, key=lambda j: (self.routing.load[j], j))
                self.routing.move(r.key, j)
                self.loops[j].submit([r])
        return True

    def keep(self, i: int) -> None:
        """Replica i, recalled, stays (nobody waits for it any more): it is routed to again."""
        with self._lock:
            if i in self._leaving and i in self.loops:
                self._leaving.discard(i)
                self.routing.rejoin(i)

    @property
    def leaving(self) -> frozenset[int]:
        """The live replicas recalled and not yet released."""
        with self._lock:
            return frozenset(self._leaving)

    def usage(self) -> dict[int, tuple[int, int]]:
        """Each live replica's (busy slots, free slots)."""
        with self._lock:
            loops = dict(self.loops)
        return {i: (loop.busy_slots(), loop.free_slots()) for i, loop in sorted(loops.items())}

    def _drop(self, loop: SamplerLoop) -> None:
        """A stopped replica's counters and error stay; the loop goes, and with it the device
        memory it held (its KV cache and weights): replicas that come and go (lending,
        multiplexing) would otherwise keep a cache and a copy of the weights each."""
        with self._lock:
            self._removed.remove(loop)
            self._retired = SamplerStats.total([self._retired, loop.stats])
            self._retired_error = self._retired_error or loop.error

    def pending(self) -> int:
        """Requests waiting, running, or complete with rewards running, over the replicas."""
        return sum(loop.pending() for loop in self._live())

    def waiting(self) -> int:
        """Requests waiting for admission, over the replicas."""
        return sum(loop.waiting() for loop in self._live())

    def waiting_sequences(self) -> int:
        """Samples of the requests waiting for admission, over the replicas."""
        return sum(loop.waiting_sequences() for loop in self._live())

    def free_slots(self) -> int:
        """Slots free for admission now, over the replicas."""
        return sum(loop.free_slots() for loop in self._live())

    def busy_slots(self) -> int:
        return sum(loop.busy_slots() for loop in self._live())

    def idle_replicas(self) -> list[int]:
        """Live replicas with nothing waiting, running or being scored (lendable devices)."""
        with self._lock:
            loops = dict(self.loops)
        return [i for i, loop in sorted(loops.items()) if loop.idle]

    # ------------------------------------------------------------------------ the protocol

    @property
    def num_slots(self) -> int:
        return sum(self.replica_slots)

    @property
    def replica_slots(self) -> tuple[int, ...]:
        with self._lock:
            return tuple(loop.num_slots for _, loop in sorted(self.loops.items()))

    @property
    def routed(self) -> Any:
        """Requests routed to each replica (a Counter)."""
        return self.routing.routed

    @property
    def error(self) -> BaseException | None:
        with self._lock:
            loops, retired = [*self.loops.values(), *self._removed], self._retired_error
        return next((loop.error for loop in loops if loop.error is not None), retired)

    @property
    def stats(self) -> SamplerStats:

        with self._lock:
            stats = [
                self._retired,
                *(loop.stats for loop in (*self.loops.values(), *self._removed)),
            ]
        return self._cuts.settle(SamplerStats.total(stats))

    def start(self) -> None:
        with self._topology:
            self._started = True
            for loop in self._live():
                loop.start()

    def submit(self, requests: Iterable[Request], cut: RoundCut | None = None) -> None:
        """Routes requests to the replicas; with `cut` (one round's requests) the first
        `cut.target` of the round's groups to be emitted go on (module docstring)."""
        requests = list(requests)
        with self._lock:
            local = None
            if cut is not None:
                self._cuts.add(cut, requests)
                if len(self.loops) == 1:  # the loop aborts at completion, as it always did
                    local = RoundCut(cut.target)
            self._route(requests, local)

    def set_params(self, params: Any, version: int) -> None:
        with self._lock:
            self._params = (params, version)
            loops = list(self.loops.values())
        for loop in loops:
            loop.set_params(loop.engine.place_params(params), version)

    def request_stop(self) -> None:
        for loop in self._live():
            loop.request_stop()

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        with self._topology:
            self._closed = True
        errors = []
        for loop in self._live():
            try:
                loop.close()
            except BaseException as e:  # close them all, then raise the first
                errors.append(e)
        if errors:
            raise errors[0]

    # ------------------------------------------------------------------------ synchronous use

    def step(self) -> bool:
        """One step of every replica in index order (tests); whether any work is left."""
        for loop in self._live():
            loop.step()
        return self.pending() > 0  # a later replica may have handed work to an earlier one

    def run_until_idle(self, max_steps: int = 100_000) -> None:
        for _ in range(max_steps):
            if not self.step():
                return
        raise RuntimeError(f"Sampler replicas still busy after {max_steps} steps.")

    # ------------------------------------------------------------------------------ internals

    def _live(self) -> list[SamplerLoop]:
        with self._lock:
            return [loop for _, loop in sorted(self.loops.items())]

    def _route(self, requests: list[Request], cut: RoundCut | None = None) -> None:
        """Routes and submits `requests` (lock held: a cut filling meanwhile sees them all)."""
        by_replica: dict[int, list[Request]] = {}
        for r in requests:
            by_replica.setdefault(self.routing.route(r), []).append(r)
        for i, rs in sorted(by_replica.items()):
            self.loops[i].submit(rs, cut)

    def _deliver(self, group: Group) -> None:
        """A replica's emit: its round's cut decides, aborts the round's rest everywhere once
        full; a second copy (a removed replica's re-sampled group, an aborted one) is dropped."""
        with self._lock:
            keep, abort = self._cuts.deliver(group)
            if abort:
                for loop in self.loops.values():
                    loop.abort(abort)
        if keep:  # outside the lock: a full queue blocks this replica only
            self._emit(group)

    def _boundary(self, i: int) -> None:
        """Replica i is between decode steps: it takes queued work if it has room and none
        (`_steal`), then the migration policy's moves out of it run."""
        self._steal(i)
        if isinstance(self.migration, Off):
            return
        with self._topology:
            with self._lock:
                loops = dict(sorted(self.loops.items()))
                leaving = set(self._leaving)
            if i not in loops or len(loops) < 2:
                return
            ids = list(loops)
            views = [
                dataclasses.replace(loop.view(), leaving=True) if j in leaving else loop.view()
                for j, loop in loops.items()
            ]
            for move in self.migration.moves(views):
                src, dst = ids[move.src], ids[move.dst]
                if src == i:
                    self._move(move.key, i, dst, loops, views[move.src])

    def _steal(self, i: int) -> None:
        """Replica i, with free slots and nothing waiting, takes requests waiting on the replica
        with the longest queue (their routing moves with them): requests are routed at
        submission, and a replica that frees up (its tail done, migrated away, or lent and just
        joined) would otherwise idle while another's queue waits. Tokens do not depend on the
        replica."""
        with self._lock:
            loop = self.loops.get(i)
            if loop is None or len(self.loops) < 2 or i in self._leaving:
                return
            free = loop.free_slots()
            if not free or loop.waiting():
                return
            j, queued = max(
                ((j, other.waiting()) for j, other in self.loops.items() if j != i),
                key=lambda x: (x[1], -x[0]),
            )
            if not queued:
                return
            taken = self.loops[j].take_queued(free)
            for r in taken:
                self.routing.move(r.key, i)
            if taken:
                loop.submit(taken)

    def _move(
        self, key: tuple[int, int], src: int, dst: int, loops: dict[int, SamplerLoop], view: Any
    ) -> None:
        n = next(r.sequences for r in view.running if r.key == key)
        with self._lock:  # a round cut's abort comes before the move or after the adoption
            if key not in self.routing.outstanding:  # aborted by a full round cut since `view`
                return
            slots = loops[dst].reserve(n)
            if slots is None:  # the destination admitted work meanwhile
                return
            t0 = self.clock()
            handoff = loops[src].handoff(key)
            if handoff is None:  # finished or aborted since the view
                loops[dst].unreserve(slots)
                return
            self.routing.move(key, dst)
            loops[dst].adopt(handoff, slots)
        if self.timeline is not None:
            r = handoff.run.request
            ReplicaTimeline(self.timeline, src, self._offsets[src]).span(
                "sampler/migrate",
                "migrate",
                t0,
                self.clock(),
                round=r.round,
                uid=r.uid,
                sequences=len(handoff.samples),
                bytes=handoff.state.nbytes,
                src=src,
                dst=dst,
            )
