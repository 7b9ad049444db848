"""Bidirectional device borrowing (BiDiRL): lend the idle pool's devices to the bottleneck.

A pure, clock-free policy shared by the runtime (rl/driver.py) and the simulator (rl/sim). Given the
stage-time model (rl.elastic.stage.StageModel: one sampler replica, a learner of `model_learner_devices`)
and what remains of the round (`PoolState`), it predicts the round's remaining time with and
without the move and moves only when the gain beats the switch cost (a running mean of the
measured switches of that direction; `switch_cost_s` before the first).

  learner borrows   the rollout has drained (nothing running or waiting on the sampler) and the
                    learner has updates left: its data-parallel mesh extends over the sampler's
                    devices until the round's last update (weights are published after the return).
                    remaining without = T_learn(L), with = T_learn(L + S).
  sampler borrows   the learner waits for groups while sequences remain: an extra engine replica
                    per `tp` learner devices decodes until the rollout drains; the learner's work
                    waits for its devices. remaining without = max(T_roll(n) + one update, T_learn)
                    when the learner trains groups as they arrive (cgp), T_roll(n) + T_learn when it
                    trains after the rollout (sync); with = T_roll(n + k) + T_learn.
  under async       (`PoolState.ahead`: the sampler works ahead within the staleness bound) the
                    sampler borrows while the learner waits for its next batch, whose groups
                    still sampling the state describes: the learner would wait T_roll(n) for
                    them, and the k extra replicas decode the window's queued sequences
                    meanwhile; gain = (T_roll(n) - switch) x min(k, queued / slots) / n, the
                    replica-time they take off the n replicas' backlog. The runtime takes them
                    back once the batch is complete (what runs there resumes on the others).
                    The learner borrows as in a round mode once the bound has drained the sampler
                    (nothing sampling until this update is published): the update's work left
                    (`updates_left` 1), between two of its micro-batches if need be.

T_learn(D): micro-batches x learner_fixed + tokens x learner_per_token x (L0 / D) + updates x
update_s (data parallel over D devices: only the per-token term scales; the optimizer apply and the
per-micro-batch cost do not). T_roll(n): steps = max(the longest sequence's remaining tokens, the
tokens left spread over the n replicas' slots), each step costing a + h / k, and each token b + c x
context once (the b term is exact: a step over m active slots costs b m).
"""

from __future__ import annotations

import dataclasses
import math

from rl.elastic.stage import StageModel

MODES = ("off", "learner", "sampler", "both")
DIRECTIONS = ("learner", "sampler")


@dataclasses.dataclass(frozen=True, kw_only=True)
class BorrowConfig:
    """config.elastic: which directions may borrow, the switch-cost prior and the margin, and the
    stage-time models borrowing and the planner (mesh.split="plan") predict with."""

    borrowing: str = "off"  # off | learner | sampler | both
    switch_cost_s: float = 1.0  # prior cost of one switch (there and back) before any is measured
    margin: float = 1.0  # move only when predicted gain > margin * switch cost
    stage_model: str = (
        ""  # a launch.profile JSON or "preset:<model>:<gpu>" (rl/runtime/mesh_plan.py)
    )
    median_tokens: float = 0.0  # the planner's workload: median response length; 0: cap / 4

    def __post_init__(self):
        if self.borrowing not in MODES:
            raise ValueError(
                f"config.elastic.borrowing={self.borrowing!r}; expected one of {MODES}."
            )
        for name in ("switch_cost_s", "margin", "median_tokens"):
            v = getattr(self, name)
            if (
                isinstance(v, bool)
                or not isinstance(v, int | float)
                or not math.isfinite(v)
                or v < 0
            ):
                raise ValueError(f"config.elastic.{name}={v!r}; expected a finite number >= 0.")

    def allows(self, direction: str) -> bool:
        return self.borrowing in (direction, "both")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PoolState:
    """What remains of the round, as the runtime or the simulator sees it.

    Sampler side: `sequences` not finished (running or waiting), the response tokens they still
    need (`tokens_left`, an estimate at runtime) and the longest one's (`longest_left`),
    `context` the mean KV tokens a running sequence holds. Learner side: updates, micro-batches
    and tokens left to train this round (groups not yet sampled included), and whether the learner
    is waiting for groups now.
    """

    learner_devices: int
    sampler_replicas: int
    replica_devices: int = 1  # tp of a sampler replica
    slots: int  # per replica
    sequences: int = 0
    tokens_left: float = 0.0
    longest_left: float = 0.0
    context: float = 0.0
    updates_left: int = 0
    micro_batches_left: int = 0
    learner_tokens_left: float = 0.0
    learner_waiting: bool = False
    overlap: bool = True  # the learner trains groups as they arrive (cgp); sync: after the rollout
    ahead: bool = False  # async: the sampler works ahead; the sampler side is the next batch's
    queued: int = 0  # sequences submitted and waiting for a slot (what extra replicas can take)

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, bool) and (not math.isfinite(v) or v < 0):
                raise ValueError(f"PoolState.{f.name} must be finite and >= 0; received {v}.")
        if min(self.learner_devices, self.sampler_replicas, self.replica_devices, self.slots) < 1:
            raise ValueError(
                "PoolState: learner_devices, sampler_replicas, replica_devices and slots must be "
                f">= 1; received {self.learner_devices}, {self.sampler_replicas}, "
                f"{self.replica_devices}, {self.slots}."
            )

    @property
    def sampler_devices(self) -> int:
        return self.sampler_replicas * self.replica_devices


