"""The runtime side of borrowing: the learner borrows the drained sampler's devices.

The driver (rl/driver.py) calls `before_learner_work` before each Add or Update (under async also
before each micro-batch of an Add) and `before_publish` before each Publish. Once per round (async:
per update), when the sampler has drained (every request submitted emitted, aborted or cut: under
async the staleness bound holds the next requests until this update is published) and updates
remain, the BorrowPolicy decides; on a move the learner reshards onto its mesh extended over the
sampler's devices (learner.Learner.borrow) and gives them back before the weights are published.
The switch (there and back) is timed, fed to the policy's running estimate, drawn on the learner
lane ("borrow", "give_back") and reported with the decision in the round's metrics
(borrow_learner, _gain_s, _switch_cost_s, _measured_s).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from rl.elastic.borrowing import BorrowPolicy, PoolState
from rl.timeline import Timeline
from rl.types import Group, Request

if TYPE_CHECKING:
    from learner.learner import Learner


class LearnerBorrower:
    """Moves the learner onto borrowed sampler devices when the policy says so.

    Args:
      policy: the borrowing policy (its config allows the "learner" direction).
      learner: the Learner (owns the TrainState), or the Ray runtime's LearnerClient.
      devices: the sampler's devices, lent while the rollout is drained (under Ray, the
        replicas' device ids in the learner's jax.distributed job).
      learner_devices: the learner's own devices.
      sampler_replicas, replica_devices, slots: the sampler's shape (for the policy's state).
      micro_batch_rows: the learner's rows per micro-batch.

    The driver binds its clock and timeline (`bind`).
    """

    def __init__(
        self,
        policy: BorrowPolicy,
        learner: Learner,
        devices: Sequence[Any],
        *,
        learner_devices: int,
        sampler_replicas: int,
        replica_devices: int,
        slots: int,
        micro_batch_rows: int,
    ):
        if not policy.cfg.allows("learner"):
            raise ValueError(
                f"LearnerBorrower needs elastic.borrowing 'learner' or 'both'; received "
                f"{policy.cfg.borrowing!r}."
            )
        self.policy, self.learner, self.devices = policy, learner, list(devices)
        self.shape = dict(
            learner_devices=learner_devices,
            sampler_replicas=sampler_replicas,
            replica_devices=replica_devices,
            slots=slots,
        )
        self.rows = micro_batch_rows
        self.clock: Callable[[], float] = time.monotonic
        self.timeline = Timeline()
        self._decided: set[tuple[int, int]] = set()  # (round, update) decided
        self._borrow_s = 0.0
        self._metrics: dict[int, dict[str, float]] = {}

    def bind(self, *, clock: Callable[[], float], timeline: Timeline) -> None:
        """Times switches with the driver's clock and draws them on its timeline."""
        self.clock, self.timeline = clock, timeline

    def prepare(self) -> None:
        """Compiles the extended mesh's steps now, so that no switch pays for compiling."""
        self.learner.prepare_borrow(self.devices)

    def before_learner_work(
        self,
        round: int,
        *,
        update: int = -1,
        drained: bool,
        updates_left: int,
        groups_per_update: int,
        group_size: int,
        tokens_per_group: float,
    ) -> None:
        """Decides once per round (async: per `update`, the index of the update about to train),
        when the sampler has drained; borrows on a move."""
        key = (round, update)
        if key in self._decided or not drained or not updates_left or self.learner.borrowing:
            return
        self._decided.add(key)
        groups = updates_left * groups_per_update
        state = PoolState(
            **self.shape,
            updates_left=updates_left,
            micro_batches_left=math.ceil(groups * group_size / self.rows),
            learner_tokens_left=groups * tokens_per_group,
        )
        d = self.policy.decide(state)
        self._metrics[round] = d.metrics() | {"borrow_learner_measured_s": math.nan}
        if d.move:
            t0 = self.clock()
            self.learner.borrow(self.devices)
            t1 = self.clock()
            if not self.learner.borrowing:  # declined (under Ray: a lending replica died)
                self._metrics[round]["borrow_learner"] = 0.0
                return
            self._borrow_s = t1 - t0
            self.timeline.span("learner", "borrow", t0, t1, round=round, devices=len(self.devices))

    def before_publish(self, round: int) -> None:
        """Gives the borrowed devices back (weights are published from the learner's own mesh)."""
        if not self.learner.borrowing:
            return
        t0 = self.clock()
        self.learner.give_back()
        t1 = self.clock()
        self.timeline.span("learner", "give_back", t0, t1, round=round)
        measured = self._borrow_s + (t1 - t0)
        self.policy.record_switch("learner", measured)
        self._metrics.setdefault(round, {})["borrow_learner_measured_s"] = measured

    def pop_metrics(self, round: int) -> dict[str, float]:
        """The round's decision metrics (empty if no decision was taken in it)."""
        self._decided = {k for k in self._decided if k[0] != round}
        return self._metrics.pop(round, {})


