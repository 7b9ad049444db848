"""The discrete-event simulator of the runtime, on a virtual clock, driving the real schedules.

The schedule (rl.schedules: sync, cgp with the stream trainer and tail-batched rounds, async) is the
same object rl/driver.py drives: the simulator tells it when groups arrive, updates end and weights
reach the sampler, and does what it says: Submit goes to the simulated sampler (rl/sim/sampler.py,
driven by the real admission policies, a short round's RoundCut with it), Add is a "micro_step" span
on the learner (rl/sim/learner.py: its operations in order, one at a time), Update an "update"
span, Publish a "publish" span (the learner waits for it). Round
modes begin the next round when the previous one's weights are published; `async` submits as its
staleness bound allows. Only the engine, the learner and the weight transfer are time models.

Contention (StageModel.contention = g): while both sides are busy, sampler calls take 1 + g times
longer and the learner progresses at 1 / (1 + g) of its speed.

A device pool (`pool`, a `PoolHooks`: borrowing in rl/sim/borrow.py, multiplexing in
rl/sim/multiplex.py) moves devices between the learner, the sampler and other pipelines; several
Simulators share one `Clock` when they share a pool.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from rl.admission import AdmissionPolicy, make_policy
from rl.elastic.migration import MigrationConfig, make_migration_policy
from rl.elastic.stage import StageModel
from rl.formation import BatchFormer
from rl.metrics import migration_metrics, round_metrics, staleness_metrics
from rl.round_planner import RoundPlan, RoundPlanner
from rl.schedules import (
    Action,
    Add,
    Begin,
    Publish,
    RoundDone,
    ScheduleConfig,
    Submit,
    Update,
    make_schedule,
)
from rl.sim.learner import LearnerOp, SimLearner
from rl.sim.sampler import SIM_ROUTINGS, SimSampler
from rl.sim.workload import Workload
from rl.timeline import Timeline
from rl.types import Group, Request, SamplingParams


@dataclasses.dataclass(frozen=True, kw_only=True)
class SimConfig(ScheduleConfig):
    """What to simulate: the schedule (rl.schedules.ScheduleConfig) and the sampler's shape."""

    prefix: ClassVar[str] = "SimConfig"

    batching: str = "fifo"  # rl.formation former name (cgp; sync trains in logical order)
    groups_per_round: int = 32  # R (P0 under tail batching)
    max_new_tokens: int = 8192  # the requests' response cap (long rounds may override)
    replicas: int = 1  # sampler data-parallel replicas (engines)
    slots: int = 256  # slots per replica
    routing: str = "shared"  # shared | round_robin (rl/sim/sampler.py)
    migration: MigrationConfig = MigrationConfig()  # long-tail migration between replicas
    migration_consumer: bool = False  # `tail` acts (none in one pipeline: forced to measure it)
    checkpoint_every: int = 0  # async: a barrier every this many rounds (the run's checkpoints)
    keep_sampling: bool = False  # async: at those barriers only the learner waits (no_bubble)

    def __post_init__(self):
        super().__post_init__()
        if self.routing not in SIM_ROUTINGS:
            raise ValueError(f"SimConfig.routing={self.routing!r}; expected one of {SIM_ROUTINGS}.")
        for name in ("group_size", "max_new_tokens", "replicas", "slots"):
            if getattr(self, name) < 1:
                raise ValueError(f"SimConfig.{name} must be >= 1; received {getattr(self, name)}.")
        if self.slots < self.group_size:
            raise ValueError(
                f"SimConfig.slots ({self.slots}) must be >= group_size ({self.group_size}): a "
                "group is admitted whole into one replica."
            )


class Clock:
    """The virtual clock: `at(t, fn)` runs fn(t) when the clock reaches t (ties in call order)."""

    def __init__(self):
        self._events: list[tuple[float, int, Callable[[float], None]]] = []
        self._seq = itertools.count()

    def at(self, t: float, fn: Callable[[float], None]) -> None:
        heapq.heappush(self._events, (t, next(self._seq), fn))

    def run(self) -> None:
        """Runs events until none is left."""
        while self._events:
            t, _, fn = heapq.heappop(self._events)
            fn(t)


