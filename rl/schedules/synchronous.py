"""The round schedules: one round in flight, weights published after the round's S updates.

  sync  rollout all the round's groups, then train them in logical order (slime; the baseline).
  cgp   complete-group pipelining (RolloutPipe): each complete group goes to the learner at once;
        an update runs as soon as the batch former (`batching`, any registered name) releases U
        groups. With `fifo` batches, and in a tail-batching short round whatever `batching` says
        (its trained set is defined by completion order), cgp is RollPacker's stream trainer: each
        arriving group is accumulated at once and the update applied when U groups are in.

Rounds come from the rl.round_planner.RoundPlanner: plain rounds, or with tail batching short rounds
(launch ceil(eta R), train the first R to complete: a RoundCut goes with the Submit) and long rounds.
`sync` and `cgp` + `ordered` perform the same updates on the same data.

Dynamic sampling (DAPO; `cfg.dynamic_sampling`): a group whose rewards are all equal is discarded
and, while the round's launched minus discarded groups fall short of R, a fresh prompt is drawn
(`RoundPlanner.refill`, a second Submit of the round) in its place, up to ceil(max_oversample * R)
prompts per round. A prompt is drawn only while launched - discarded < R, so the round ends with
the first N prompts of the source, N the least with R informative groups among them (or the
budget): the trained set does not depend on completion order. `sync` trains the informative
groups in logical order, `cgp` + `ordered` releases them in the same order as their predecessors
(discarded or kept) arrive, so the two still perform the same updates; `cgp` + `fifo` batches
them in completion order. A round that ran out of budget trains what it has (its last update
smaller, or none at all).
"""

from __future__ import annotations

import abc
import collections
import dataclasses
import math
from collections.abc import Callable

from rl.formation import BatchFormer, FifoBatches, logical_batches, make_former
from rl.round_planner import RoundCut, RoundPlan, RoundPlanner
from rl.schedules.base import (
    SCHEDULES,
    Action,
    Add,
    Begin,
    Publish,
    RequestsOf,
    RoundDone,
    StageTimes,
    Submit,
    Update,
)
from rl.types import Group, Prompt


@dataclasses.dataclass
class _RoundInFlight:
    plan: RoundPlan
    version: int
    stream: bool
    former: BatchFormer | None
    expected: int  # updates: ceil(target / U)
    received: list[Group] = dataclasses.field(default_factory=list)
    trained: list[Group] = dataclasses.field(default_factory=list)
    updates: int = 0
    # dynamic sampling
    dynamic: bool = False
    closed: bool = True  # every group the round will receive has arrived (always, without it)
    budget: int = 0  # prompts the round may draw in all
    kept: list[Group] = dataclasses.field(default_factory=list)
    discarded: list[Group] = dataclasses.field(default_factory=list)
    arrived: dict[int, tuple[Group, bool]] = dataclasses.field(default_factory=dict)
    next_index: int = 0  # logical cursor: groups before it were passed on (kept) or dropped


ZERO_VARIANCE_ATOL = 1e-6  # as rl.advantages.zero_variance_groups


def informative(group: Group) -> bool:
    """Whether the group's rewards differ (max - min > 1e-6): a GRPO-family advantage is nonzero."""
    rewards = group.rewards
    return max(rewards) - min(rewards) > ZERO_VARIANCE_ATOL


