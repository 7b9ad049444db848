"""The round driver: rollout and training of each round, synchronous or pipelined.

Modes:
  sync  rollout all R groups, then train (what slime does; the baseline);
  cgp   complete-group pipelining: each complete group goes on the queue at once and the learner
        updates as soon as U groups form a batch (`fifo`: the next U to complete; `ordered`: batch k
        is logical groups kU..kU+U-1), while the rest of the round is still decoding.
Weights are published after the round's S = R/U updates, and the next round samples with them: every
update sees data of exactly the policy it should. `sync` trains in logical order, so `cgp` with
`ordered` batches performs the same updates on the same data: same tokens, same parameters.

Rounds come from a `rl.rounds.RoundPlanner`: plain rounds, or with tail batching (`tail.enabled`,
RollPacker) short rounds that launch ceil(eta * R) prompts and train the first R groups to complete
(the sampler aborts the rest at once; their prompts wait in the long-prompt queue) and long rounds
of R queued prompts. A short round's trained set is defined by completion order, so its cgp batches
are formed in completion order (`fifo`) whatever `batching` says; `sync` trains them in logical
order.

Stream trainer (RollPacker): with `fifo` batches each arriving group is handed to the learner at
once, which accumulates gradients of every full micro-batch while the rollout goes on; the update is
applied when U groups are in. With U = R (S = 1) that is one deferred update per round.

The sampler loop runs in its own thread; this driver's thread is the learner loop. An error on
either side stops both (the queue fails, the sampler thread stops) and re-raises the original error;
a round's result lists only groups whose update completed.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from rl.admission import make_policy
from rl.formation import FifoBatches, OrderedBatches, logical_batches, make_former
from rl.metrics import round_metrics
from rl.queue import GroupQueue
from rl.rounds import RoundCut, RoundPlan, RoundPlanner, TailConfig
from rl.timeline import Timeline
from rl.types import Group, Prompt, Request, SamplingParams

if TYPE_CHECKING:
    from learner.learner import Learner
    from learner.publish import WeightSync
    from sampler.engine import Engine
    from sampler.loop import RewardFn

MODES = ("sync", "cgp")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DriverConfig:
    mode: str = "cgp"  # sync | cgp
    admission: str = "frontier"  # fcfs | frontier (rl.admission)
    batching: str = "ordered"  # fifo | ordered (cgp only; sync trains in logical order)
    groups_per_round: int = 16  # R
    groups_per_update: int = 2  # U; S = R / U updates per round
    group_size: int = 8  # G samples per prompt
    sampling: SamplingParams = SamplingParams()
    queue_size: int = (
        0  # complete groups waiting for the learner before the sampler blocks; 0: no bound
    )
    poll_s: float = 0.2  # how often a waiting learner checks the sampler thread for an error
    tail: TailConfig = TailConfig()  # tail batching (rl.rounds); off: plain rounds
    epoch_size: int = 0  # prompts per epoch of the source (tail.epoch_end="flush"); 0: no epochs

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"driver.mode={self.mode!r}; expected one of {MODES}.")
        make_policy(self.admission)
        make_former(self.batching, 1, 1)
        if self.groups_per_update < 1 or self.groups_per_round % self.groups_per_update:
            raise ValueError(
                f"groups_per_round ({self.groups_per_round}) must be a positive multiple of "
                f"groups_per_update ({self.groups_per_update})."
            )
        if self.epoch_size < 0:
            raise ValueError(f"epoch_size must be >= 0 (0: no epochs); received {self.epoch_size}.")
        if self.group_size < 1 or self.queue_size < 0:
            raise ValueError(
                f"group_size must be >= 1 and queue_size >= 0; received {self.group_size}, {self.queue_size}."
            )

    @property
    def updates_per_round(self) -> int:
        return self.groups_per_round // self.groups_per_update

    @property
    def name(self) -> str:
        name = "sync" if self.mode == "sync" else f"cgp+{self.admission}+{self.batching}"
        return name + ("+tail" if self.tail.enabled else "")


def driver_config_from(
    driver: Any, *, sampling: SamplingParams, epoch_size: int = 0
) -> DriverConfig:
    """DriverConfig from a config's `driver` ConfigDict (or mapping); `tail` becomes TailConfig."""
    fields = dict(driver)
    tail = fields.pop("tail", {})
    return DriverConfig(
        **fields, tail=TailConfig(**dict(tail)), sampling=sampling, epoch_size=epoch_size
    )


