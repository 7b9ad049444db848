"""Pipeline multiplexing in the simulator: N pipelines' Simulators on one pool and one clock.

Each pipeline is a whole Simulator (its schedule, round planner, workload, learner queue, weights'
version, timeline), built over every replica of the pool; the replicas it does not hold are
parked (no slots, invisible to its admission and migration). rl.elastic.multiplex's policy
decides, at each sub-stage boundary:

  replicas  when a replica turns vacant (nothing running, arriving or planned) or a pipeline
            queues requests, each vacant replica is offered to the policy; one that moves is
            parked in its owner at once and joins its new pipeline after the switch (a "switch"
            span on pool/replica{i}: that pipeline's weights loaded), then admits its requests.
  learner   the learner mesh runs one pipeline's operation at a time: whenever it is free, the
            policy picks whose queued operation runs (the others' learners are held, as
            borrowing holds a lent learner), after `learner_switch_s` if the pipeline changes
            (a "switch" span on pool/learner).

Initially replica i belongs to pipeline i mod N. Pipelines must run with contention 0 (devices
are disaggregated) and routing "shared". Their migration is `tail` with `on_demand`
(compare_multiplexing's default): a replica that joins a rollout nobody's queue needed takes
half the running sequences of its busiest replica (spread), and while a pipeline's queue waits
with no replica vacant or on its way, the pool recalls the replica of another rollout that runs
fewest sequences (MultiplexPolicy.recall, Replica.leaving): its migration moves them to that
rollout's other replicas and the vacant replica goes to the queue. Consolidating a tail only when
a consumer waits measured better than consolidating every tail ahead (`tail` alone: sync 1.05x /
1.49x / 1.43x the static partition at N = 2 / 3 / 4, rollout 70% of a step; on demand with
spreading 1.24x / 1.52x / 1.48x).

`compare_multiplexing` runs the same pipelines three ways: back to back (each alone on the whole
pool), on a static partition (each on its share of the replicas and of the learner's devices) and
multiplexed, with the bound no multiplexing can beat (the slowest pipeline alone on the pool, or
the learner's total work done back to back without a gap).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

from rl.elastic.migration import MigrationConfig
from rl.elastic.multiplex import MultiplexConfig, MultiplexPolicy, PipelineView, ReplicaSeat
from rl.elastic.stage import StageModel
from rl.sim.compare import sim_config
from rl.sim.replica import Replica
from rl.sim.simulator import Clock, PoolHooks, SimConfig, SimResult, Simulator
from rl.sim.workload import Workload, WorkloadConfig
from rl.timeline import Timeline


@dataclasses.dataclass
class MultiplexResult:
    """Each pipeline's SimResult, the pool's timeline (switches) and its counters."""

    pipelines: list[SimResult]
    timeline: Timeline
    counters: dict[str, Any]  # replica_switches, learner_switches, learner_busy_s, replica_busy_s
    end_s: float  # when the last pipeline ended

    @property
    def groups(self) -> float:
        return sum(float(r["groups_trained"]) for p in self.pipelines for r in p.rounds)

    def pool_timeline(self) -> Timeline:
        """One timeline of the pool: each replica's sequences on its row (pool/replica{i}, args
        pipeline), the learner's operations and publishes on "learner", the switches."""
        out = Timeline()
        for p, result in enumerate(self.pipelines):
            slots = result.config.slots
            for s in result.timeline.spans():
                if s.lane.startswith("sampler/slot"):
                    replica = int(s.lane.removeprefix("sampler/slot")) // slots
                    lane = f"pool/replica{replica}"
                elif s.lane in ("learner", "publish") and s.args.get("round") != -1:
                    lane = "learner"
                else:
                    continue
                out.span(lane, s.name, s.start, s.end, **{**s.args, "pipeline": p})
        for s in self.timeline.spans():
            out.span(s.lane.replace("pool/learner", "learner"), s.name, s.start, s.end, **s.args)
        return out

    def write_gantt_png(self, path: str, title: str = "") -> None:
        """The pool's Gantt chart: each bar colored by its pipeline, switches apart."""
        self.pool_timeline().write_gantt_png(
            path,
            title,
            color_by=lambda s: "switch" if s.name == "switch" else f"pipeline {s.args['pipeline']}",
        )


class _Seat(PoolHooks):
    """One pipeline's hooks into the pool."""

    def __init__(self, pool: MultiplexSim, index: int):
        self.pool, self.index = pool, index

    def check(self, now: float) -> None:
        self.pool.learner_check(now)
        self.pool.rebalance_soon(now)  # a kept replica's owner may have moved on

    def on_submit(self, now: float) -> None:
        self.pool.rebalance_soon(now)

    def on_replica_idle(self, index: int, now: float) -> None:
        self.pool.rebalance_soon(now)


