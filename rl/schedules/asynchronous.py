"""`async`: bounded-staleness asynchrony (PipelineRL, AReaL, BiDiRL).

The sampler keeps decoding ahead of the learner. Weights are published after every update (version
v = updates applied), and the runtime swaps them into the running engine between decode steps, so
an in-flight sequence carries on with its KV cache and its tokens record the versions that made
them. Update k trains the logical groups kU..kU+U-1 (rounds of R prompts drawn in order, batches
released in logical order, one update outstanding at a time). A request is submitted only once
k <= v + s, k its update, s = `max_staleness`: AReaL's admission rule accepted + running <
(s + v + 1) * U with U groups per update, written per request so that a short last batch keeps the
bound. Every token an update trains was therefore produced by a policy at most s versions older
than the one updated. s = 0 submits the next update's groups only after the previous publish: the
on-policy schedule (with U = R it is `cgp` + `ordered`, bit for bit).

Frontier admission matters here: with several versions' requests waiting, `frontier` starts the
lowest (round, index) first, the groups the next update needs; `fcfs` starts them in arrival order.
Rounds are bookkeeping (prompts are drawn R at a time; a round is done when its last update is);
tail batching is not combined with async.

Checkpoints: with `barrier_every` = k (the runtime passes its checkpoint interval), a round
r with (r + 1) % k == 0 is a barrier: no prompt of a later round is drawn or submitted before the
runtime begins round r + 1 (after round r is trained and checkpointed). A checkpoint taken there
has nothing in flight (the data iterator has drawn exactly the rounds up to r), and since the
uninterrupted run has the same barriers, a resume from it continues the exact trajectory. The
price is a pipeline bubble every k rounds: the sampler drains round r's tail with nothing to do.

With `keep_sampling` (config.async_resume = "no_bubble") only the learner waits at a barrier:
later rounds are drawn and sampled as usual (within the staleness bound), but no update of a
later round starts before the runtime begins round r + 1, so the checkpoint holds exactly the
rounds up to r, and `in_flight()` names the prompts of the later rounds already drawn. A resume
samples those first, under the restored policy (rl.round_planner.RoundPlanner.replay): every prompt is
trained once, in the same rounds, on-policy within the bound, though not bitwise as the
uninterrupted run (whose in-flight samples came from older versions).
"""

from __future__ import annotations

import collections
import dataclasses
import math

from rl.round_planner import RoundPlan, RoundPlanner
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
from rl.types import Group, Prompt, Request


def fill_groups_per_update(
    *,
    slots: int,
    group_size: int,
    max_staleness: int,
    groups_per_round: int,
    tail_factor: float = 1.0,
) -> int:
    """The smallest groups per update U (a divisor of R = `groups_per_round`) whose staleness
    window keeps the sampler's `slots` (all replicas') busy; R when none does.

    The window holds (s + 1) x U groups of G = `group_size` sequences. An update trains only once
    its batch's longest sequence ends, and while that one decodes each slot serves about
    `tail_factor` = longest / mean response length sequences, so the window must hold
    slots x tail_factor sequences: with tail_factor 1 it merely covers the slots. A smaller U
    leaves slots idle whatever the sampler's speed: with U = 2, s = 1 and G = 8 at most 32
    sequences run on, say, 4 replicas x 256 slots.
    """
    if tail_factor < 1.0:
        raise ValueError(
            f"tail_factor must be >= 1 (longest / mean length); received {tail_factor}."
        )
    need = math.ceil(slots * tail_factor / (group_size * (max_staleness + 1)))
    return next(
        (u for u in range(max(1, need), groups_per_round + 1) if groups_per_round % u == 0),
        groups_per_round,
    )


