"""The discrete-event simulator of rl/driver.py's rounds, on a virtual clock.

Per round, as the real driver: the round planner (rl.rounds.RoundPlanner) gives the prompts and how
many groups the round trains; a short round's RoundCut goes with its requests to the sampler
(rl/sim/sampler.py, driven by the real admission policies), which emits the groups the cut keeps and
aborts the rest once it is full. The learner side follows the driver's three paths: `sync` waits for
the round and trains rl.formation.logical_batches (U groups in logical order); `cgp` with a cut or
`fifo` batches is the stream trainer (each group is added at once, one "micro_step" span, and a
rl.formation former releases an "update" per U groups); `cgp` + `ordered` adds and updates per
released batch. After the round's updates a "publish" span moves the weights, then the next round
starts. Policy objects are the project's own (or the ones passed in), so the simulator runs the code
the real runtime runs; only the engine, the learner and the weight transfer are time models.

Contention (StageModel.contention = g): while both sides are busy, sampler calls take 1 + g times
longer and the learner progresses at 1 / (1 + g) of its speed.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from collections.abc import Callable
from typing import Any

from rl.admission import AdmissionPolicy, make_policy
from rl.formation import BatchFormer, logical_batches, make_former
from rl.metrics import round_metrics
from rl.rounds import RoundCut, RoundPlan, RoundPlanner, TailConfig
from rl.sim.sampler import ROUTINGS, SimSampler
from rl.sim.stage import StageModel
from rl.sim.workload import Workload
from rl.timeline import Timeline
from rl.types import Group, SamplingParams

MODES = ("sync", "cgp")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SimConfig:
    """What to simulate: the DriverConfig fields, the sampler's shape, tail batching."""

    mode: str = "cgp"  # sync | cgp (rl.driver)
    admission: str = "frontier"  # rl.admission policy name
    batching: str = "fifo"  # rl.formation former name (cgp; sync trains in logical order)
    groups_per_round: int = 32  # R (P0 under tail batching)
    groups_per_update: int = 2  # U
    group_size: int = 8  # G
    max_new_tokens: int = 8192  # the requests' response cap (long rounds may override)
    replicas: int = 1  # sampler data-parallel replicas (engines)
    slots: int = 256  # slots per replica
    routing: str = "shared"  # shared | round_robin (rl/sim/sampler.py)
    tail: TailConfig = TailConfig()  # rl.rounds tail batching; disabled: plain rounds
    epoch_size: int | None = None  # prompts per epoch, for tail batching's epoch end

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"SimConfig.mode={self.mode!r}; expected one of {MODES}.")
        if self.routing not in ROUTINGS:
            raise ValueError(f"SimConfig.routing={self.routing!r}; expected one of {ROUTINGS}.")
        if self.groups_per_update < 1 or self.groups_per_round % self.groups_per_update:
            raise ValueError(
                f"groups_per_round ({self.groups_per_round}) must be a positive multiple of "
                f"groups_per_update ({self.groups_per_update})."
            )
        for name in ("group_size", "max_new_tokens", "replicas", "slots"):
            if getattr(self, name) < 1:
                raise ValueError(f"SimConfig.{name} must be >= 1; received {getattr(self, name)}.")
        if self.slots < self.group_size:
            raise ValueError(
                f"SimConfig.slots ({self.slots}) must be >= group_size ({self.group_size}): a "
                "group is admitted whole into one replica."
            )

    @property
    def name(self) -> str:
        base = "sync" if self.mode == "sync" else f"cgp+{self.admission}+{self.batching}"
        return base + ("+tail" if self.tail.enabled else "")


@dataclasses.dataclass
class _Round:
    plan: RoundPlan
    start: float
    stream: bool  # cgp with a cut or fifo batches: the driver's stream trainer
    former: BatchFormer
    expected: int  # updates the round runs: ceil(target / U)
    received: list[Group] = dataclasses.field(default_factory=list)
    trained: list[Group] = dataclasses.field(default_factory=list)
    updates: int = 0


@dataclasses.dataclass
class _Op:
    name: str  # micro_step | update
    work: float  # seconds at full speed
    args: dict[str, Any]


@dataclasses.dataclass
class SimResult:
    """Per-round metrics (rl.metrics.round_metrics, kind, groups, round_s) and the Timeline.

    rl.sim.compare.summarize gives means over rounds and the time per trained group.
    """

    config: SimConfig
    rounds: list[dict[str, float | str]]
    timeline: Timeline
    counters: dict[str, int]
    end_s: float  # virtual time when the last round's publish ended