class PoolHooks:
    """What a device-pool controller hears from its Simulator (every hook is optional)."""

    def attach(self, sim: Simulator) -> None:
        """Called once, when the Simulator is built."""

    def check(self, now: float) -> None:
        """The learner is between operations (or held), or the sampler turned busy or idle."""

    def before_publish(self, now: float) -> None:
        """A Publish is about to be queued on the learner."""

    def before_submit(self, round: int, requests: Sequence[Request], now: float) -> float:
        """A round's requests are about to be queued on the sampler; returns how long their
        submission waits (seconds: the sampler changes first, as a lender's replicas join)."""
        return 0.0

    def on_submit(self, now: float) -> None:
        """Requests were queued on the sampler."""

    def on_replica_idle(self, index: int, now: float) -> None:
        """Sampler replica `index` has nothing running."""

    def round_metrics(self, r: int) -> dict[str, Any]:
        """Extra metrics of round r."""
        return {}


@dataclasses.dataclass
class SimResult:
    """Per-round metrics (rl.metrics.round_metrics, kind, groups, round_s, lag) and the Timeline.

    rl.sim.compare.summarize gives means over rounds and the time per trained group.
    """

    config: SimConfig
    rounds: list[dict[str, float | str]]
    timeline: Timeline
    counters: dict[str, Any]  # the sampler's counts, replica_busy_s (replica-seconds busy) and
    # learner_busy_s (seconds the learner worked: steps, updates, publishes)
    end_s: float  # virtual time when the last round's publish ended


def _tokens(group: Group) -> int:
    return sum(len(c.prompt) + len(c.tokens) for c in group.completions)