class SamplerLender:
    """Lends the learner's devices to the sampler as an extra engine replica while it waits.

    At a round's submission (round modes), while the learner waits for its first groups, the
    policy decides from an estimate of the round's work (`sequences` x the mean response length of
    the rounds so far; the longest response so far as the tail). On a move the extra replicas (one
    per `replica_devices` of the learner's devices, as the policy counts them; built once by
    `make_replicas`: Engines for the threaded ReplicaSampler, handles to replicas the learner
    worker hosts for the Ray router) join the sampler with the published weights (`add_replica`)
    before the round's requests are routed; the driver holds the learner's work until the sampler
    has drained, then they leave (`remove_replica`, idle: nothing is re-sampled) and the learner
    resumes.

    Under async (`maybe_lend_ahead`, BiDiRL's setting), while the learner waits for its next
    batch, once per update: the policy decides from the batch's groups still sampling (their
    sequences x the mean response so far; the longest so far as the tail) and the sequences
    queued on the sampler; on a move the extra replicas join taking queued requests
    (`add_replica(take_queued=True)`), and once the batch is complete the driver takes them back
    mid-rollout (`take_back`: what runs there resumes on the others, re-prefilled with its
    tokens so far) before the learner trains.

    The switch (add + remove) is timed into the policy's estimate, drawn on the "elastic" lane
    ("lend") and reported in the round's metrics (borrow_sampler, _gain_s, _switch_cost_s,
    _measured_s).

    Args:
      policy: the borrowing policy (its config allows the "sampler" direction).
      make_replicas: builds the extra replicas on the learner's devices (called at the first
        move); what the sampler's `add_replica` takes.
      learner_devices, replica_devices, sampler_replicas, slots, micro_batch_rows: the split.
    """

    def __init__(
        self,
        policy: BorrowPolicy,
        make_replicas: Callable[[], list[Any]],
        *,
        learner_devices: int,
        replica_devices: int,
        sampler_replicas: int,
        slots: int,
        micro_batch_rows: int,
    ):
        if not policy.cfg.allows("sampler"):
            raise ValueError(
                f"SamplerLender needs elastic.borrowing 'sampler' or 'both'; received "
                f"{policy.cfg.borrowing!r}."
            )
        self.policy, self.make_replicas = policy, make_replicas
        self.shape = dict(
            learner_devices=learner_devices,
            sampler_replicas=sampler_replicas,
            replica_devices=replica_devices,
            slots=slots,
        )
        self.rows = micro_batch_rows
        self.clock: Callable[[], float] = time.monotonic
        self.timeline = Timeline()
        self._replicas: list[Any] = []
        self._lengths = (0.0, 0.0, 0.0, 0)  # responses trained: mean, max, mean prompt, count
        self._lent: tuple[int, list[int], float, float] | None = None  # round, replicas, since, s
        self._decided_update = -1  # async: the last update decided for
        self._metrics: dict[int, dict[str, float]] = {}

    def bind(self, *, clock: Callable[[], float], timeline: Timeline) -> None:
        self.clock, self.timeline = clock, timeline

    @property
    def lent(self) -> bool:
        return self._lent is not None

    def prepare(self) -> None:
        """Builds (and compiles) the extra replicas now, so that no switch pays for that."""
        if not self._replicas:
            self._replicas = self.make_replicas()

    def maybe_lend(
        self,
        sampler: Any,
        round: int,
        requests: Sequence[Request],
        *,
        max_new_tokens: int,
        updates: int,
        overlap: bool,
    ) -> None:
        """Decides for the round about to be submitted; on a move adds the extra replicas.

        The lengths are those of the groups trained so far (`observe`); before any, half of
        `max_new_tokens` per response and the whole cap as the tail.
        """
        sequences = sum(r.group_size for r in requests)
        if self._lent is not None or not sequences:
            return
        mean, longest, prompt, n = self._lengths
        response_tokens = mean if n else max_new_tokens / 2
        longest = longest if n else max_new_tokens
        prompt_tokens = prompt if n else sum(len(r.prompt) for r in requests) / len(requests)
        state = PoolState(
            **self.shape,
            sequences=sequences,
            tokens_left=sequences * response_tokens,
            longest_left=longest,
            context=prompt_tokens + response_tokens / 2,
            updates_left=updates,
            micro_batches_left=math.ceil(sequences / self.rows),
            learner_tokens_left=sequences * (prompt_tokens + response_tokens),
            learner_waiting=True,
            overlap=overlap,
        )
        d = self.policy.decide(state)
        self._metrics[round] = d.metrics() | {"borrow_sampler_measured_s": math.nan}
        if d.direction != "sampler" or not d.move:
            return
        t0 = self.clock()
        self.prepare()
        added = [sampler.add_replica(e) for e in self._replicas]
        self._lent = (round, added, t0, self.clock() - t0)

    def maybe_lend_ahead(
        self,
        sampler: Any,
        round: int,
        update: int,
        *,
        missing: int,
        group_size: int,
        max_new_tokens: int,
    ) -> None:
        """async: decides once per `update` while the learner waits for that batch's `missing`
        groups (round: the batch's round, for the metrics); on a move the extra replicas join,
        taking requests queued on the others."""
        if self._lent is not None or update <= self._decided_update or not missing:
            return
        self._decided_update = update
        mean, longest, prompt, n = self._lengths
        response_tokens = mean if n else max_new_tokens / 2
        sequences = missing * group_size
        state = PoolState(
            **self.shape,
            sequences=sequences,
            tokens_left=sequences * response_tokens,
            longest_left=longest if n else max_new_tokens,
            context=prompt + response_tokens / 2,
            updates_left=1,
            learner_waiting=True,
            ahead=True,
            queued=sampler.waiting() * group_size,
        )
        d = self.policy.decide(state)
        self._metrics[round] = d.metrics() | {"borrow_sampler_measured_s": math.nan}
        if d.direction != "sampler" or not d.move:
            return
        t0 = self.clock()
        self.prepare()
        added = [sampler.add_replica(e, take_queued=True) for e in self._replicas]
        self._lent = (round, added, t0, self.clock() - t0)

    def give_back(self, sampler: Any, *, mid_rollout: bool = False) -> None:
        """Removes the extra replicas; the learner's devices return. Round modes: the sampler
        has drained. `mid_rollout` (async): they are taken back with work running
        (ReplicaSampler.take_back)."""
        assert self._lent is not None
        round, added, since, add_s = self._lent
        self._lent = None
        t0 = self.clock()
        for i in added:
            if mid_rollout:
                sampler.take_back(i)
            else:
                sampler.remove_replica(i)
        t1 = self.clock()
        self.timeline.span("elastic", "lend", since, t1, round=round, replicas=len(added))
        measured = add_s + (t1 - t0)
        self.policy.record_switch("sampler", measured)
        self._metrics.setdefault(round, {})["borrow_sampler_measured_s"] = measured

    def observe(self, groups: Sequence[Group]) -> None:
        """Trained groups: their lengths update the estimate of the next rounds' work."""
        rows = [(len(c.prompt), len(c.tokens)) for g in groups for c in g.completions]
        if not rows:
            return
        mean, longest, prompt, n = self._lengths
        k = n + len(rows)
        self._lengths = (
            (mean * n + sum(r for _, r in rows)) / k,
            max(longest, max(r for _, r in rows)),
            (prompt * n + sum(p for p, _ in rows)) / k,
            k,
        )

    def pop_metrics(self, round: int) -> dict[str, float]:
        return self._metrics.pop(round, {})
