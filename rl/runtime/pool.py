"""Several pipelines' sampler replicas on one pool of devices, moved between them as they run:
pipeline multiplexing (JigsawRL) in the threaded runtime, and under Ray with the replicas on the
pool's host actors (rl/runtime/ray_host.py; the pipelines' routers answer as samplers do here).
The decisions are rl/elastic/multiplex.py's `MultiplexPolicy`, the one the simulator's
multiplexing (rl/sim/multiplex.py) carries out.

    pool = ReplicaPool(["seed=0", "seed=1"], replicas=4)
    rl.run.train(config0, pool=pool.member(0))   # each pipeline in a thread of its own
    ...
    pool.close()

launch.sweep is the command that does this. Every pipeline builds its runtime as if it ran alone
(its own model, learner, optimizer state, data stream, driver, schedule and workdir) on the same
devices: the learner mesh and `mesh.sampler_replicas` replica meshes, with an Engine of its own on
every replica mesh. A replica mesh serves one pipeline at a time:

  * Replica p is pipeline p's home and serves only it (so each pipeline always has a replica).
    The others start split evenly (replica r with pipeline r mod N) and move.
  * A replica moves when it is idle on its pipeline (nothing waiting, running or being scored
    there: `ReplicaSampler.release_idle`, checked under the pipeline's routing lock, so no request
    is cut short) and the policy's `replica_for` sends it to a pipeline whose waiting sequences
    its own free slots cannot take. The pipeline it joins loads its weights onto it
    (`add_replica`: the switch) and hands it queued requests at once. A replica whose pipeline
    has not started its rollouts yet (its SFT warm start, its first evaluation) or has ended is
    vacant: it goes wherever the policy sends it, and a pipeline that starts claims its home and
    the vacant replicas first assigned to it.
  * With `elastic.migration='tail'` a pipeline's migration is the pool's (`on_demand`,
    rl/elastic/migration.py): while a pipeline's queue waits and no replica is vacant, the policy
    recalls a replica of another rollout (`recall`: the one running fewest sequences, if its
    rollout's other replicas have the slots for them); that sampler stops routing to it and its
    migration moves what runs there onto its other replicas (KV cache and all), after which it
    is idle and moves. A replica that joins a rollout nobody's queue needed (the policy spreads
    it onto the densest rollout, `spread_min`) takes half the sequences of that rollout's
    busiest replica. With migration off a recalled replica just drains.
  * A replica that cannot join the pipeline it is sent to (its weights or its loop fail to start;
    the sampler routes nothing to it) is retired: logged with the error, counted in that
    pipeline's `failed_joins`, and never offered again; the pool goes on moving the others. Any
    other error stops the pool's moves (`error`, logged): the pipelines finish on the replicas
    they hold.

Exactness: a request's tokens do not depend on the replica that samples it (per-request
randomness, batch-independent attention) and a pipeline's learner sees the groups of its own
schedule, so each pipeline's tokens and parameters are bitwise those of its solo run; only the
timing changes (tests/rl/runtime/test_pool.py).

The learner's devices are shared too: each pipeline's learner (its own parameters and optimizer
state, all resident) runs one operation at a time on them, a micro-step (`add_groups`) or an
update, and the pipelines take turns (`learner_turn`, entered by each pipeline's Driver): when
several wait, the policy's `learner_for` picks who goes first (the one whose rollout waits on its
publish, then the shortest work, aged), and its views carry each pipeline's queued learner work,
so the look-ahead rule keeps a replica on a pipeline whose next round is about to start. Work is
estimated from that pipeline's last operations of the same kind.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from absl import logging

from rl.elastic.multiplex import MultiplexConfig, MultiplexPolicy, PipelineView, ReplicaSeat
from rl.runtime.replicas import ReplicaSampler

TICK_S = 0.005  # how often the pool looks for a replica to move


@dataclasses.dataclass
class MemberStats:
    """One pipeline's use of the pool.

    Attributes:
      replica_s: replica-seconds it held (its home included) while its sampler ran (from its
        first round's start to its driver's end).
      moves_in: replicas it received from another pipeline or vacant.
      moves_out: replicas it gave up.
      recalls: replicas recalled from it for another pipeline (emptied before they moved).
      failed_joins: replicas that could not join it (their weights or loop failed to start):
        each is out of the pool from then on (`ReplicaPool.retired`).
      learner_s: seconds its learner operations held the learner's devices.
      learner_wait_s: seconds they waited for their turn.
    """

    replica_s: float = 0.0
    moves_in: int = 0
    moves_out: int = 0
    recalls: int = 0
    failed_joins: int = 0
    learner_s: float = 0.0
    learner_wait_s: float = 0.0


class Member:
    """One pipeline's handle on the pool (what its ThreadsRuntime is given)."""

    def __init__(self, pool: ReplicaPool, index: int):
        self.pool, self.index = pool, index

    @property
    def name(self) -> str:
        return self.pool.names[self.index]

    @property
    def home(self) -> int:
        """The replica mesh only this pipeline uses (its evaluation engine's)."""
        return self.index

    @property
    def replicas(self) -> int:
        """Replica meshes in the pool: the pipeline builds an engine on each."""
        return self.pool.replicas

    def claim(self) -> list[int]:
        """The replica meshes this pipeline's sampler starts on: its home and the vacant ones
        first assigned to it. They are its own from now; `attach` tells the pool its sampler."""
        return self.pool.claim(self.index)

    def attach(self, sampler: ReplicaSampler, engines: Sequence[Any], claimed: Sequence[int]):
        """The pipeline's sampler runs on `claimed` (its replicas 0..k-1, in that order);
        `engines` is its Engine on each replica mesh of the pool, by mesh index."""
        self.pool.attach(self.index, sampler, engines, claimed)

    def leave(self) -> None:
        """The pipeline ended (or failed): its replicas are vacant."""
        self.pool.leave(self.index)

    def shared(self, key: str, make: Callable[[], tuple[Any, Callable[[], None]]]) -> Any:
        """What the pipelines' runtimes share (the Ray runtime's replica host actors), made by the
        first to ask (`make` returns it and what ends it, at the pool's close)."""
        return self.pool.shared(key, make)

    def learner_turn(self, kind: str) -> contextlib.AbstractContextManager[None]:
        """Holds the learner's devices for one of this pipeline's operations (Driver)."""
        return self.pool.learner_turn(self.index, kind)


