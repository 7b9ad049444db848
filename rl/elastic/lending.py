"""The runtime side of borrowing: the learner borrows the drained sampler's devices.

The driver (rl/driver.py) calls `before_learner_work` before each Add or Update of a round mode and
`before_publish` before each Publish. Once per round, when the sampler has drained (every request
of the round emitted, aborted or cut) and updates remain, the BorrowPolicy decides; on a move the
learner reshards onto its mesh extended over the sampler's devices (learner.Learner.borrow) and
gives them back before the weights are published. The switch (there and back) is timed, fed to the
policy's running estimate, drawn on the learner lane ("borrow", "give_back") and reported with the
decision in the round's metrics (borrow_learner, _gain_s, _switch_cost_s, _measured_s).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from rl.elastic.borrowing import BorrowPolicy, PoolState
from rl.timeline import Timeline

if TYPE_CHECKING:
    from learner.learner import Learner


class LearnerBorrower:
    """Moves the learner onto borrowed sampler devices when the policy says so.

    Args:
      policy: the borrowing policy (its config allows the "learner" direction).
      learner: the Learner (owns the TrainState).
      devices: the sampler's devices, lent while the rollout is drained.
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
            sampler_replicas=sampler_replicas, replica_devices=replica_devices, slots=slots
        )
        self.rows = micro_batch_rows
        self.clock: Callable[[], float] = time.monotonic
        self.timeline = Timeline()
        self._decided: set[int] = set()
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
        drained: bool,
        updates_left: int,
        groups_per_update: int,
        group_size: int,
        tokens_per_group: float,
    ) -> None:
        """Decides once per round, when the sampler has drained; borrows on a move."""
        if round in self._decided or not drained or not updates_left or self.learner.borrowing:
            return
        self._decided.add(round)
        groups = updates_left * groups_per_update
        state = PoolState(
            learner_devices=len(self.learner.mesh.devices.flat),
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
        self._decided.discard(round)
        return self._metrics.pop(round, {})