class RoundSchedule(abc.ABC):
    """One round at a time; subclasses say how arriving groups become updates."""

    name = "rounds"
    rollout_first = False  # True: a round trains only once all its groups arrived (sync)

    def __init__(
        self,
        cfg: object,
        *,
        planner: RoundPlanner,
        requests_of: RequestsOf,
        version: int = 0,
        rounds: int | None = None,
        make_former: Callable[..., BatchFormer] = make_former,
        barrier_every: int = 0,  # one round in flight: every round is a barrier already
    ):
        self.cfg = cfg
        self.make_former = make_former
        self.u: int = cfg.groups_per_update  # type: ignore[attr-defined]
        self.planner = planner
        self.requests_of = requests_of
        self._version = version
        self._round: _RoundInFlight | None = None
        self._outstanding: collections.deque[Update] = collections.deque()

    @property
    def version(self) -> int:
        return self._version

    def in_flight(self) -> list[Prompt]:
        return []  # one round at a time: nothing is drawn past the round being trained

    @property
    def open_round(self) -> int | None:
        return None if self._round is None else self._round.plan.round

    def begin(self, round: int) -> list[Action]:
        """Plans round `round` (StopIteration: the source is exhausted and no prompt is queued)."""
        if self._round is not None:
            raise RuntimeError(
                f"begin({round}) while round {self._round.plan.round} is still training."
            )
        plan = self.planner.plan(round)
        cut = RoundCut(plan.target) if plan.aborted else None
        stream = self._stream(cut)
        expected = -(-plan.target // self.u)
        dynamic = bool(getattr(self.cfg, "dynamic_sampling", False))
        self._round = _RoundInFlight(
            plan=plan,
            version=self._version,
            stream=stream,
            former=FifoBatches(self.u) if dynamic else self._former(stream, plan.target),
            expected=expected,
            dynamic=dynamic,
            closed=not dynamic,
            budget=math.ceil(self.cfg.max_oversample * plan.target),  # type: ignore[attr-defined]
        )
        requests = tuple(self.requests_of(plan))
        return [Begin(expected), Submit(round, requests, cut, self._version)]

    def _stream(self, cut: RoundCut | None) -> bool:
        return False

    def _former(self, stream: bool, target: int) -> BatchFormer | None:
        return None

    def on_group(self, group: Group) -> list[Action]:
        rnd = self._round
        if rnd is None or group.request.round != rnd.plan.round:
            raise RuntimeError(
                f"Group (round, uid)={group.request.key} arrived outside its round (open round: "
                f"{None if rnd is None else rnd.plan.round})."
            )
        rnd.received.append(group)
        if rnd.dynamic:
            return self._on_group_dynamic(rnd, group)
        return self._on_group(rnd, group)

    def _on_group_dynamic(self, rnd: _RoundInFlight, group: Group) -> list[Action]:
        """Dynamic sampling: discard, refill, and batch the informative groups (module docstring)."""
        assert rnd.former is not None
        r, out = rnd.plan.round, []
        keep = informative(group)
        (rnd.kept if keep else rnd.discarded).append(group)
        launched = len(rnd.plan.prompts)
        n = min(rnd.plan.target - (launched - len(rnd.discarded)), rnd.budget - launched)
        if n > 0:
            rnd.plan = self.planner.refill(rnd.plan, n)
            new = tuple(self.requests_of(rnd.plan)[launched:])
            if new:
                out.append(Submit(r, new, None, self._version))
        rnd.closed = len(rnd.received) == len(rnd.plan.prompts)
        if rnd.stream:  # completion order; accumulated at once
            ready = [group] if keep else []
            out += [Add(r, (g,)) for g in ready]
        else:  # logical order: pass kept groups on once every earlier index has arrived
            rnd.arrived[group.request.index] = (group, keep)
            ready = []
            while rnd.next_index in rnd.arrived:
                g, k = rnd.arrived.pop(rnd.next_index)
                rnd.next_index += 1
                if k:
                    ready.append(g)
        if self.rollout_first:
            batches = logical_batches(rnd.kept, self.u) if rnd.closed else []
        else:
            batches = [b for g in ready for b in rnd.former.add(g)]
            last = rnd.former.flush() if rnd.closed else None
            batches += [last] if last else []
        for batch in batches:
            out += ([] if rnd.stream else [Add(r, batch)]) + [self._update(rnd, batch)]
        if rnd.closed:
            rnd.expected = -(-len(rnd.kept) // self.u)
            out += self._maybe_finish(rnd)
        return out

    @abc.abstractmethod
    def _on_group(self, rnd: _RoundInFlight, group: Group) -> list[Action]:
        """The actions a group arriving in round `rnd` leads to (`rnd.received` includes it)."""

    def _update(self, rnd: _RoundInFlight, batch: tuple[Group, ...]) -> Update:
        up = Update(rnd.plan.round, batch, self._version)
        self._outstanding.append(up)
        return up

    def on_update_done(self) -> list[Action]:
        if not self._outstanding or self._round is None:
            raise RuntimeError("on_update_done() with no update outstanding.")
        rnd = self._round
        rnd.trained.extend(self._outstanding.popleft().batch)
        rnd.updates += 1
        return self._maybe_finish(rnd)

    def _maybe_finish(self, rnd: _RoundInFlight) -> list[Action]:
        """RoundDone and Publish once every group has arrived and every update is done."""
        if not rnd.closed or rnd.updates < rnd.expected or self._outstanding:
            return []
        expected = len(rnd.kept) if rnd.dynamic else rnd.plan.target
        if len(rnd.trained) != expected:
            raise RuntimeError(
                f"Round {rnd.plan.round} trained {len(rnd.trained)} groups in {rnd.updates} "
                f"updates; expected {expected}."
            )
        discarded = [g.request.uid for g in rnd.discarded]
        self.planner.finish(rnd.plan, [g.request.uid for g in rnd.trained], discarded)
        self._round = None
        self._version += 1
        done = RoundDone(rnd.plan, tuple(rnd.trained), rnd.version, tuple(rnd.discarded))
        return [done, Publish(rnd.plan.round, self._version)]

    def on_published(self) -> list[Action]:
        return []  # the runtime begins the next round when it wants it


@SCHEDULES.register("sync")
class SyncSchedule(RoundSchedule):
    """Rollout all, then train the round in logical order, U groups per update."""

    name = "sync"
    rollout_first = True

    @staticmethod
    def predict_round_s(cfg: object, t: StageTimes) -> float:
        """Seconds per round from stage times (rl.device_split): rollout, then training, then publish."""
        return t.rollout_s + t.train_s + t.publish_s

    def _on_group(self, rnd: _RoundInFlight, group: Group) -> list[Action]:
        if len(rnd.received) < rnd.plan.target:
            return []
        out: list[Action] = []
        for batch in logical_batches(rnd.received, self.u):
            out += [Add(rnd.plan.round, batch), self._update(rnd, batch)]
        return out


@SCHEDULES.register("cgp")
class CgpSchedule(RoundSchedule):
    """Complete-group pipelining; the stream trainer with completion-order batches."""

    name = "cgp"

    @staticmethod
    def predict_round_s(cfg: object, t: StageTimes) -> float:
        """Seconds per round from stage times (rl.device_split): training starts with the first batch and
        ends one update after the rollout at the earliest; then the publish."""
        return max(t.rollout_s + t.update_s, t.first_batch_s + t.train_s) + t.publish_s

    def _stream(self, cut: RoundCut | None) -> bool:
        return cut is not None or self.cfg.batching == "fifo"  # type: ignore[attr-defined]

    def _former(self, stream: bool, target: int) -> BatchFormer:
        name = "fifo" if stream else self.cfg.batching  # type: ignore[attr-defined]
        return self.make_former(name, self.u, target)

    def _on_group(self, rnd: _RoundInFlight, group: Group) -> list[Action]:
        assert rnd.former is not None
        r = rnd.plan.round
        if rnd.stream:  # accumulate at once; an update per U groups
            out: list[Action] = [Add(r, (group,))]
            return out + [self._update(rnd, b) for b in rnd.former.add(group)]
        out = []
        for batch in rnd.former.add(group):
            out += [Add(r, batch), self._update(rnd, batch)]
        return out