@dataclasses.dataclass
class _Attached:
    sampler: ReplicaSampler
    engines: list[Any]
    local: dict[int, int]  # mesh -> the sampler's replica index
    rollout_since: float = math.inf


class ReplicaPool:
    """`replicas` sampler replica meshes shared by the pipelines `names` (module docstring).

    Args:
      names: the pipelines, in order (pipeline p's home is replica mesh p).
      replicas: replica meshes in the pool (config.mesh.sampler_replicas); >= len(names).
      policy: decides where an idle replica goes, which one is recalled and whose learner
        operation runs (rl/elastic/multiplex.py); default the look-ahead policy.
      clock: time, for the policy's ages and the stats.
    """

    def __init__(
        self,
        names: Sequence[str],
        *,
        replicas: int,
        policy: MultiplexPolicy | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.names = list(names)
        if len(set(self.names)) != len(self.names) or not self.names:
            raise ValueError(f"ReplicaPool needs distinct pipeline names; received {self.names}.")
        if replicas < len(self.names):
            raise ValueError(
                f"{len(self.names)} pipelines need at least as many sampler replicas (one home "
                f"each); the pool has {replicas} (mesh.sampler_replicas)."
            )
        self.replicas = replicas
        self.policy = policy or MultiplexPolicy(MultiplexConfig(), switch_s=0.0)
        self.clock = clock
        self.holder: list[int | None] = [None] * replicas  # pipeline each mesh serves now
        self.stats = [MemberStats() for _ in self.names]
        self._attached: dict[int, _Attached] = {}
        self._claimed: set[int] = set()
        self._lock = threading.Lock()
        self._turns = threading.Condition(self._lock)  # the learner's devices
        self._learner: int | None = None  # the pipeline whose operation runs on them
        self._last_learner: int | None = None
        self._learner_waits: dict[int, tuple[float, str]] = {}  # pipeline -> (since, kind)
        self._running: tuple[float, str, float] | None = None  # (since, kind, start) of _learner's
        self._learner_est: dict[tuple[int, str], float] = {}  # (pipeline, kind) -> seconds
        self._shared: dict[str, Any] = {}
        self._ends: list[Callable[[], None]] = []
        self._shared_lock = threading.Lock()  # (making one may take long: not the pool's lock)
        self._stop = threading.Event()
        self._last = clock()
        self.error: BaseException | None = None  # what stopped the pool's thread, if anything did
        self.retired: dict[int, BaseException] = {}  # replica -> why it could not join (`_give`)
        self._thread = threading.Thread(target=self._run, name="replica-pool", daemon=True)
        self._thread.start()

    def member(self, index: int) -> Member:
        return Member(self, index)

    # ------------------------------------------------------------------------------ members

    def claim(self, p: int) -> list[int]:
        """Pipeline p's first replica meshes (Member.claim)."""
        with self._lock:
            if p in self._claimed:
                raise RuntimeError(f"Pipeline {self.names[p]!r} already started its sampler.")
            self._claimed.add(p)
            n = len(self.names)
            mine = [
                r
                for r in range(self.replicas)
                if r == p
                or (r >= n and r % n == p and self.holder[r] is None and r not in self.retired)
            ]
            for r in mine:
                self.holder[r] = p
            return mine

    def attach(
        self, p: int, sampler: ReplicaSampler, engines: Sequence[Any], claimed: Sequence[int]
    ) -> None:
        """Pipeline p's sampler runs on `claimed`; `engines`: its Engine on every mesh."""
        if len(engines) != self.replicas:
            raise ValueError(
                f"Pipeline {self.names[p]!r} built {len(engines)} engines; the pool has "
                f"{self.replicas} replica meshes."
            )
        with self._lock:
            self._attached[p] = _Attached(
                sampler, list(engines), {r: i for i, r in enumerate(claimed)}
            )

    def leave(self, p: int) -> None:
        """Pipeline p ended or failed: its replicas are vacant."""
        with self._lock:
            self._account()
            self._attached.pop(p, None)
            for r, h in enumerate(self.holder):
                if h == p:
                    self.holder[r] = None

    @contextlib.contextmanager
    def learner_turn(self, p: int, kind: str) -> Iterator[None]:
        """Pipeline p's learner operation `kind` ("micro_step", "update") runs inside, once the
        learner's devices are granted to it (`_grant`: the policy's pick among those waiting)."""
        with self._turns:
            since = self.clock()
            self._learner_waits[p] = (since, kind)
            self._grant()
            while self._learner != p:
                self._turns.wait()
            start = self.clock()
            self._running = (since, kind, start)
            self.stats[p].learner_wait_s += start - since
        try:
            yield
        finally:
            with self._turns:
                took = self.clock() - start
                self._learner, self._last_learner, self._running = None, p, None
                est = self._learner_est.get((p, kind))
                self._learner_est[(p, kind)] = took if est is None else 0.5 * (est + took)
                self.stats[p].learner_s += took
                self._grant()

    def learner_queue(self) -> list[int]:
        """The pipelines whose learner operations wait for their turn."""
        with self._lock:
            return sorted(self._learner_waits)

    def _grant(self) -> None:
        """The learner's devices, if free, to the waiting pipeline the policy picks (the
        pool's lock held); every waiter looks again."""
        if self._learner is not None or not self._learner_waits:
            return
        views = [self._view(p) for p in range(len(self.names))]
        pick = self.policy.learner_for(views, self._last_learner)
        if pick not in self._learner_waits:  # (a policy's slip must not leave them all waiting)
            pick = min(self._learner_waits, key=lambda p: (self._learner_waits[p][0], p))
        del self._learner_waits[pick]
        self._learner = pick
        self._turns.notify_all()

    def shared(self, key: str, make: Callable[[], tuple[Any, Callable[[], None]]]) -> Any:
        """Member.shared."""
        with self._shared_lock:
            if key not in self._shared:
                self._shared[key], end = make()
                self._ends.append(end)
            return self._shared[key]

    def close(self) -> None:
        """Stops moving replicas (the pipelines' runtimes close their own samplers) and ends what
        they shared. Idempotent."""
        self._stop.set()
        self._thread.join()
        with self._shared_lock:
            ends, self._ends = self._ends, []
        for end in reversed(ends):
            end()

    # ---------------------------------------------------------------------------- decisions

    def _run(self) -> None:
        try:
            while not self._stop.wait(TICK_S):
                with self._lock:
                    self._account()
                    self._tick()
        except BaseException as e:  # the pipelines go on with the replicas they hold
            self.error = e
            logging.exception("The replica pool stopped moving replicas.")

    def _account(self) -> None:
        now = self.clock()
        dt, self._last = now - self._last, now
        for h in self.holder:
            if h is not None and h in self._attached:
                self.stats[h].replica_s += dt

    def _view(self, p: int) -> PipelineView:
        """Pipeline p as the policy sees it (the pool's lock held)."""
        if p == self._learner and self._running is not None:  # its operation runs: what is left
            since, kind, start = self._running
            est = self._learner_est.get((p, kind), 0.0)
            learner = dict(waiting_since=since, learner_s=max(est - (self.clock() - start), 0.0))
        else:
            since, kind = self._learner_waits.get(p, (math.inf, ""))
            learner = dict(waiting_since=since, learner_s=self._learner_est.get((p, kind), 0.0))
        a = self._attached.get(p)
        if a is None or a.sampler.closed:
            return PipelineView(replicas=0, free_slots=0, queued=0, between_rounds=True, **learner)
        pending = a.sampler.pending()
        if not pending:
            a.rollout_since = math.inf
        elif math.isinf(a.rollout_since):
            a.rollout_since = self.clock()
        return PipelineView(
            replicas=len(a.local),
            free_slots=a.sampler.free_slots(),
            running=a.sampler.busy_slots(),
            queued=a.sampler.waiting_sequences(),
            between_rounds=not pending,
            rollout_since=a.rollout_since,
            **learner,
        )

    def _tick(self) -> None:
        n = len(self.names)
        views = [self._view(p) for p in range(n)]
        vacant = PipelineView(replicas=0, free_slots=0, queued=0, between_rounds=True)
        for r in range(n, self.replicas):  # homes never move
            if r in self.retired:
                continue
            h = self.holder[r]
            if h is None:
                dst = self.policy.replica_for([*views, vacant], n)
                if dst not in self._attached:  # (None: it stays vacant)
                    continue
            elif h in self._attached:
                a = self._attached[h]
                i = a.local[r]
                if len(a.local) < 2 or i not in a.sampler.idle_replicas():
                    continue
                dst = self.policy.replica_for(views, h)
                if dst not in self._attached:
                    a.sampler.keep(i)  # (recalled, but nobody waits for it any more)
                    continue
                if not a.sampler.release_idle(i):
                    continue  # it is busy again since the look
                del a.local[r]
                self.holder[r] = None
                self.stats[h].moves_out += 1
                views[h] = self._view(h)
            else:
                continue  # claimed by a pipeline whose sampler is not attached yet
            self._give(r, dst)
            views[dst] = self._view(dst)
        self._recall(views)

    def _recall(self, views: list[PipelineView]) -> None:
        """The replica the policy recalls for a waiting queue, if any (the pool's lock held)."""
        if not any(v.unmet for v in views):
            return  # (nobody waits: no replica is described)
        use = {p: (a.sampler.usage(), a.sampler.leaving) for p, a in self._attached.items()}
        seats = []
        for r, h in enumerate(self.holder):
            if r in self.retired:
                continue  # (not vacant: no pipeline can have it)
            i = self._attached[h].local.get(r) if h in self._attached else None
            if i is None:  # vacant, or claimed by a pipeline not attached yet
                seats.append(ReplicaSeat(index=r, pipeline=None, running=0, free=0))
                continue
            usage, leaving = use[h]
            running, free = usage.get(i, (0, 0))
            seats.append(
                ReplicaSeat(
                    index=r,
                    pipeline=h,
                    running=running,
                    free=free,
                    leaving=i in leaving,
                    home=r < len(self.names),
                )
            )
        r = self.policy.recall(views, seats)
        if r is not None:
            h = self.holder[r]
            if self._attached[h].sampler.recall(self._attached[h].local[r]):
                self.stats[h].recalls += 1

    def _give(self, r: int, p: int) -> None:
        """Replica r (vacant) joins pipeline p. If it cannot (its weights or its loop fail to
        start: the sampler stops it and routes nothing to it), it is retired: logged with the
        error, out of the pool from then on, and the pool goes on moving the others."""
        a = self._attached[p]
        try:
            i = a.sampler.add_replica(a.engines[r], take_queued=True)
        except Exception as e:  # noqa: BLE001 (the replica is retired; the pool goes on)
            if a.sampler.closed:  # its sampler closed meanwhile: the replica stays vacant
                return
            self.retired[r] = e
            self.stats[p].failed_joins += 1
            logging.exception(
                "Replica %d could not join pipeline %r; the pool moves the others without it.",
                r,
                self.names[p],
            )
            return
        a.local[r] = i
        self.holder[r] = p
        self.stats[p].moves_in += 1

    # ------------------------------------------------------------------------------- report

    def shares(self, wall_s: float) -> list[float]:
        """Each pipeline's share of the pool's replica-seconds over `wall_s`."""
        with self._lock:
            self._account()
            return [
                s.replica_s / (self.replicas * wall_s) if wall_s > 0 else 0.0 for s in self.stats
            ]
