"""What a schedule says, and the registry of schedules.

A schedule is pure and clock-free: a runtime (rl.driver's threads, rl.sim's virtual clock) tells it
what happened and does what it answers, in order:

    actions = schedule.begin(round)          # the runtime wants round `round` trained
    actions = schedule.on_group(group)       # a complete group arrived from the sampler
    actions = schedule.on_update_done()      # the learner finished the last Update it was given
    actions = schedule.on_published()        # the last Publish reached the sampler

Actions: Submit (requests to the sampler, with a tail-batching cut), Begin (the learner starts a run
of updates from the published params), Add (accumulate groups), Update (apply one optimizer update;
its batch is what it trains), Publish (weights of the next version to the sampler), RoundDone (every
group of a round is trained). A runtime runs Add/Update/Publish one after another, and reports each
Update's and Publish's end before it runs the actions that come after them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Protocol

from rl.registry import Registry
from rl.round_planner import RoundCut, RoundPlan, RoundPlanner
from rl.types import Group, Prompt, Request


@dataclasses.dataclass(frozen=True)
class Submit:
    round: int
    requests: tuple[Request, ...]
    cut: RoundCut | None = None  # a short round's: train the first `target` complete groups
    version: int = 0  # the policy version when submitted


@dataclasses.dataclass(frozen=True)
class Begin:
    updates: int  # updates that follow from the current params before the next Publish


@dataclasses.dataclass(frozen=True)
class Add:
    round: int
    groups: tuple[Group, ...]


@dataclasses.dataclass(frozen=True)
class Update:
    round: int
    batch: tuple[Group, ...]  # what this update trains, in training order
    version: int  # the version of the params this update starts from


@dataclasses.dataclass(frozen=True)
class Publish:
    round: int  # the round whose update produced these weights
    version: int  # the new version


@dataclasses.dataclass(frozen=True)
class RoundDone:
    plan: RoundPlan
    trained: tuple[Group, ...]  # in training order
    version: int  # the policy version that sampled the round's first requests
    discarded: tuple[Group, ...] = ()  # dynamic sampling: sampled, all rewards equal, not trained


Action = Submit | Begin | Add | Update | Publish | RoundDone


@dataclasses.dataclass(frozen=True)
class StageTimes:
    """Mean stage times of one round, from stage-time models (rl.device_split), that a schedule's
    `predict_round_s(cfg, times)` turns into seconds per round."""

    rollout_s: float  # the whole round's rollout
    train_s: float  # every update of the round
    first_batch_s: float  # until the first U groups are complete
    update_s: float  # one update
    publish_s: float  # one publish


RequestsOf = Callable[[RoundPlan], list[Request]]


class Schedule(Protocol):
    name: str

    @staticmethod
    def predict_round_s(cfg: object, t: StageTimes) -> float:
        """Seconds per round of this mode from stage times (the device-split planner's)."""

    def begin(self, round: int) -> list[Action]:
        """The runtime wants round `round` trained (rounds are begun in order)."""

    def on_group(self, group: Group) -> list[Action]:
        """A complete group arrived."""

    def on_update_done(self) -> list[Action]:
        """The last Update finished."""

    def on_published(self) -> list[Action]:
        """The last Publish reached the sampler."""

    @property
    def version(self) -> int:
        """The newest published version."""

    def in_flight(self) -> list[Prompt]:
        """Between rounds: prompts drawn for rounds not yet trained, in draw order (a checkpoint
        records them; a resume samples them first). Empty unless async keeps sampling."""


MakeSchedule = Callable[..., Schedule]
SCHEDULES: Registry[MakeSchedule] = Registry("schedule")


def make_schedule(
    cfg: object,
    *,
    planner: RoundPlanner,
    requests_of: RequestsOf,
    version: int = 0,
    rounds: int | None = None,
    make_former: Callable[..., object] | None = None,
    barrier_every: int = 0,
    keep_sampling: bool = False,
) -> Schedule:
    """The schedule of `cfg.mode` (a rl.schedules.ScheduleConfig or a subclass).

    Args:
      cfg: the schedule config (mode, policies, R, U, G, staleness).
      planner: the round planner (prompts, tail batching).
      requests_of: a RoundPlan's Requests (the runtime's sampling parameters).
      version: the published version the run starts from.
      rounds: the run's last round + 1, if known (async does not plan past it).
      make_former: builds a batch former (name, U, groups); default rl.formation.make_former,
        whose registry holds the built-in and user-registered formers.
      barrier_every: async: every this many rounds nothing of a later round is in flight (the
        runtime's checkpoint interval, so a resume is exact); round schedules always are.
      keep_sampling: async: at those barriers only the learner waits (no update of a later round
        starts before the runtime begins it); later rounds keep sampling, and `in_flight` names
        their prompts (a checkpoint without a pipeline bubble).
    """
    kw: dict[str, object] = {} if make_former is None else {"make_former": make_former}
    if barrier_every:
        kw["barrier_every"] = barrier_every
    if keep_sampling:
        kw["keep_sampling"] = keep_sampling
    return SCHEDULES.get(cfg.mode)(  # type: ignore[attr-defined]
        cfg, planner=planner, requests_of=requests_of, version=version, rounds=rounds, **kw
    )
