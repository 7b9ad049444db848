"""The driver: the learner loop of both runtimes, carrying out a schedule.

The schedule (rl.schedules: `sync`, `cgp` with the stream trainer and tail-batched rounds, `async`)
decides what to submit, when the learner adds and updates on which groups, and when weights are
published; this driver does what it says, with the real sampler, Learner and WeightSync, and
tells it when groups arrive, updates end and weights reach the sampler. The simulator (rl/sim)
drives the same schedule objects on a virtual clock.

Round modes publish after the round's S = R/U updates and the next round samples with those
weights: `sync` trains in logical order, so `cgp` with `ordered` batches performs the same updates
on the same data (same tokens, same parameters). `async` publishes after every update and the
sampler swaps the weights in between decode steps (SamplerLoop.set_params), running up to
`max_staleness` versions ahead; `run_round(r)` returns when round r is trained, with later rounds'
requests possibly in flight.

The driver talks to the sampler, the queue and the weight sync through small protocols
(rl.runtime.protocols), so the threaded runtime (rl.runtime.threads: a SamplerLoop thread, this
thread the learner loop) and the Ray runtime (rl.runtime.ray_runtime: a learner worker, sampler
replica actors, a queue actor) share it. An error on either side stops both (the queue fails, the sampler stops) and re-raises the
original error; a round's result lists only groups whose update completed.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from rl.metrics import (
    episode_metrics,
    migration_metrics,
    publish_metrics,
    replica_metrics,
    round_metrics,
    staleness_metrics,
)
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
from rl.timeline import Timeline
from rl.types import Group, Prompt, Request, SamplingParams

if TYPE_CHECKING:
    from learner.learner import Learner
    from rl.runtime.lending import LearnerBorrower, SamplerLender
    from rl.runtime.protocols import Queue, Sampler, WeightSync


@dataclasses.dataclass(frozen=True, kw_only=True)
class DriverConfig(ScheduleConfig):
    """The schedule (rl.schedules.ScheduleConfig) plus what the threaded runtime needs."""

    prefix: ClassVar[str] = "driver"

    sampling: SamplingParams = SamplingParams()
    queue_size: int = (
        0  # complete groups waiting for the learner before the sampler blocks; 0: no bound
    )
    poll_s: float = 0.2  # how often a waiting learner checks the sampler thread for an error
    group_atomic: bool = True  # False: per-sample admission (sampler.loop; slime/SGLang's way)
    recompute_kv: bool = False  # async: re-prefill running samples with each new version (AReaL)

    def __post_init__(self):
        super().__post_init__()
        if self.queue_size < 0:
            raise ValueError(f"queue_size must be >= 0; received {self.queue_size}.")
        if not isinstance(self.recompute_kv, bool):
            raise ValueError(f"driver.recompute_kv must be a bool; received {self.recompute_kv!r}.")
        if self.recompute_kv and self.mode != "async":
            raise ValueError(
                f"driver.recompute_kv=True needs mode='async'; received mode={self.mode!r} "
                "(round modes swap weights only between rounds, with nothing running)."
            )
        if not isinstance(self.group_atomic, bool):
            raise ValueError(f"driver.group_atomic must be a bool; received {self.group_atomic!r}.")


@dataclasses.dataclass
class RoundResult:
    round: int
    kind: str  # plain | short | long | flush (rl.round_planner)
    version: int  # the policy version that sampled this round
    groups: list[Group]  # trained groups, in training order
    updates: list[dict[str, float]]  # the learner's metrics per update
    metrics: dict[str, float]  # timing (rl.metrics.round_metrics), rewards, learner means


class Driver:
    """Runs rounds of a schedule; see the module docstring.

    Args:
      cfg: the schedule and runtime config.
      rounds: the run's last round + 1, if known (`async` plans no round past it).
      barrier_every: `async`: after every this many rounds nothing of a later round is in flight
        when run_round returns (pass the checkpoint interval: a resume then continues exactly).
      keep_sampling: `async`: at those rounds only the learner waits; later rounds keep sampling
        and `schedule.in_flight()` names their prompts (config.async_resume = "no_bubble").
      sampler: emits complete groups onto `queue` and records into `timeline`; started here,
        with the weights of `version`.
      learner_turn: `learner_turn(kind)` is entered around each learner operation (kind
        "micro_step" or "update"); a multiplexed pipeline's waits there for its turn on the
        learner's devices (rl/runtime/pool.py). None: no turns.
      Others: the components (learner, weight sync, prompt source); rl.runtime.threads and
        rl.runtime.ray build them.
    """

    def __init__(
        self,
        cfg: DriverConfig,
        *,
        sampler: Sampler,
        queue: Queue,
        learner: Learner,
        weight_sync: WeightSync,
        prompts: Iterator[Prompt],
        timeline: Timeline | None = None,
        clock: Callable[[], float] = time.monotonic,
        version: int = 0,
        rounds: int | None = None,
        barrier_every: int = 0,
        keep_sampling: bool = False,
        borrower: LearnerBorrower | None = None,
        lender: SamplerLender | None = None,
        learner_turn: Callable[[str], contextlib.AbstractContextManager[None]] | None = None,
    ):
        self.cfg = cfg
        self.borrower, self.lender = borrower, lender
        self._deferred: list[Action] = []  # learner work held while its devices are lent
        self.learner = learner
        # each learner operation ("micro_step", "update") runs inside it: a pool of pipelines
        # sharing the learner's devices takes turns there (rl/runtime/pool.py)
        self._learner_turn = learner_turn or (lambda kind: contextlib.nullcontext())
        self.weight_sync = weight_sync
        self.planner = RoundPlanner(
            cfg.tail,
            groups_per_round=cfg.groups_per_round,
            prompts=prompts,
            epoch_size=cfg.epoch_size or None,
        )
        self.schedule = make_schedule(
            cfg,
            planner=self.planner,
            requests_of=self._requests,
            version=version,
            rounds=rounds,
            barrier_every=barrier_every,
            keep_sampling=keep_sampling,
        )
        self.timeline = Timeline() if timeline is None else timeline
        self.clock = clock
        for elastic in (borrower, lender):
            if elastic is not None:
                elastic.bind(clock=clock, timeline=self.timeline)
        self.on_group: Callable[[Group], None] | None = (
            None  # called as each complete group arrives
        )
        self.on_update: Callable[[Update], None] | None = None  # called as each update ends
        self.sampler, self.queue = sampler, queue
        self.num_slots = sampler.num_slots
        sampler.set_params(self._publish(version, round=-1), version)
        sampler.start()
        self._closed = False
        self._starts: dict[int, float] = {}  # round -> when its first requests were submitted
        self._stats0: dict[int, Any] = {}
        self._updates: dict[int, list[dict[str, float]]] = collections.defaultdict(list)
        self._done: dict[int, RoundDone] = {}
        self._submitted = 0  # requests submitted to the sampler (drained: all emitted/aborted/cut)
        self._updates_left = 0  # of the updates the last Begin announced
        self._added: dict[int, list[int]] = collections.defaultdict(lambda: [0, 0])  # groups, tok

    @property
    def version(self) -> int:
        """The newest published version."""
        return self.schedule.version

    def _publish(self, version: int, round: int) -> Any:
        t0 = self.clock()
        pub = self.weight_sync.publish(self.learner.params, version)
        self.timeline.span(
            "publish",
            f"v{version}",
            t0,
            self.clock(),
            version=version,
            round=round,
            bytes=pub.bytes,
        )
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

    def _drained(self) -> bool:
        """Every submitted request was emitted, aborted or cut: the sampler's devices are idle."""
        st = self.sampler.stats
        return st.groups_emitted + st.groups_aborted + st.groups_cut >= self._submitted

    def _maybe_lend(self, a: Submit) -> None:
        """Round modes: the learner waits for this round's groups; the lender may add a replica."""
        assert self.lender is not None
        self.lender.maybe_lend(
            self.sampler,
            a.round,
            a.requests,
            max_new_tokens=self.cfg.sampling.max_new_tokens,
            updates=self.cfg.updates_per_round,
            overlap=self.cfg.mode != "sync",
        )
        self.num_slots = max(self.num_slots, self.sampler.num_slots)

    def _maybe_lend_ahead(self) -> None:
        """async: the learner waits for its next batch; the lender may add replicas until it is
        complete."""
        assert self.lender is not None
        missing = self.schedule.next_batch_missing()
        if self.lender.lent or not missing:
            return
        self.lender.maybe_lend_ahead(
            self.sampler,
            min(r for r, _ in missing),
            self.schedule.updates_done,
            missing=len(missing),
            group_size=self.cfg.group_size,
            max_new_tokens=self.cfg.sampling.max_new_tokens,
        )
        self.num_slots = max(self.num_slots, self.sampler.num_slots)

    def _maybe_borrow(self, round: int) -> None:
        if self.borrower is None:
            return
        groups, tokens = self._added[round]
        self.borrower.before_learner_work(
            round,
            update=self.schedule.updates_done if self.cfg.mode == "async" else -1,
            drained=self._drained(),
            updates_left=self._updates_left,
            groups_per_update=self.cfg.groups_per_update,
            group_size=self.cfg.group_size,
            tokens_per_group=tokens / groups if groups else 0.0,
        )

    def _add(self, groups: tuple[Group, ...], round: int) -> None:
        added = self._added[round]  # counted first: the borrowing estimate sees these groups
        added[0] += len(groups)
        added[1] += sum(len(c.prompt) + len(c.tokens) for g in groups for c in g.completions)
        self._maybe_borrow(round)
        with self._learner_turn("micro_step"):
            t0 = self.clock()
            if self.borrower is not None and self.cfg.mode == "async":
                # the sampler may drain mid-batch (the bound holds what comes next): borrow there
                self.learner.add_groups(groups, before_batch=lambda: self._maybe_borrow(round))
            else:
                self.learner.add_groups(groups)
            t1 = self.clock()
        tokens = sum(len(c.tokens) for g in groups for c in g.completions)
        self.timeline.span(
            "learner",
            "micro_step",
            t0,
            t1,
            round=round,
            tokens=tokens,
            step=self.learner.step,
        )

    def _update(self, up: Update) -> None:
        self._maybe_borrow(up.round)
        with self._learner_turn("update"):
            t0 = self.clock()
            step = self.learner.step
            m = self.learner.update()
            t1 = self.clock()
        m.update(staleness_metrics(up.batch, up.version))
        tokens = sum(len(c.tokens) for g in up.batch for c in g.completions)
        self.timeline.span("learner", "update", t0, t1, round=up.round, tokens=tokens, step=step)
        self._updates[up.round].append(m)
        self._updates_left -= 1
        if self.on_update is not None:
            self.on_update(up)

    def _run(self, actions: list[Action]) -> None:
        """Does what the schedule says; what an Update or a Publish answers runs next."""
        todo = collections.deque(actions)
        while todo:
            a = todo.popleft()
            follow: list[Action] = []
            if self.lender is not None and self.lender.lent and not isinstance(a, Submit):
                if self.cfg.mode != "async":
                    self._deferred.append(a)  # the learner's devices decode: its work waits
                    continue
                self.lender.give_back(self.sampler, mid_rollout=True)  # its batch is complete
            if isinstance(a, Submit):
                if self.lender is not None and self.cfg.mode != "async":
                    self._maybe_lend(a)
                if a.round not in self._starts:
                    self._starts[a.round] = self.clock()
                    self._stats0[a.round] = dataclasses.replace(self.sampler.stats)
                self._submitted += len(a.requests)
                self.sampler.submit(a.requests, cut=a.cut)
            elif isinstance(a, Begin):
                self._updates_left = a.updates
                self.learner.begin_round(updates=a.updates)
            elif isinstance(a, Add):
                self._add(a.groups, a.round)
            elif isinstance(a, Update):
                self._update(a)
                follow = self.schedule.on_update_done()
            elif isinstance(a, Publish):
                if self.borrower is not None:
                    self.borrower.before_publish(a.round)
                self.sampler.set_params(self._publish(a.version, a.round), a.version)
                follow = self.schedule.on_published()
            elif isinstance(a, RoundDone):
                self._done[a.plan.round] = a
            else:
                raise TypeError(f"Unknown schedule action {a!r}.")
            todo.extendleft(reversed(follow))

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
        try:
            self._run(self.schedule.begin(round))
        except StopIteration:
            raise ValueError(
                f"Round {round}: the prompt source is exhausted and the long-prompt queue is empty."
            ) from None
        while round not in self._done:
            if self.lender is not None and self.lender.lent and self._drained():
                self.lender.give_back(self.sampler)  # the learner's devices return
                deferred, self._deferred = self._deferred, []
                self._run(deferred)
                continue
            if self.lender is not None and self.cfg.mode == "async":
                self._maybe_lend_ahead()
            self._run(self.schedule.on_group(self._next_group()))
        done = self._done.pop(round)
        stats = self.sampler.stats  # first: a remote sampler's timeline events come with it
        plan, trained = done.plan, list(done.trained)
        updates = self._updates.pop(round, [])
        n_updates = -(-len(trained) // self.cfg.groups_per_update)
        if len(updates) != n_updates:
            raise RuntimeError(f"Round {round} ran {len(updates)} updates; expected {n_updates}.")
        metrics = round_metrics(
            self.timeline,
            round=round,
            rollout_start=self._starts[round],
            num_slots=self.num_slots,
        )
        if len(self.sampler.replica_slots) > 1:
            metrics.update(
                replica_metrics(
                    self.timeline,
                    round=round,
                    rollout_start=self._starts[round],
                    replica_slots=self.sampler.replica_slots,
                )
            )
            metrics.update(
                migration_metrics(self.timeline, round=round, rollout_start=self._starts[round])
            )
        metrics.update(
            self._round_stats(plan, trained, list(done.discarded), stats, self._stats0.pop(round))
        )
        for key in updates[0] if updates else ():  # every metric the learner and loss return
            metrics.setdefault(key, float(np.mean([m[key] for m in updates])))
        if updates:  # lag: token-weighted, and the max
            tokens = np.asarray([m["tokens"] for m in updates])
            metrics["lag_mean"] = float(
                np.sum(tokens * [m["lag_mean"] for m in updates]) / tokens.sum()
            )
            metrics["lag_max"] = float(np.max([m["lag_max"] for m in updates]))
        metrics.update(
            publish_metrics(self.timeline, round=round, rollout_start=self._starts[round])
        )
        if self.borrower is not None:
            metrics.update(self.borrower.pop_metrics(round))
        if self.lender is not None:
            metrics.update(self.lender.pop_metrics(round))
            self.num_slots = max(self.num_slots, self.sampler.num_slots)
            self.lender.observe(trained)  # its estimate of the next rounds' lengths
        self._added.pop(round, None)
        del self._starts[round]
        return RoundResult(
            round=round,
            kind=plan.kind,
            version=done.version,
            groups=trained,
            updates=updates,
            metrics=metrics,
        )

    def _round_stats(
        self, plan: RoundPlan, trained: list[Group], discarded: list[Group], stats: Any, stats0: Any
    ) -> dict[str, float]:
        # Rewards and lengths of every group the round sampled and kept: trained and, under
        # dynamic sampling, discarded (rewards all equal) groups, so reward_mean is not biased
        # by the selection.
        sampled = trained + discarded
        lengths = np.asarray([len(c.tokens) for g in sampled for c in g.completions], np.float64)
        rewards = np.asarray([r for g in sampled for r in g.rewards], np.float32)
        out = {
            "reward_mean": float(rewards.mean()),
            "version": float(self.version),
            "long_round": float(plan.kind in ("long", "flush")),
            "groups_trained": float(len(trained)),
            # dynamic sampling: prompts drawn this round (R plus refills) and groups discarded
            "prompts_drawn": float(len(plan.prompts)),
            "groups_discarded": float(len(discarded)),
            "aborted_prompts": float(plan.aborted),
            "long_queue": float(len(self.planner.long_queue)),
            "response_len_max": float(lengths.max()),
            "response_len_p99": float(np.percentile(lengths, 99)),
            "response_len_mean": float(lengths.mean()),
            **episode_metrics(c for g in sampled for c in g.completions),
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
            # Stop the sampler before the queue closes, so a group that work running ahead (async)
            # finishes meanwhile is dropped; closing the queue then wakes a put blocked on it.
            self.sampler.request_stop()
            self.queue.close()
            self.sampler.close()