def window_warning(cfg: object, slots: int) -> str | None:
    """A line for the log when an async schedule's staleness window, (s + 1) x U groups of G, is
    smaller than the sampler's `slots` (all replicas'): those slots can never all be busy. None
    when the window covers them, or for another mode."""
    if cfg.mode != "async":  # type: ignore[attr-defined]
        return None
    s, u, g = cfg.max_staleness, cfg.groups_per_update, cfg.group_size  # type: ignore[attr-defined]
    window = (s + 1) * u * g
    if window >= slots:
        return None
    fill = fill_groups_per_update(
        slots=slots,
        group_size=g,
        max_staleness=s,
        groups_per_round=cfg.groups_per_round,  # type: ignore[attr-defined]
    )
    return (
        f"driver.mode='async' keeps at most (max_staleness + 1) x groups_per_update x group_size "
        f"= ({s} + 1) x {u} x {g} = {window} sequences in flight on {slots} sampler slots, so "
        f"the sampler runs part-empty; groups_per_update={fill} (or a larger max_staleness) "
        "covers the slots, and a long-tailed workload wants a few times that (launch.simulate's "
        "+fill rows)."
    )


@dataclasses.dataclass
class _AsyncRound:
    plan: RoundPlan
    first_update: int
    expected: int
    version: int | None = None  # the version when its first request was submitted
    trained: list[Group] = dataclasses.field(default_factory=list)
    updates: int = 0