@dataclasses.dataclass
class RoundResult:
    round: int
    kind: str  # plain | short | long | flush (rl.rounds)
    version: int  # the policy version that sampled this round
    groups: list[Group]  # trained groups, in training order
    updates: list[dict[str, float]]  # the learner's metrics per update
    metrics: dict[str, float]  # timing (rl.metrics.round_metrics), rewards, learner means


class Driver:
    """Runs rounds; see the module docstring."""

    def __init__(
        self,
        cfg: DriverConfig,
        *,
        engine: Engine,
        learner: Learner,
        weight_sync: WeightSync,
        prompts: Iterator[Prompt],
        reward_fn: RewardFn,
        timeline: Timeline | None = None,
        clock: Callable[[], float] = time.monotonic,
        version: int = 0,
    ):
        from sampler.loop import (
            SamplerLoop,
        )  # the driver wires concrete sides; rl/ stays importable alone

        self.cfg = cfg
        self.learner = learner
        self.weight_sync = weight_sync
        self.planner = RoundPlanner(
            cfg.tail,
            groups_per_round=cfg.groups_per_round,
            prompts=prompts,
            epoch_size=cfg.epoch_size or None,
        )
        self.timeline = Timeline() if timeline is None else timeline
        self.clock = clock
        self.version = version
        self.on_group: Callable[[Group], None] | None = (
            None  # called as each complete group arrives
        )
        self.num_slots = engine.max_concurrent_decodes
        self.queue = GroupQueue(cfg.queue_size)
        published = self._publish(version, round=-1)
        self.sampler = SamplerLoop(
            engine,
            published,
            admission=make_policy(cfg.admission),
            reward_fn=reward_fn,
            emit=self.queue.put,
            version=version,
            timeline=self.timeline,
            clock=clock,
        )
        self.sampler.start()
        self._closed = False

    def _publish(self, version: int, round: int) -> Any:
        t0 = self.clock()
        pub = self.weight_sync.publish(self.learner.params, version)
        self.timeline.span("publish", f"v{version}", t0, self.clock(), version=version, round=round)
        return pub.params

    def _next_group(self) -> Group:
        while True:
            try:
                group = self.queue.get(timeout=self.cfg.poll_s)
                if self.on_group is not None:
                    self.on_group(group)
                return group
            except TimeoutError:
                if self.sampler.error is not None:
                    raise self.sampler.error from None

    def _requests(self, plan: RoundPlan) -> list[Request]:
        return plan.requests(group_size=self.cfg.group_size, params=self.cfg.sampling)

    def _add(self, groups: tuple[Group, ...], round: int) -> None:
        t0 = self.clock()
        self.learner.add_groups(groups)
        tokens = sum(len(c.tokens) for g in groups for c in g.completions)
        self.timeline.span(
            "learner",
            "micro_step",
            t0,
            self.clock(),
            round=round,
            tokens=tokens,
            step=self.learner.step,
        )

    def _update(
        self, batch: tuple[Group, ...], round: int, updates: list[dict[str, float]]
    ) -> None:
        t0 = self.clock()
        step = self.learner.step
        m = self.learner.update()
        tokens = sum(len(c.tokens) for g in batch for c in g.completions)
        self.timeline.span(
            "learner", "update", t0, self.clock(), round=round, tokens=tokens, step=step
        )
        updates.append(m)

    def run_round(self, round: int) -> RoundResult:
        """Samples, trains and publishes one round; on any error both sides stop and it re-raises."""
        if self._closed:
            raise RuntimeError("Driver is closed.")
        try:
            return self._run_round(round)
        except BaseException as e:
            self.close(error=e)
            raise

    def _run_round(self, round: int) -> RoundResult:
        cfg, u = self.cfg, self.cfg.groups_per_update
        try:
            plan = self.planner.plan(round)
        except StopIteration:
            raise ValueError(
                f"Round {round}: the prompt source is exhausted and the long-prompt queue is empty."
            ) from None
        requests = self._requests(plan)
        n_updates = -(-plan.target // u)
        self.learner.begin_round(updates=n_updates)
        updates: list[dict[str, float]] = []
        trained: list[Group] = []
        stats0 = dataclasses.replace(self.sampler.stats)
        start = self.clock()
        cut = RoundCut(plan.target) if plan.aborted else None
        self.sampler.submit(requests, cut=cut)
        if cfg.mode == "sync":  # rollout all, then train in logical order
            done = [self._next_group() for _ in range(plan.target)]
            for batch in logical_batches(done, u):
                self._add(batch, round)
                self._update(batch, round, updates)
                trained.extend(batch)
        elif cut is not None or cfg.batching == "fifo":  # stream trainer
            former = FifoBatches(u, plan.target)
            for _ in range(plan.target):
                group = self._next_group()
                self._add((group,), round)
                for batch in former.add(group):
                    self._update(batch, round, updates)
                    trained.extend(batch)
        else:
            former = OrderedBatches(u, plan.target)
            for _ in range(plan.target):
                for batch in former.add(self._next_group()):
                    self._add(batch, round)
                    self._update(batch, round, updates)
                    trained.extend(batch)
        if len(updates) != n_updates:
            raise RuntimeError(f"Round {round} ran {len(updates)} updates; expected {n_updates}.")
        self.planner.finish(plan, [g.request.uid for g in trained])
        sampled_version = self.version
        self.version += 1
        self.sampler.set_params(self._publish(self.version, round), self.version)
        metrics = round_metrics(
            self.timeline, round=round, rollout_start=start, num_slots=self.num_slots
        )
        metrics.update(self._round_stats(plan, trained, stats0))
        for key in ("loss", "grad_norm", "clip_frac", "entropy", "kl"):
            metrics[key] = float(np.mean([m[key] for m in updates]))
        return RoundResult(
            round=round,
            kind=plan.kind,
            version=sampled_version,
            groups=trained,
            updates=updates,
            metrics=metrics,
        )

    def _round_stats(self, plan: RoundPlan, trained: list[Group], stats0: Any) -> dict[str, float]:
        lengths = np.asarray([len(c.tokens) for g in trained for c in g.completions], np.float64)
        rewards = np.asarray([g.rewards for g in trained], np.float32)
        stats = self.sampler.stats
        out = {
            "reward_mean": float(rewards.mean()),
            "version": float(self.version),
            "long_round": float(plan.kind in ("long", "flush")),
            "groups_trained": float(len(trained)),
            "aborted_prompts": float(plan.aborted),
            "long_queue": float(len(self.planner.long_queue)),
            "response_len_max": float(lengths.max()),
            "response_len_p99": float(np.percentile(lengths, 99)),
            "response_len_mean": float(lengths.mean()),
        }
        cut = stats.samples_cut - stats0.samples_cut
        if plan.response_eta > 1 and cut:  # the bias response over-provisioning introduces
            out["kept_response_len_mean"] = out["response_len_mean"]
            out["cut_response_len_min_mean"] = (
                stats.cut_sample_tokens - stats0.cut_sample_tokens
            ) / cut
        return out

    def close(self, error: BaseException | None = None) -> None:
        """Stops the sampler thread; with `error`, fails the queue so a blocked side wakes up."""
        if self._closed:
            return
        self._closed = True
        if error is not None:
            self.queue.fail(error)
            try:
                self.sampler.close()
            except BaseException:  # the original error is what the caller sees
                pass
        else:
            self.queue.close()
            self.sampler.close()