class Simulator:
    """Runs rounds of a SimConfig against a StageModel and a Workload; see the module docstring.

    Args:
      cfg: what to simulate.
      model: stage-time model (one sampler replica, the learner, the weight transfer).
      workload: prompts and response lengths.
      make_admission: builds an admission policy from cfg.admission (default rl.admission's).
      make_batches: builds a batch former (name, U, groups) (default rl.formation's registry).
      planner: the round planner (default rl.round_planner.RoundPlanner over the workload's prompts).
      timeline: where spans go (a fresh Timeline by default).
      pool: a device-pool controller (borrowing, multiplexing); None: a static split.
      clock: the virtual clock (a fresh one by default; pipelines sharing a pool share one).
    """

    def __init__(
        self,
        cfg: SimConfig,
        model: StageModel,
        workload: Workload,
        *,
        make_admission: Callable[[str], AdmissionPolicy] = make_policy,
        make_batches: Callable[[str, int, int | None], BatchFormer] | None = None,
        planner: RoundPlanner | None = None,
        timeline: Timeline | None = None,
        pool: PoolHooks | None = None,
        clock: Clock | None = None,
    ):
        self.cfg, self.model, self.workload = cfg, model, workload
        self.make_batches = make_batches
        self.planner = planner or RoundPlanner(
            cfg.tail,
            groups_per_round=cfg.groups_per_round,
            prompts=workload.prompts(),
            epoch_size=cfg.epoch_size or None,
        )
        self.timeline = Timeline() if timeline is None else timeline
        self.clock = Clock() if clock is None else clock
        n_policies = cfg.replicas if cfg.routing == "round_robin" else 1
        self.sampler = SimSampler(
            model,
            workload,
            [make_admission(cfg.admission) for _ in range(n_policies)],
            replicas=cfg.replicas,
            slots=cfg.slots,
            routing=cfg.routing,
            schedule=self.at,
            emit=self._on_group,
            on_busy=self._on_sampler_busy,
            on_idle=self._on_replica_idle,
            timeline=self.timeline,
            migration=None
            if cfg.migration.policy == "off"
            else make_migration_policy(cfg.migration, consumer=cfg.migration_consumer),
        )
        self.schedule: Any = None
        self.on_update: Callable[[Update], None] | None = None  # called as each update ends
        self.learner = SimLearner(
            model,
            at=self.at,
            timeline=self.timeline,
            check=self._check_pool,
            on_busy=self._on_learner_busy,
        )
        self._starts: dict[int, float] = {}  # round -> when its first requests were submitted
        self._done: dict[int, RoundDone] = {}
        self._lags: dict[int, list[dict[str, float]]] = {}
        self._begin_next: int | None = None
        self._stop_after = 0
        self._end = 0.0
        # Borrowing (rl/sim/borrow.py): the round's emitted tokens not yet costed, the updates
        # Begin announced.
        self.updates_planned = 0
        self._emitted_tokens: dict[int, int] = {}
        self._costed_tokens: dict[int, int] = {}
        self.pool = pool
        if pool is not None:
            pool.attach(self)

    def _requests(self, plan: RoundPlan) -> list[Request]:
        return plan.requests(
            group_size=self.cfg.group_size,
            params=SamplingParams(max_new_tokens=self.cfg.max_new_tokens),
        )

    # ------------------------------------------------------------------------------ the clock

    def at(self, t: float, fn: Callable[[float], None]) -> None:
        """Calls fn(t) when the virtual clock reaches t."""
        self.clock.at(t, fn)

    def open_rounds(self) -> list[int]:
        """Rounds begun (requests submitted) and not done, oldest first."""
        return sorted(set(self._starts) - set(self._done))

    def round_start(self, r: int) -> float:
        """When round r's first requests were submitted."""
        return self._starts[r]

    def updates_done(self, r: int) -> int:
        """Updates applied so far with round r's groups."""
        return len(self._lags.get(r, []))

    def run(self, rounds: int) -> SimResult:
        """Simulates `rounds` rounds (fewer if the round planner runs out of prompts)."""
        self.start(rounds)
        self.clock.run()
        return self.result()

    def start(self, rounds: int) -> None:
        """Builds the schedule and queues the first publish and round on the clock."""
        if rounds < 1:
            raise ValueError(f"rounds must be >= 1; received {rounds}.")
        if self.schedule is not None:
            raise RuntimeError("Simulator.run was already called; build a new Simulator.")
        self._stop_after = rounds
        kw = {} if self.make_batches is None else {"make_former": self.make_batches}
        self.schedule = make_schedule(
            self.cfg,
            planner=self.planner,
            requests_of=self._requests,
            rounds=rounds,
            barrier_every=self.cfg.checkpoint_every,
            keep_sampling=self.cfg.keep_sampling,
            **kw,
        )
        t = self.model.publish_s()
        self.learner.publish_span(0.0, t, version=0, round=-1)
        self.at(t, lambda t: self._begin(0, t))

    def result(self) -> SimResult:
        """The run's metrics, once the clock has run out of events."""
        open_rounds = self.open_rounds()
        if open_rounds or self.learner.op is not None:
            raise RuntimeError(
                f"Simulation stalled with rounds {open_rounds} unfinished after {self.learner.steps} "
                "updates (a request that never fits, or a former that never releases its batch?)."
            )
        out = []
        order = sorted(self._done)
        ends = [self._starts[r] for r in order[1:]] + [self._end]
        for r, end in zip(order, ends, strict=True):
            done, start = self._done[r], self._starts[r]
            m: dict[str, float | str] = dict(
                round_metrics(
                    self.timeline,
                    round=r,
                    rollout_start=start,
                    num_slots=self.sampler.slots * self.sampler.peak_replicas,
                )
            )
            if self.pool is not None:
                m.update(self.pool.round_metrics(r))
            lags = self._lags.get(r, [])
            m.update(migration_metrics(self.timeline, round=r, rollout_start=start))
            m.update(
                kind=done.plan.kind,
                version=float(done.version),
                groups_launched=float(len(done.plan.prompts)),
                groups_trained=float(len(done.trained)),
                round_s=end - start,  # rollout start -> the next round's (publish included)
                lag_max=max((x["lag_max"] for x in lags), default=float("nan")),
                lag_mean=sum(x["lag_mean"] for x in lags) / len(lags) if lags else float("nan"),
            )
            out.append(m)
        c: dict[str, Any] = dataclasses.asdict(self.sampler.counters)
        c["replica_busy_s"] = sum(self.sampler.replica_busy_s(self._end))
        c["learner_busy_s"] = self.learner.busy_s
        return SimResult(self.cfg, out, self.timeline, c, self._end)

    # --------------------------------------------------------------------------- the schedule

    def _begin(self, r: int, now: float) -> None:
        if r >= self._stop_after:
            self._end = now
            return
        try:
            actions = self.schedule.begin(r)
        except StopIteration:
            self._end = now
            return
        self._do(actions, now)

    def _do(self, actions: list[Action], now: float) -> None:
        """Does what the schedule says; learner work is queued in order."""
        for a in actions:
            if isinstance(a, Submit):
                self._starts.setdefault(a.round, now)
                hold = (
                    0.0 if self.pool is None else self.pool.before_submit(a.round, a.requests, now)
                )
                if hold > 0:
                    self.at(now + hold, lambda t, a=a: self._submit(a, t))
                else:
                    self._submit(a, now)
            elif isinstance(a, Begin):
                self.updates_planned = a.updates  # the behaviour snapshot costs nothing here
            elif isinstance(a, Add):
                self._add(list(a.groups), now, a.round)
            elif isinstance(a, Update):
                self._update(a, now)
            elif isinstance(a, Publish):
                if self.pool is not None:
                    self.pool.before_publish(now)
                args = dict(version=a.version, round=a.round)
                op = LearnerOp("publish", self.model.publish_s(), args, self._published)
                self.learner.queue(op, now)
            elif isinstance(a, RoundDone):
                self._done[a.plan.round] = a
                self._begin_next = a.plan.round + 1
            else:
                raise TypeError(f"Unknown schedule action {a!r}.")

    def _submit(self, a: Submit, now: float) -> None:
        self.sampler.submit(a.requests, now, cut=a.cut)
        if self.pool is not None:
            self.pool.on_submit(now)

    def _on_group(self, group: Group, now: float) -> None:
        """A complete group (the sampler applied the round's cut)."""
        r = group.request.round
        self._emitted_tokens[r] = self._emitted_tokens.get(r, 0) + _tokens(group)
        self._do(self.schedule.on_group(group), now)

    def _published(self, now: float) -> None:
        self.sampler.version = self.schedule.version
        self._do(self.schedule.on_published(), now)
        if self._begin_next is not None:
            r, self._begin_next = self._begin_next, None
            self._begin(r, now)

    # ---------------------------------------------------------------------------- the learner

    def round_tokens_unadded(self, r: int) -> int:
        """Tokens of round r's emitted groups not yet in a learner operation."""
        return self._emitted_tokens.get(r, 0) - self._costed_tokens.get(r, 0)

    def _add(self, groups: list[Group], now: float, round: int) -> None:
        self._costed_tokens[round] = self._costed_tokens.get(round, 0) + sum(map(_tokens, groups))
        self.learner.queue(self.learner.micro_steps(groups, self._args(groups, round)), now)

    def _update(self, up: Update, now: float) -> None:
        def done(t: float) -> None:
            self._lags.setdefault(up.round, []).append(staleness_metrics(up.batch, up.version))
            if self.on_update is not None:
                self.on_update(up)
            self._do(self.schedule.on_update_done(), t)

        self.learner.queue(self.learner.update(self._args(up.batch, up.round), done), now)

    @staticmethod
    def _args(groups: Any, round: int) -> dict[str, Any]:
        return dict(round=round, tokens=sum(len(c.tokens) for g in groups for c in g.completions))

    def _check_pool(self, now: float) -> None:
        if self.pool is not None:
            self.pool.check(now)

    def _on_learner_busy(self, busy: bool, now: float) -> None:
        if self.model.contention:
            self.sampler.set_factor(1.0 + self.model.contention if busy else 1.0, now)

    def _on_replica_idle(self, index: int, now: float) -> None:
        if self.pool is not None:
            self.pool.on_replica_idle(index, now)

    def _on_sampler_busy(self, busy: bool, now: float) -> None:
        self._check_pool(now)
        self.learner.set_rate(1.0 / (1.0 + self.model.contention) if busy else 1.0, now)