@dataclasses.dataclass(frozen=True)
class Decision:
    """One decision: the direction considered, whether to move, and why."""

    direction: str  # learner | sampler | none
    move: bool
    devices: int  # devices that would move
    gain_s: float  # predicted seconds saved (before the switch cost)
    switch_cost_s: float  # the estimate the gain was compared with
    reason: str

    def metrics(self) -> dict[str, float]:
        """Round-metric fields of this decision (rl/metrics.py naming)."""
        d = self.direction
        return {
            f"borrow_{d}": float(self.move),
            f"borrow_{d}_gain_s": self.gain_s,
            f"borrow_{d}_switch_cost_s": self.switch_cost_s,
        }


NO_DECISION = Decision("none", False, 0, 0.0, 0.0, "nothing to borrow")


class SwitchCost:
    """Running mean of the measured switch seconds of one direction; `prior` before the first."""

    def __init__(self, prior: float):
        self.prior, self.total, self.count = prior, 0.0, 0

    def record(self, seconds: float) -> None:
        if not math.isfinite(seconds) or seconds < 0:
            raise ValueError(f"A measured switch must be finite and >= 0 s; received {seconds}.")
        self.total += seconds
        self.count += 1

    @property
    def estimate(self) -> float:
        return self.total / self.count if self.count else self.prior


class BorrowPolicy:
    """Decides whether the idle pool lends its devices to the bottleneck; see the module docstring.

    Args:
      cfg: which directions may move, the switch-cost prior and the margin.
      model: stage-time model of one sampler replica and of the learner.
      model_learner_devices: the learner devices `model`'s learner terms were measured on (L0).
    """

    def __init__(self, cfg: BorrowConfig, model: StageModel, *, model_learner_devices: int):
        if model_learner_devices < 1:
            raise ValueError(
                f"model_learner_devices must be >= 1; received {model_learner_devices}."
            )
        self.cfg, self.model, self.l0 = cfg, model, model_learner_devices
        self.switch = {d: SwitchCost(cfg.switch_cost_s) for d in DIRECTIONS}

    def record_switch(self, direction: str, seconds: float) -> None:
        """A measured switch (there and back) of `direction`: it updates that direction's estimate."""
        if direction not in DIRECTIONS:
            raise ValueError(f"direction={direction!r}; expected one of {DIRECTIONS}.")
        self.switch[direction].record(seconds)

    # ---------------------------------------------------------------------------- predictions

    def learner_s(self, s: PoolState, devices: int) -> float:
        """Seconds the learner needs for the round's remaining work on `devices` devices."""
        m = self.model
        return (
            s.micro_batches_left * m.learner_fixed
            + s.learner_tokens_left * m.learner_per_token * self.l0 / devices
            + s.updates_left * m.update_s
        )

    def rollout_s(self, s: PoolState, replicas: int) -> float:
        """Seconds until the sequences left finish on `replicas` replicas of `s.slots` slots."""
        if not s.sequences:
            return 0.0
        m, k = self.model, self.model.steps_per_call
        active = min(s.slots, s.sequences / replicas)  # per replica, at the start
        steps = max(s.longest_left, s.tokens_left / (replicas * active))
        # each token costs b (and c per KV token it reads) once; each step a (and h / k)
        per_token = m.decode_b + m.decode_c * s.context
        return steps * (m.decode_a + m.call_overhead / k) + per_token * s.tokens_left / replicas

    # ------------------------------------------------------------------------------- decisions

    def decide(self, s: PoolState) -> Decision:
        """The move the state calls for (learner direction first: it needs a drained rollout)."""
        if s.sequences == 0 and s.updates_left and self.cfg.allows("learner"):
            gain = self.learner_s(s, s.learner_devices) - self.learner_s(
                s, s.learner_devices + s.sampler_devices
            )
            return self._judge("learner", s.sampler_devices, gain)
        if s.sequences and s.learner_waiting and self.cfg.allows("sampler"):
            extra = s.learner_devices // s.replica_devices
            if not extra:
                return Decision(
                    "sampler",
                    False,
                    0,
                    0.0,
                    self.switch["sampler"].estimate,
                    f"{s.learner_devices} learner devices make no replica of tp "
                    f"{s.replica_devices}",
                )
            if s.ahead:
                return self._judge("sampler", extra * s.replica_devices, self._ahead_gain(s, extra))
            learn = self.learner_s(s, s.learner_devices)
            one_update = self.learner_s(
                dataclasses.replace(
                    s,
                    updates_left=min(1, s.updates_left),
                    micro_batches_left=-(-s.micro_batches_left // max(s.updates_left, 1)),
                    learner_tokens_left=s.learner_tokens_left / max(s.updates_left, 1),
                ),
                s.learner_devices,
            )
            roll = self.rollout_s(s, s.sampler_replicas)
            without = max(roll + one_update, learn) if s.overlap else roll + learn
            with_ = self.rollout_s(s, s.sampler_replicas + extra) + learn
            return self._judge("sampler", extra * s.replica_devices, without - with_)
        return NO_DECISION

    def _ahead_gain(self, s: PoolState, extra: int) -> float:
        """async: the learner waits rollout_s(next batch) for its batch; the extra replicas decode
        the window's queued sequences meanwhile (after the switch), which takes that much
        replica-time off the n replicas' backlog: (wait - switch) x extra' / n seconds, extra'
        the replicas the queue can fill."""
        wait = self.rollout_s(s, s.sampler_replicas)
        fill = min(float(extra), s.queued / s.slots)
        cost = self.switch["sampler"].estimate
        return max(wait - cost, 0.0) * fill / s.sampler_replicas

    def _judge(self, direction: str, devices: int, gain: float) -> Decision:
        cost = self.switch[direction].estimate
        move = gain > self.cfg.margin * cost
        rel = ">" if move else "<="
        return Decision(
            direction,
            move,
            devices,
            gain,
            cost,
            f"predicted gain {gain:.3g} s {rel} {self.cfg.margin:g} x switch cost {cost:.3g} s",
        )
