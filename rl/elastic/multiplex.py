"""Pipeline multiplexing (JigsawRL): several RL pipelines on one pool of devices.

A pure, clock-free policy, carried out by the simulator (rl/sim/multiplex.py) and the threaded
runtime's pool (rl/runtime/pool.py). The pool is a set of sampler replicas and one learner mesh;
each pipeline (its own model, optimizer, data, schedule) is a graph of sub-stages on them: rollout
waves and a tail on replicas, micro-steps, updates and publishes on the learner. Its gaps are
where another pipeline's sub-stages go.

Two decisions, each asked at a sub-stage boundary with a `PipelineView` of every pipeline:

  replicas  A replica serves one pipeline at a time (it holds that pipeline's weights; moving it
            loads the other's: `switch_s`, charged by the caller). `replica_for(views, owner)`
            says where a vacant replica of `owner` goes: to the pipeline with waiting sequences
            its own free slots cannot take whose round began first (one rollout finished sooner
            feeds the learner sooner), unless the owner's own next demand comes sooner than a
            round trip of switches (look-ahead: the owner is between rounds with under
            2 x switch_s of learner work before its publish), in which case it stays. When no
            queue waits, "lookahead" spreads: the replica joins the rollout with the most
            sequences per replica (if it still runs `spread_min` per replica with it), whose
            migration moves running requests onto it (decode steps read KV in proportion to
            what runs, so half the sequences step almost twice as fast). A replica is never
            taken from a pipeline with work on it; instead, while a queue waits and no replica
            is vacant or on its way, the caller recalls one (`recall`, described by
            `ReplicaSeat`s): that rollout's migration moves what runs there to its other
            replicas (rl.elastic.migration's `tail` with `on_demand`: long-tail consolidation
            exactly when a consumer waits), and once vacant it goes where the queue waits.
  learner   The learner mesh holds every pipeline's parameters and optimizer state (resident, so
            switching between them costs `learner_switch_s`, 0 by default) and runs one
            operation at a time. `learner_for(views, last)` picks whose next operation runs:
            first the pipelines whose rollout waits for their publish (between rounds), then
            the others; among them the one whose queued work would have ended first had it run
            when it was queued (queued at + work left: shortest first, aged, so that no
            pipeline starves behind shorter newer work); the pipeline that ran last keeps the
            learner when a switch costs.

Interference is bounded by construction: two pipelines never share a replica's slots (no decode
step mixes weights) nor an operation on the learner, so each pipeline's tokens and parameters are
those of its solo run (only when they happen changes), and the slowdown of one pipeline is the
time its sub-stages wait for the others' (each pipeline's SimResult has its own wall time).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

POLICIES = ("lookahead", "greedy")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MultiplexConfig:
    """How pipelines share the pool.

    Attributes:
      policy: "lookahead" (the module docstring) or "greedy" (no look-ahead: a vacant replica
        always goes where demand is unmet; the learner runs the oldest queued work).
      switch_s: seconds a replica needs to serve another pipeline (load its weights); None: the
        stage model's publish time (the same bytes over the same link).
      learner_switch_s: seconds the learner needs to switch pipelines (0: states resident).
      spread_min: "lookahead": a vacant replica nobody's queue needs goes to the rollout with the
        most sequences per replica, if it would still run at least this many per replica with
        it (its migration then moves running requests there: rl.elastic.migration's `tail`
        with `on_demand`); 0: never.
    """

    policy: str = "lookahead"
    switch_s: float | None = None
    learner_switch_s: float = 0.0
    spread_min: int = 64

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"MultiplexConfig.policy={self.policy!r}; expected one of {POLICIES}.")
        if self.spread_min < 0:
            raise ValueError(f"MultiplexConfig.spread_min={self.spread_min!r}; expected >= 0.")
        for name in ("switch_s", "learner_switch_s"):
            v = getattr(self, name)
            if v is not None and (not math.isfinite(v) or v < 0):
                raise ValueError(f"MultiplexConfig.{name}={v!r}; expected a finite number >= 0.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PipelineView:
    """One pipeline as the policy sees it.

    Attributes:
      replicas: replicas it holds (switching to it included).
      free_slots: free slots on those replicas.
      queued: sequences waiting for admission.
      between_rounds: nothing to sample until its learner publishes (its rollout waits).
      learner_s: learner work queued (seconds; the operation in flight counts what is left);
        between rounds, what stands before its publish.
      waiting_since: when its oldest queued learner operation was queued (inf: none).
      rollout_since: when its oldest round still sampling began (inf: none).
      running: sequences running on its replicas.
    """

    replicas: int
    free_slots: int
    queued: int
    between_rounds: bool
    running: int = 0
    learner_s: float = 0.0
    waiting_since: float = math.inf
    rollout_since: float = math.inf

    @property
    def unmet(self) -> int:
        """Sequences waiting that its own free slots cannot take now."""
        return max(self.queued - self.free_slots, 0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReplicaSeat:
    """One replica of the pool, as `recall` sees it.

    Attributes:
      index: the replica.
      pipeline: the pipeline it serves (None: vacant).
      running: sequences running there.
      free: its free slots.
      leaving: recalled already (its migration empties it).
      arriving: switching to its pipeline (weights on their way).
      home: it never leaves its pipeline.
    """

    index: int
    pipeline: int | None
    running: int
    free: int
    leaving: bool = False
    arriving: bool = False
    home: bool = False


class MultiplexPolicy:
    """The decisions of the module docstring; `switch_s` is the replica switch cost."""

    def __init__(self, config: MultiplexConfig, *, switch_s: float):
        if not math.isfinite(switch_s) or switch_s < 0:
            raise ValueError(f"switch_s={switch_s!r}; expected a finite number >= 0.")
        self.config, self.switch_s = config, switch_s

    def replica_for(self, views: Sequence[PipelineView], owner: int) -> int | None:
        """Where an idle replica of pipeline `owner` goes; None: it stays."""
        mine = views[owner]
        if mine.unmet > 0:
            return None
        lookahead = self.config.policy == "lookahead"
        if (
            lookahead
            and mine.between_rounds
            and math.isfinite(mine.waiting_since)  # its learner has work: a round will follow
            and mine.learner_s <= 2 * self.switch_s
        ):
            return None  # its next round comes before a replica could go and come back
        demand = [i for i, v in enumerate(views) if i != owner and v.unmet > 0]
        if demand:
            return min(demand, key=lambda i: (views[i].rollout_since, i))  # the oldest rollout
        if not lookahead or not self.config.spread_min or self._spreads(mine, mine.replicas):
            return None  # (its own rollout spreads onto it)
        spread = [i for i, v in enumerate(views) if i != owner and self._spreads(v, v.replicas + 1)]
        if not spread:
            return None
        return max(spread, key=lambda i: (views[i].running / max(views[i].replicas, 1), -i))

    def recall(self, views: Sequence[PipelineView], seats: Sequence[ReplicaSeat]) -> int | None:
        """The replica the pool recalls now (None: none): while pipelines' queues wait (`unmet`)
        and fewer replicas are leaving or on their way than pipelines wait, under "lookahead"
        the replica of another rollout holding several that runs fewest sequences, if that
        rollout's other replicas have the free slots for them (a rollout waiting for slots is on
        its round's critical path; the one recalled from keeps the others it holds). Homes never
        move. Never under "greedy"."""
        waiting = {p for p, v in enumerate(views) if v.unmet > 0}
        if self.config.policy != "lookahead" or not waiting:
            return None
        if sum(s.leaving or s.arriving for s in seats) >= len(waiting):
            return None
        candidates = []
        for p in range(len(views)):
            if p in waiting:
                continue
            held = [s for s in seats if s.pipeline == p and not (s.leaving or s.arriving)]
            free = sum(s.free for s in held)
            for s in held:
                if len(held) > 1 and not s.home and 0 < s.running <= free - s.free:
                    candidates.append(s)
        return min(candidates, key=lambda s: (s.running, s.index)).index if candidates else None

    def _spreads(self, v: PipelineView, replicas: int) -> bool:
        """Its rollout would run at least spread_min sequences per replica on `replicas`."""
        return not v.between_rounds and v.running >= self.config.spread_min * replicas

    def learner_for(self, views: Sequence[PipelineView], last: int | None) -> int | None:
        """Whose queued learner work runs next; None: none is queued."""
        ready = [i for i, v in enumerate(views) if math.isfinite(v.waiting_since)]
        if not ready:
            return None
        if self.config.policy == "greedy":
            return min(ready, key=lambda i: (views[i].waiting_since, i))
        if any(views[i].between_rounds for i in ready):
            ready = [i for i in ready if views[i].between_rounds]
        if self.config.learner_switch_s > 0 and last in ready:
            return last
        # Shortest first, aged: the work that would end first had it run the moment it was queued
        # (pure shortest-first starved one pipeline of four in the simulator).
        return min(ready, key=lambda i: (views[i].waiting_since + views[i].learner_s, i))
