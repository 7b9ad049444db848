"""The simulated learner: operations queued in order and run one at a time on the virtual clock.

As learner.Learner: `micro_steps` accumulates every full micro-batch of pending rows at once;
`update` folds in the remainder and applies. Work is costed when queued (StageModel: learner_fixed
per micro-batch, learner_per_token per padded token, update_s per update); a publish is an
operation too (the learner waits for it). A device-pool controller may hold the learner
(`blocked`: its work waits, rl/sim/borrow.py lends its devices, rl/sim/multiplex.py gives it to
another pipeline) and speed its per-token work up (`scale` < 1: a borrowed mesh).

Contention (StageModel.contention = g): while the sampler is busy too, an operation progresses at
1 / (1 + g) of its speed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from rl.elastic.stage import StageModel
from rl.timeline import Timeline
from rl.types import Group


@dataclasses.dataclass
class LearnerOp:
    """One operation queued on the simulated learner."""

    name: str  # micro_step | update | publish | borrow
    work: float  # seconds at full speed
    args: dict[str, Any]
    on_end: Callable[[float], None] | None = None
    scalable: float = 0.0  # of `work`: the per-token part (a borrowed mesh shortens it)
    queued: float = 0.0  # when it was queued


class SimLearner:
    """The learner's queue and clock; see the module docstring.

    Args:
      model: the stage-time model (its learner terms).
      at: at(t, fn) runs fn(t) at virtual time t.
      timeline: where the "learner" and "publish" spans go.
      check: called before each operation starts and when the learner turns idle (the pool's
        hook: it may hold the learner); None: nothing to ask.
      on_busy: on_busy(busy, t) when the learner turns busy or idle (the sampler's contention).
    """

    def __init__(
        self,
        model: StageModel,
        *,
        at: Callable[[float, Callable[[float], None]], None],
        timeline: Timeline,
        check: Callable[[float], None] | None = None,
        on_busy: Callable[[bool, float], None] | None = None,
    ):
        self.model, self.at, self.timeline = model, at, timeline
        self._check, self._on_busy = check, on_busy
        self.ops: list[LearnerOp] = []
        self.op: LearnerOp | None = None  # the operation in flight
        self.start = 0.0  # when it started
        self._last = 0.0  # when its remaining work was last recomputed
        self._epoch = 0
        self._rate = 1.0
        self.busy_s = 0.0  # seconds the learner's devices worked (publishes included)
        self.steps = 0  # updates applied
        self.blocked = False  # held by the pool: queued work waits
        self.scale = 1.0  # per-token work multiplier (a borrowed mesh: < 1)
        self._pending: list[tuple[int, int]] = []  # rows (prompt, response) not yet costed
        self._scalable = 0.0

    # ------------------------------------------------------------------------------ costing

    def _flush_s(self) -> float:
        if not self._pending:
            return 0.0
        rows, self._pending = self._pending, []
        scalable = self.model.learner_per_token * self.model.batch_tokens(rows) * self.scale
        self._scalable += scalable
        return self.model.learner_fixed + scalable

    def _take_scalable(self) -> float:
        out, self._scalable = self._scalable, 0.0
        return out

    def micro_steps(self, groups: list[Group], args: dict[str, Any]) -> LearnerOp:
        """The micro-batches `groups` complete (a partial one waits for the next groups)."""
        work = 0.0
        for g in groups:
            self._pending += [(len(g.request.prompt), len(c.tokens)) for c in g.completions]
            if len(self._pending) >= max(self.model.micro_batch_rows, 1):
                work += self._flush_s()
        return LearnerOp("micro_step", work, args, scalable=self._take_scalable())

    def update(self, args: dict[str, Any], on_end: Callable[[float], None]) -> LearnerOp:
        """The remainder's micro-batch and the optimizer apply."""
        work = self._flush_s() + self.model.update_s
        return LearnerOp("update", work, args, on_end, self._take_scalable())

    def publish_span(self, start: float, end: float, *, version: int, round: int) -> None:
        """A weight publish on the "publish" lane (round -1: the initial weights)."""
        self.timeline.span("publish", f"v{version}", start, end, version=version, round=round)

    # ---------------------------------------------------------------------------- the clock

    @property
    def idle(self) -> bool:
        return self.op is None and not self.ops

    def left_s(self, now: float) -> float:
        """Work queued, the operation in flight's remainder included (seconds at full speed)."""
        work = sum(op.work for op in self.ops)
        if self.op is not None:
            work += max(self.op.work - (now - self._last) * self._rate, 0.0)
        return work

    def queue(self, op: LearnerOp, now: float) -> None:
        op.queued = now
        self.ops.append(op)
        if self.op is None and not self.blocked:
            self._next(now)
        elif self.blocked and self._check is not None:
            self._check(now)  # async: the learner's batch may take its devices back

    def resume(self, now: float) -> None:
        """Starts the next queued operation if none runs (after the learner was held)."""
        if self.op is None and self.ops:
            self._next(now)

    def _next(self, now: float) -> None:
        if self._check is not None:
            self._check(now)  # may put a switch first, lend the learner, or give it away
            if self.blocked:
                return
        self.op = self.ops.pop(0)  # the learner was idle: _next runs only then
        self.start = self._last = now
        if self._on_busy is not None:
            self._on_busy(True, now)
        self._plan()

    def _plan(self) -> None:
        self._epoch += 1
        epoch, op = self._epoch, self.op
        assert op is not None
        self.at(self._last + op.work / self._rate, lambda t: self._end(epoch, t))

    def _in_flight_left(self, now: float) -> tuple[float, float]:
        """(work, per-token work) left of the operation in flight at `now`; (0, 0): none."""
        op = self.op
        if op is None:
            return 0.0, 0.0
        left = max(op.work - (now - self._last) * self._rate, 0.0)
        return left, op.scalable * (left / op.work if op.work else 0.0)

    def scalable_left(self, now: float) -> float:
        """Per-token work (seconds) queued and left of the operation in flight."""
        return sum(op.scalable for op in self.ops) + self._in_flight_left(now)[1]

    def stretch(self, scale: float, extra_s: float, now: float) -> None:
        """The operation in flight from now on: the rest of its per-token work runs `scale` as
        long, after `extra_s` more (a mesh switched between two of its micro-batches)."""
        op = self.op
        if op is None:
            return
        left, scalable = self._in_flight_left(now)
        op.work = left - scalable * (1 - scale) + extra_s
        op.scalable = scalable * scale
        self._last = now
        self._plan()

    def set_rate(self, rate: float, now: float) -> None:
        """Progress at `rate` x full speed from now on (contention)."""
        if rate == self._rate:
            return
        if self.op is not None:
            self.op.work -= (now - self._last) * self._rate
            self._last = now
            self._rate = rate
            self._plan()
        self._rate = rate

    def _end(self, epoch: int, now: float) -> None:
        if epoch != self._epoch:
            return
        op = self.op
        assert op is not None
        if op.name == "publish":
            self.publish_span(self.start, now, **op.args)
        else:
            self.timeline.span("learner", op.name, self.start, now, step=self.steps, **op.args)
        self.op = None
        self.busy_s += now - self.start
        if op.name == "update":
            self.steps += 1
        if op.on_end is not None:
            op.on_end(now)  # may queue operations (and start one)
        if self.op is not None:
            return
        if self.ops and not self.blocked:
            self._next(now)
            return
        if self._on_busy is not None:
            self._on_busy(False, now)
        if self._check is not None:
            self._check(now)