class MultiplexSim:
    """N pipelines (their SimConfigs and workloads) on one pool; see the module docstring.

    Args:
      configs: one per pipeline; each `replicas` is the pool's replicas (every pipeline's
        Simulator spans the pool), routing "shared", contention 0 in `model`.
      model: the stage-time model (one replica, the pool's learner, the weight transfer).
      workloads: one per pipeline.
      mux: how the pool is shared (default MultiplexConfig()).
    """

    def __init__(
        self,
        configs: Sequence[SimConfig],
        model: StageModel,
        workloads: Sequence[Workload],
        mux: MultiplexConfig | None = None,
    ):
        if not configs or len(configs) != len(workloads):
            raise ValueError(
                f"MultiplexSim takes one workload per pipeline and >= 1 pipeline; received "
                f"{len(configs)} configs and {len(workloads)} workloads."
            )
        replicas = {c.replicas for c in configs}
        if len(replicas) != 1 or any(c.routing != "shared" for c in configs):
            raise ValueError(
                "MultiplexSim: every pipeline spans the pool (the same `replicas`) with routing "
                f"'shared'; received replicas {sorted(replicas)}, routing "
                f"{sorted({c.routing for c in configs})}."
            )
        if model.contention:
            raise ValueError(
                f"MultiplexSim needs a disaggregated pool (StageModel.contention 0); received "
                f"{model.contention}."
            )
        self.clock, self.timeline = Clock(), Timeline()
        mux = MultiplexConfig() if mux is None else mux
        switch_s = model.publish_s() if mux.switch_s is None else mux.switch_s
        self.mux, self.policy = mux, MultiplexPolicy(mux, switch_s=switch_s)
        self.sims = [
            Simulator(cfg, model, wl, pool=_Seat(self, i), clock=self.clock)
            for i, (cfg, wl) in enumerate(zip(configs, workloads, strict=True))
        ]
        n = len(self.sims)
        self.owner = [i % n for i in range(replicas.pop())]  # replica -> its pipeline
        self.arriving: set[int] = set()  # replicas switching to their owner
        for i, sim in enumerate(self.sims):
            for rep in sim.sampler.replicas:
                rep.parked = self.owner[rep.index] != i
        self.last_learner: int | None = None
        self.learner_held = False  # a learner switch in progress: nobody runs
        self._rebalance_due = False
        self.counters: dict[str, Any] = dict(replica_switches=0, learner_switches=0, recalls=0)

    # -------------------------------------------------------------------------------- run

    def run(self, rounds: int) -> MultiplexResult:
        """Runs every pipeline for `rounds` rounds; raises if any stalls."""
        for sim in self.sims:
            sim.start(rounds)
        self.clock.run()
        results = [sim.result() for sim in self.sims]
        self.counters["learner_busy_s"] = sum(r.counters["learner_busy_s"] for r in results)
        self.counters["replica_busy_s"] = sum(r.counters["replica_busy_s"] for r in results)
        return MultiplexResult(results, self.timeline, self.counters, max(r.end_s for r in results))

    # ---------------------------------------------------------------------------- views

    def _view(self, i: int, now: float) -> PipelineView:
        sim = self.sims[i]
        held = [r for r in sim.sampler.replicas if self.owner[r.index] == i]
        ops = ([sim.learner.op] if sim.learner.op is not None else []) + sim.learner.ops
        return PipelineView(
            replicas=len(held),
            free_slots=sum(len(r.free_slots()) for r in held),
            queued=sim.sampler.queued,
            between_rounds=sim.sampler.outstanding == 0,
            running=sum(r.active for r in held),
            learner_s=sim.learner.left_s(now),
            waiting_since=min((op.queued for op in ops), default=math.inf),
            rollout_since=min((sim.round_start(r) for r in sim.open_rounds()), default=math.inf),
        )

    def views(self, now: float) -> list[PipelineView]:
        return [self._view(i, now) for i in range(len(self.sims))]

    # -------------------------------------------------------------------------- replicas

    def rebalance_soon(self, now: float) -> None:
        """Offers the vacant replicas to the policy once the events of `now` have run."""
        if not self._rebalance_due:
            self._rebalance_due = True
            self.clock.at(now, self._rebalance)

    def _rebalance(self, now: float) -> None:
        self._rebalance_due = False
        for index, owner in enumerate(self.owner):
            if index in self.arriving:
                continue
            rep = self.sims[owner].sampler.replicas[index]
            if not rep.vacant:
                continue
            to = self.policy.replica_for(self.views(now), owner)
            if to is not None and to != owner:
                self._move(index, owner, to, now)
            else:
                rep.leaving = False  # recalled, but nobody wants it any more: it stays
        self._recall(now)

    def _recall(self, now: float) -> None:
        """The replica the policy recalls (MultiplexPolicy.recall: while a queue waits and none
        is vacant or on its way, another rollout's replica running fewest sequences). Its
        migration (`tail`: ReplicaView.leaving) moves them to that rollout's other replicas;
        once vacant it goes where the queue waits. This is long-tail consolidation on demand:
        it frees a replica exactly when a consumer waits for one."""
        seats = []
        for index, owner in enumerate(self.owner):
            rep = self._replica(index)
            seats.append(
                ReplicaSeat(
                    index=index,
                    pipeline=owner,
                    running=rep.active,
                    free=len(rep.free_slots()),
                    leaving=rep.leaving,
                    arriving=index in self.arriving,
                )
            )
        index = self.policy.recall(self.views(now), seats)
        if index is not None:
            self._replica(index).leaving = True
            self.counters["recalls"] += 1

    def _replica(self, index: int) -> Replica:
        return self.sims[self.owner[index]].sampler.replicas[index]

    def _move(self, index: int, src: int, dst: int, now: float) -> None:
        rep = self.sims[src].sampler.replicas[index]
        rep.parked, rep.leaving = True, False
        self.owner[index] = dst
        self.arriving.add(index)
        end = now + self.policy.switch_s
        self.timeline.span(
            f"pool/replica{index}", "switch", now, end, replica=index, src=src, dst=dst
        )
        self.counters["replica_switches"] += 1

        def join(t: float) -> None:
            self.arriving.discard(index)
            sampler = self.sims[dst].sampler
            sampler.replicas[index].parked = False
            sampler.step(sampler.replicas[index], t)  # admits what waits
            self.rebalance_soon(t)  # what waited may be gone: it may move on

        self.clock.at(end, join)

    # --------------------------------------------------------------------------- learner

    def learner_check(self, now: float) -> None:
        """Whenever a pipeline's learner is between operations: if the learner mesh is free,
        the policy picks whose operation runs next; every other pipeline's learner is held."""
        if self.learner_held or any(sim.learner.op is not None for sim in self.sims):
            for sim in self.sims:
                sim.learner.blocked = sim.learner.op is None
            return
        pick = self.policy.learner_for(self.views(now), self.last_learner)
        for i, sim in enumerate(self.sims):
            sim.learner.blocked = i != pick
        if pick is None:
            return
        cost = self.mux.learner_switch_s if pick != self.last_learner else 0.0
        if self.last_learner is not None and pick != self.last_learner:
            self.counters["learner_switches"] += 1
        self.last_learner = pick
        sim = self.sims[pick]
        if cost > 0:
            self.learner_held = True
            sim.learner.blocked = True
            self.timeline.span("pool/learner", "switch", now, now + cost, dst=pick)

            def go(t: float) -> None:
                self.learner_held = False
                sim.learner.blocked = False
                sim.learner.resume(t)

            self.clock.at(now + cost, go)
        else:
            self.clock.at(now, sim.learner.resume)