class Simulator:
    """Runs rounds of a SimConfig against a StageModel and a Workload; see the module docstring.

    Args:
      cfg: what to simulate.
      model: stage-time model (one sampler replica, the learner, the weight transfer).
      workload: prompts and response lengths.
      make_admission: builds an admission policy from cfg.admission (default rl.admission's).
      make_batches: builds a batch former (name, U, groups) (default rl.formation's).
      planner: the round planner (default rl.rounds.RoundPlanner over the workload's prompts).
      timeline: where spans go (a fresh Timeline by default).
    """

    def __init__(
        self,
        cfg: SimConfig,
        model: StageModel,
        workload: Workload,
        *,
        make_admission: Callable[[str], AdmissionPolicy] = make_policy,
        make_batches: Callable[[str, int, int | None], BatchFormer] = make_former,
        planner: RoundPlanner | None = None,
        timeline: Timeline | None = None,
    ):
        self.cfg, self.model, self.workload = cfg, model, workload
        self.make_batches = make_batches
        self.planner = planner or RoundPlanner(
            cfg.tail,
            groups_per_round=cfg.groups_per_round,
            prompts=workload.prompts(),
            epoch_size=cfg.epoch_size,
        )
        self.timeline = Timeline() if timeline is None else timeline
        n_policies = cfg.replicas if cfg.routing == "round_robin" else 1
        self.sampler = SimSampler(
            model,
            workload,
            [make_admission(cfg.admission) for _ in range(n_policies)],
            replicas=cfg.replicas,
            slots=cfg.slots,
            routing=cfg.routing,
            schedule=self._at,
            emit=self._on_group,
            on_busy=self._on_sampler_busy,
            timeline=self.timeline,
        )
        self._events: list[tuple[float, int, Callable[[float], None]]] = []
        self._seq = itertools.count()
        self._ops: list[_Op] = []
        self._op: _Op | None = None
        self._op_start = self._op_last = 0.0
        self._op_epoch = 0
        self._rate = 1.0
        self._round: _Round | None = None
        self._rounds: list[_Round] = []
        self._pending_seqs: list[tuple[int, int]] = []  # learner rows not yet in a micro-batch
        self._version = 0
        self._steps = 0
        self._stop_after = 0
        self._end = 0.0

    # ------------------------------------------------------------------------------ the clock

    def _at(self, t: float, fn: Callable[[float], None]) -> None:
        heapq.heappush(self._events, (t, next(self._seq), fn))

    def run(self, rounds: int) -> SimResult:
        """Simulates `rounds` rounds (fewer if the round planner runs out of prompts)."""
        if rounds < 1:
            raise ValueError(f"rounds must be >= 1; received {rounds}.")
        self._stop_after = rounds
        t = self._publish(0.0, round=-1)
        self._at(t, lambda t: self._start_round(0, t))
        while self._events:
            t, _, fn = heapq.heappop(self._events)
            fn(t)
        if self._round is not None:
            rnd = self._round
            raise RuntimeError(
                f"Simulation stalled in round {rnd.plan.round}: {len(rnd.received)} of "
                f"{rnd.plan.target} groups received, {rnd.updates} of {rnd.expected} updates (a "
                "request that never fits, or a former that never releases its batch?)."
            )
        out = []
        ends = [r.start for r in self._rounds[1:]] + [self._end]
        for rnd, end in zip(self._rounds, ends, strict=True):
            m: dict[str, float | str] = dict(
                round_metrics(
                    self.timeline,
                    round=rnd.plan.round,
                    rollout_start=rnd.start,
                    num_slots=self.sampler.num_slots,
                )
            )
            m.update(
                kind=rnd.plan.kind,
                groups_launched=float(len(rnd.plan.prompts)),
                groups_trained=float(len(rnd.trained)),
                round_s=end - rnd.start,  # rollout start -> the next round's (publish included)
            )
            out.append(m)
        c = dataclasses.asdict(self.sampler.counters)
        return SimResult(self.cfg, out, self.timeline, c, self._end)

    # ----------------------------------------------------------------------------- the rounds

    def _start_round(self, r: int, now: float) -> None:
        if r >= self._stop_after:
            self._end = now
            return
        try:
            plan = self.planner.plan(r)
        except StopIteration:
            self._end = now
            return
        cfg = self.cfg
        requests = plan.requests(
            group_size=cfg.group_size, params=SamplingParams(max_new_tokens=cfg.max_new_tokens)
        )
        cut = RoundCut(plan.target) if plan.aborted else None
        stream = cut is not None or cfg.batching == "fifo"  # the driver's stream trainer
        rnd = _Round(
            plan=plan,
            start=now,
            stream=stream,
            former=self.make_batches(
                "fifo" if stream else cfg.batching, cfg.groups_per_update, plan.target
            ),
            expected=-(-plan.target // cfg.groups_per_update),
        )
        self._round = rnd
        self._rounds.append(rnd)
        self.sampler.submit(requests, now, cut=cut)

    def _on_group(self, group: Group, now: float) -> None:
        """A complete group the round trains (the sampler applied the cut); as rl/driver.py."""
        rnd = self._round
        if rnd is None or group.request.round != rnd.plan.round:
            raise RuntimeError(f"Group {group.request.key} arrived outside its round.")
        rnd.received.append(group)
        u = self.cfg.groups_per_update
        if self.cfg.mode == "sync":  # rollout all, then train in logical order
            if len(rnd.received) == rnd.plan.target:
                for batch in logical_batches(rnd.received, u):
                    self._add(list(batch), now)
                    self._update(batch, now)
        elif rnd.stream:  # each group accumulates at once; an update per U groups
            self._add([group], now)
            for batch in rnd.former.add(group):
                self._update(batch, now)
        else:
            for batch in rnd.former.add(group):
                self._add(batch, now)
                self._update(batch, now)

    def _round_trained(self, now: float) -> None:
        rnd = self._round
        assert rnd is not None
        self.planner.finish(rnd.plan, [g.request.uid for g in rnd.trained])
        self._round = None
        self._version += 1
        t = self._publish(now, round=rnd.plan.round)
        self._at(t, lambda t: self._start_round(rnd.plan.round + 1, t))

    def _publish(self, now: float, round: int) -> float:
        end = now + self.model.publish_s()
        self.timeline.span(
            "publish", f"v{self._version}", now, end, version=self._version, round=round
        )
        return end

    # ---------------------------------------------------------------------------- the learner
    # As learner.Learner: add_groups accumulates every full micro-batch of pending rows at once;
    # update folds in the remainder and applies. Work is costed when queued (ops run in order).

    def _flush_s(self) -> float:
        if not self._pending_seqs:
            return 0.0
        seqs, self._pending_seqs = self._pending_seqs, []
        return self.model.micro_step_s(self.model.batch_tokens(seqs))

    def _add(self, groups: list[Group], now: float) -> None:
        work = 0.0
        for g in groups:
            self._pending_seqs += [(len(g.request.prompt), len(c.tokens)) for c in g.completions]
            if len(self._pending_seqs) >= max(self.model.micro_batch_rows, 1):
                work += self._flush_s()
        self._queue_op("micro_step", work, groups, now)

    def _update(self, batch: tuple[Group, ...] | list[Group], now: float) -> None:
        self._round.trained.extend(batch)  # type: ignore[union-attr]
        self._queue_op("update", self._flush_s() + self.model.update_s, batch, now)

    def _queue_op(self, name: str, work: float, groups: Any, now: float) -> None:
        tokens = sum(len(c.tokens) for g in groups for c in g.completions)
        args = dict(round=self._round.plan.round, tokens=tokens)  # type: ignore[union-attr]
        self._ops.append(_Op(name, work, args))
        if self._op is None:
            self._next_op(now)

    def _next_op(self, now: float) -> None:
        was_idle = self._op is None
        self._op = self._ops.pop(0)
        self._op_start = self._op_last = now
        if was_idle and self.model.contention:
            self.sampler.set_factor(1.0 + self.model.contention, now)
        self._plan_op()

    def _plan_op(self) -> None:
        self._op_epoch += 1
        epoch, op = self._op_epoch, self._op
        assert op is not None
        self._at(self._op_last + op.work / self._rate, lambda t: self._op_end(epoch, t))

    def _on_sampler_busy(self, busy: bool, now: float) -> None:
        rate = 1.0 / (1.0 + self.model.contention) if busy else 1.0
        if rate == self._rate:
            return
        if self._op is not None:
            self._op.work -= (now - self._op_last) * self._rate
            self._op_last = now
            self._rate = rate
            self._plan_op()
        self._rate = rate

    def _op_end(self, epoch: int, now: float) -> None:
        if epoch != self._op_epoch:
            return
        op, rnd = self._op, self._round
        assert op is not None and rnd is not None
        self.timeline.span("learner", op.name, self._op_start, now, step=self._steps, **op.args)
        self._op = None
        if op.name == "update":
            self._steps += 1
            rnd.updates += 1
        if self._ops:
            self._next_op(now)
            return
        if self.model.contention:
            self.sampler.set_factor(1.0, now)
        if rnd.updates == rnd.expected:
            self._round_trained(now)