@SCHEDULES.register("async")
class AsyncSchedule:
    """Bounded-staleness asynchrony; see the module docstring."""

    name = "async"

    @staticmethod
    def predict_round_s(cfg: object, t: StageTimes) -> float:
        """Seconds per round from stage times (rl.device_split), roughly: with s = 0 nothing overlaps
        (sample, train and publish per update); with s >= 1 rounds overlap and the slower side
        (sampling, or training plus a publish per update) sets the pace."""
        publishes = t.publish_s * cfg.updates_per_round  # type: ignore[attr-defined]
        if cfg.max_staleness == 0:  # type: ignore[attr-defined]
            return t.rollout_s + t.train_s + publishes
        return max(t.rollout_s, t.train_s + publishes)

    def __init__(
        self,
        cfg: object,
        *,
        planner: RoundPlanner,
        requests_of: RequestsOf,
        version: int = 0,
        rounds: int | None = None,
        make_former: object = None,  # unused: async releases batches in logical order itself
        barrier_every: int = 0,
        keep_sampling: bool = False,
    ):
        if barrier_every < 0:
            raise ValueError(f"barrier_every must be >= 0 (0: none); received {barrier_every}.")
        self.barrier_every, self.keep_sampling = barrier_every, keep_sampling
        self.cfg = cfg
        self.u: int = cfg.groups_per_update  # type: ignore[attr-defined]
        self.s: int = cfg.max_staleness  # type: ignore[attr-defined]
        self.planner, self.requests_of = planner, requests_of
        self.stop = rounds  # no round at or past this one is planned
        self._version = version
        self._done = 0  # updates applied since the start
        self._planned = 0  # updates planned (index of the next round's first update)
        self._next_round: int | None = None
        self._wanted = -1  # the latest round the runtime asked for (begin)
        self._exhausted = False
        self._waiting: collections.deque[tuple[Request, int]] = collections.deque()  # (req, update)
        self._rounds: dict[int, _AsyncRound] = {}
        self._need: dict[int, tuple[int, set[tuple[int, int]]]] = {}  # update -> (round, keys)
        self._buf: dict[int, dict[tuple[int, int], Group]] = {}  # update -> arrived groups
        self._next_update = 0  # the next update to release
        self._outstanding: Update | None = None
        self._publishing = False

    @property
    def version(self) -> int:
        return self._version

    @property
    def updates_done(self) -> int:
        return self._done

    def next_batch_missing(self) -> frozenset[tuple[int, int]]:
        """The (round, uid) keys of the groups the next update still waits for."""
        need = self._need.get(self._next_update)
        return frozenset(need[1]) if need is not None else frozenset()

    def begin(self, round: int) -> list[Action]:
        """The runtime wants round `round`: submits what the bound allows (rounds run ahead of
        `begin` on their own). StopIteration: the source ran out before `round`."""
        self._wanted = max(self._wanted, round)
        if self._next_round is None:
            self._next_round = round
        elif round > self._next_round:
            raise RuntimeError(
                f"begin({round}) skips rounds; expected round {self._next_round} or an earlier one."
            )
        out = self._fill() + self._release()
        if round >= self._next_round:  # not planned: the source ran out or the run's end
            raise StopIteration
        return out

    def in_flight(self) -> list[Prompt]:
        if any(rnd.updates for rnd in self._rounds.values()):
            raise RuntimeError(
                "in_flight() while a round is partly trained; call it between rounds."
            )
        return [p for r in sorted(self._rounds) for p in self._rounds[r].plan.prompts]

    def _held(self, round: int) -> bool:
        """Whether round `round` waits behind a barrier (round - 1's) for the runtime's begin."""
        every = self.barrier_every
        return bool(every) and round % every == 0 and round > self._wanted

    # ------------------------------------------------------------------ what may be submitted

    def _plan_next(self) -> bool:
        r = self._next_round
        if self._exhausted or r is None or (self.stop is not None and r >= self.stop):
            return False
        if self._held(r) and not self.keep_sampling:
            return False  # round r - 1 is a barrier: round r waits for the runtime's begin(r)
        try:
            plan = self.planner.plan(r)
        except StopIteration:
            self._exhausted = True
            return False
        self.planner.finish(plan, [p.uid for p in plan.prompts])  # plain rounds: all trained
        expected = -(-plan.target // self.u)
        self._rounds[r] = _AsyncRound(plan, self._planned, expected)
        for k in range(expected):
            self._need[self._planned + k] = (r, set())
        for req in self.requests_of(plan):
            k = self._planned + req.index // self.u
            self._need[k][1].add(req.key)
            self._waiting.append((req, k))
        self._planned += expected
        self._next_round = r + 1
        return True

    def _fill(self) -> list[Action]:
        """Submits every request whose update is within s of the updates applied."""
        limit = self._done + self.s
        by_round: dict[int, list[Request]] = {}
        while True:
            if not self._waiting:
                if self._planned > limit or not self._plan_next():
                    break
                continue
            req, k = self._waiting[0]
            if k > limit:
                break
            self._waiting.popleft()
            by_round.setdefault(req.round, []).append(req)
        out: list[Action] = []
        for r, reqs in by_round.items():
            rnd = self._rounds[r]
            if rnd.version is None:
                rnd.version = self._version
            out.append(Submit(r, tuple(reqs), None, self._version))
        return out

    # ------------------------------------------------------------------------ the learner side

    def on_group(self, group: Group) -> list[Action]:
        key = group.request.key
        k = next(
            (k for k in range(self._next_update, self._planned) if key in self._need[k][1]), None
        )
        if k is None:
            raise RuntimeError(f"Group (round, uid)={key} was not submitted by this schedule.")
        self._need[k][1].discard(key)
        self._buf.setdefault(k, {})[key] = group
        return self._release()

    def _release(self) -> list[Action]:
        k = self._next_update
        if self._outstanding is not None or self._publishing or k not in self._need:
            return []
        round, missing = self._need[k]
        if missing or self._held(round):  # (held: keep_sampling's barrier, the learner's side)
            return []
        del self._need[k]
        batch = tuple(sorted(self._buf.pop(k, {}).values(), key=lambda g: g.request.index))
        self._next_update += 1
        self._outstanding = Update(round, batch, self._version)
        return [Begin(1), Add(round, batch), self._outstanding]

    def on_update_done(self) -> list[Action]:
        up = self._outstanding
        if up is None:
            raise RuntimeError("on_update_done() with no update outstanding.")
        self._outstanding = None
        rnd = self._rounds[up.round]
        rnd.trained.extend(up.batch)
        rnd.updates += 1
        self._done += 1
        self._version += 1
        self._publishing = True
        out: list[Action] = []
        if rnd.updates == rnd.expected:
            del self._rounds[up.round]
            out.append(RoundDone(rnd.plan, tuple(rnd.trained), rnd.version or 0))
        return out + [Publish(up.round, self._version)]

    def on_published(self) -> list[Action]:
        self._publishing = False
        return self._fill() + self._release()