TAIL = MigrationConfig(policy="tail", on_demand=True)


def _groups(result: SimResult) -> float:
    return sum(float(r["groups_trained"]) for r in result.rounds)


def learner_share(model: StageModel, pipelines: int) -> StageModel:
    """The learner of one pipeline's static share (1 / `pipelines` of the learner's devices): only
    the per-token term scales, as in rl.elastic.borrowing's T_learn."""
    return model.replace(learner_per_token=model.learner_per_token * pipelines)


def compare_multiplexing(
    mode: str,
    model: StageModel,
    workloads: Sequence[WorkloadConfig],
    *,
    rounds: int,
    mux: MultiplexConfig | None = None,
    migration: MigrationConfig = TAIL,
    on_result: Callable[[MultiplexResult], None] | None = None,
    **fields: Any,
) -> dict[str, float]:
    """One pipeline per workload, all running `mode` (an rl.sim.compare mode name) for `rounds`
    rounds with `fields` (replicas: the pool's), three ways; see the module docstring. Returns the
    wall times, the multiplexed run's speed-up over each, and `bound_vs_static`; `on_result` gets
    the multiplexed run's MultiplexResult."""
    n, replicas = len(workloads), fields.get("replicas", SimConfig.replicas)
    if not 1 <= n <= replicas:
        raise ValueError(
            f"compare_multiplexing: 1 <= pipelines <= replicas (a static share holds a replica); "
            f"received {n} pipelines on {replicas} replicas."
        )
    solo = [
        Simulator(sim_config(mode, **fields), model, Workload(w)).run(rounds) for w in workloads
    ]
    share = learner_share(model, n)
    static = [
        Simulator(
            sim_config(mode, **{**fields, "replicas": replicas // n + (i < replicas % n)}),
            share,
            Workload(w),
        ).run(rounds)
        for i, w in enumerate(workloads)
    ]
    cfg = sim_config(mode, **fields, migration=migration, migration_consumer=True)
    muxed = MultiplexSim([cfg] * n, model, [Workload(w) for w in workloads], mux).run(rounds)
    if on_result is not None:
        on_result(muxed)
    groups = sum(map(_groups, solo))
    if muxed.groups != groups or sum(map(_groups, static)) != groups:
        raise RuntimeError("compare_multiplexing: the three runs trained different groups.")
    back = sum(r.end_s for r in solo)
    part = max(r.end_s for r in static)
    floor = max(max(r.end_s for r in solo), sum(r.counters["learner_busy_s"] for r in solo))
    return dict(
        pipelines=float(n),
        groups=groups,
        back_to_back_s=back,
        static_s=part,
        multiplexed_s=muxed.end_s,
        vs_static=part / muxed.end_s,
        vs_back_to_back=back / muxed.end_s,
        static_vs_back_to_back=back / part,
        bound_vs_static=part / floor,
        replica_switches=float(muxed.counters["replica_switches"]),
        learner_busy=muxed.counters["learner_busy_s"] / muxed.end_s,
    )
