"""Round planning and tail batching (RollPacker). Pure and clock-free: the real driver and the
simulator (`rl/sim/`) call the same objects.

Without tail batching every round is `plain`: P0 fresh prompts, all of them trained.

With tail batching (RollPacker, arXiv 2509.21009) most rounds are `short`: a short round launches
ceil(eta * P0) fresh prompts and trains on the first P0 whose groups complete (`RoundCut`); the
runtime aborts the rest at once (their slots are freed) and `finish` moves their prompts to the
**long-prompt queue**. When that queue holds P0 prompts the next round is `long`: P0 queued prompts,
eta = 1 (all trained), optionally with a larger response cap. Prompts whose responses run long thus
gather in a few long rounds, and the short rounds stop waiting for their slowest group. An aborted
prompt is sampled again from scratch in its long round by the then-current policy: on-policy holds.

Epochs (`epoch_size` prompts of the source): with `epoch_end="flush"` a short round never draws
across an epoch boundary; at the end of an epoch the fresh remainder joins the queue, which is
drained by long rounds and a final `flush` round of the last (< P0) prompts, the one round allowed
to train fewer than P0 groups. Every prompt of an epoch is then trained exactly once within the
epoch. With `"carry"` epochs are not boundaries: the queue carries over and short rounds draw on. A
finite source that runs out is flushed the same way in either mode.

    planner = RoundPlanner(TailConfig(enabled=True), groups_per_round=32, prompts=iter(prompts))
    plan = planner.plan(round)                                   # what to launch
    cut = RoundCut(plan.target)                                  # which complete groups to train
    ... run plan.requests(...), train the groups that cut.offer accepts, abort the rest ...
    planner.finish(plan, trained_uids)                           # the rest join the long queue
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
from collections.abc import Hashable, Iterable, Iterator, Sequence
from typing import Any

from rl.types import Group, Prompt, Request, SamplingParams

EPOCH_END = ("flush", "carry")
KINDS = ("plain", "short", "long", "flush")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TailConfig:
    enabled: bool = False  # off: every round is "plain" (P0 fresh prompts, all trained)
    eta: float = 1.25  # short rounds launch ceil(eta * P0) prompts and train the first P0 complete
    long_max_new_tokens: int = 0  # long rounds' response cap; 0: the same as short rounds
    epoch_end: str = "flush"  # flush | carry: what the long queue does at an epoch end
    response_eta: float = 1.0  # > 1: launch ceil(response_eta * G) samples, keep the first G done

    def __post_init__(self):
        if not math.isfinite(self.eta) or self.eta < 1.0:
            raise ValueError(f"tail.eta must be a finite number >= 1; received {self.eta}.")
        if not math.isfinite(self.response_eta) or self.response_eta < 1.0:
            raise ValueError(
                f"tail.response_eta must be a finite number >= 1 (1 turns it off); received "
                f"{self.response_eta}."
            )
        if self.epoch_end not in EPOCH_END:
            raise ValueError(f"tail.epoch_end={self.epoch_end!r}; expected one of {EPOCH_END}.")
        if self.long_max_new_tokens < 0:
            raise ValueError(
                f"tail.long_max_new_tokens must be >= 0 (0: same as short rounds); received "
                f"{self.long_max_new_tokens}."
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class RoundPlan:
    """What one round launches and how many of its groups it trains."""

    round: int
    kind: str  # plain | short | long | flush
    prompts: tuple[Prompt, ...]  # launched, in logical order (Request.index = position)
    target: int  # groups trained: P0, fewer only in a declared final flush
    max_new_tokens: int | None = None  # this round's response cap; None: the configured one
    response_eta: float = 1.0  # samples launched per kept sample (response over-provisioning)

    @property
    def aborted(self) -> int:
        """Prompts launched but not trained (they go to the long queue)."""
        return len(self.prompts) - self.target

    def requests(self, *, group_size: int, params: SamplingParams) -> list[Request]:
        """The round's Requests: index i is prompt i; G kept samples of ceil(response_eta*G)."""
        if self.max_new_tokens is not None:
            params = dataclasses.replace(params, max_new_tokens=self.max_new_tokens)
        launched = math.ceil(self.response_eta * group_size)

        def capped(p: Prompt) -> SamplingParams:
            if p.max_new_tokens is None or p.max_new_tokens >= params.max_new_tokens:
                return params
            return dataclasses.replace(params, max_new_tokens=p.max_new_tokens)

        return [
            Request(
                uid=p.uid,
                round=self.round,
                index=i,
                prompt=p.tokens,
                group_size=launched,
                keep=group_size if launched > group_size else 0,
                params=capped(p),
                meta=p.meta,
            )
            for i, p in enumerate(self.prompts)
        ]


class RoundCut:
    """The groups a round trains: the first `target` to complete; later ones are refused."""

    def __init__(self, target: int) -> None:
        if target < 1:
            raise ValueError(f"RoundCut target must be >= 1; received {target}.")
        self.target = target
        self.kept: list[Hashable] = []

    def offer(self, key: Hashable) -> bool:
        """True if the group `key` is trained; False once `target` groups were accepted."""
        if self.full:
            return False
        self.kept.append(key)
        return True

    @property
    def full(self) -> bool:
        return len(self.kept) >= self.target


class RoundCuts:
    """The cuts of the rounds in flight, as a sampler applies them: which complete groups it
    emits, and which requests it must abort once a round's cut is full."""

    def __init__(self) -> None:
        self._cuts: dict[int, tuple[RoundCut, list[tuple[int, int]]]] = {}  # round -> cut, keys

    def add(self, cut: RoundCut, requests: Sequence[Request]) -> None:
        """Registers `cut` for `requests`, which must be one round's, with no cut yet."""
        rounds = {r.round for r in requests}
        if len(rounds) != 1:
            raise ValueError(f"A round cut needs the requests of one round; received {rounds}.")
        round = rounds.pop()
        if round in self._cuts:
            raise ValueError(f"Round {round} already has a cut.")
        self._cuts[round] = (cut, [r.key for r in requests])

    def apply(self, groups: Iterable[Group]) -> tuple[list[Group], list[tuple[int, int]], int]:
        """Offers complete groups to their rounds' cuts.

        Returns:
          (the groups to emit, the request keys to abort because their round's cut filled, the
          number of groups refused by a full cut). Aborting a key already done is a no-op.
        """
        out, abort, refused = [], [], 0
        for g in groups:
            entry = self._cuts.get(g.request.round)
            if entry is None:
                out.append(g)
                continue
            cut, keys = entry
            if not cut.offer(g.request.key):
                refused += 1
                continue
            out.append(g)
            if cut.full:
                abort.extend(keys)
        for round in [r for r, (cut, _) in self._cuts.items() if cut.full]:
            del self._cuts[round]
        return out, abort, refused


def prompt_to_json(p: Prompt) -> dict[str, Any]:
    """A prompt as JSON-serializable data (a checkpoint's meta); `prompt_from_json` inverts it."""
    return {"uid": p.uid, "tokens": list(p.tokens), "meta": p.meta}


def prompt_from_json(d: dict[str, Any]) -> Prompt:
    return Prompt(uid=int(d["uid"]), tokens=tuple(d["tokens"]), meta=dict(d["meta"]))


class RoundPlanner:
    """Plans rounds over a prompt source; see the module docstring.

    Args:
        cfg: Tail batching settings (disabled: plain rounds).
        groups_per_round: P0, the groups every round trains.
        prompts: The prompt source (e.g. a grain iterator); may be finite.
        epoch_size: Prompts per epoch of `prompts`, or None when epochs do not matter.
    """

    def __init__(
        self,
        cfg: TailConfig,
        *,
        groups_per_round: int,
        prompts: Iterator[Prompt],
        epoch_size: int | None = None,
    ) -> None:
        if groups_per_round < 1:
            raise ValueError(f"groups_per_round must be >= 1; received {groups_per_round}.")
        if epoch_size is not None and epoch_size < 1:
            raise ValueError(f"epoch_size must be None or >= 1; received {epoch_size}.")
        self.cfg = cfg
        self.p0 = groups_per_round
        self.prompts = prompts
        self.epoch_size = epoch_size
        self._queue: collections.deque[Prompt] = collections.deque()
        self._replay: collections.deque[Prompt] = collections.deque()  # drawn before the source
        self._drawn = 0  # fresh prompts drawn in the current epoch
        self._draining = False  # the epoch's fresh prompts are all drawn; the queue drains first
        self._exhausted = False  # the source raised StopIteration
        self._open: RoundPlan | None = None

    @property
    def long_queue(self) -> tuple[Prompt, ...]:
        return tuple(self._queue)

    @property
    def epoch_complete(self) -> bool:
        """Whether every prompt of the epoch drawn so far is trained (flush mode, between rounds)."""
        return self._open is None and self._draining and not self._queue

    def plan(self, round: int) -> RoundPlan:
        """Plans round `round`.

        Raises:
          StopIteration: the source is exhausted and the long queue is empty.
          RuntimeError: the previous plan was not finished.
        """
        if self._open is not None:
            raise RuntimeError(
                f"plan({round}) while round {self._open.round} is unfinished; call finish() first."
            )
        plan = self._plan(round)
        self._open = plan
        return plan

    def _plan(self, round: int) -> RoundPlan:
        p0 = self.p0
        if not self.cfg.enabled:
            fresh = self._draw(p0, bounded=False)
            if not fresh:
                raise StopIteration
            kind = "plain" if len(fresh) == p0 else "flush"
            return RoundPlan(round=round, kind=kind, prompts=tuple(fresh), target=len(fresh))
        if len(self._queue) >= p0:
            return self._long(round, p0)
        if not (self._draining or self._exhausted):
            bounded = self.cfg.epoch_end == "flush"
            fresh = self._draw(math.ceil(self.cfg.eta * p0), bounded=bounded)
            if len(fresh) >= p0:
                return RoundPlan(
                    round=round,
                    kind="short",
                    prompts=tuple(fresh),
                    target=p0,
                    response_eta=self.cfg.response_eta,
                )
            self._queue.extend(fresh)  # the epoch (or source) ends: drain what is left
            self._draining = True
            if len(self._queue) >= p0:
                return self._long(round, p0)
        if self._queue:
            return self._long(round, len(self._queue), kind="flush")
        if self._exhausted:
            raise StopIteration
        self._draining, self._drawn = False, 0  # the epoch is fully trained: the next one starts
        return self._plan(round)

    def _long(self, round: int, n: int, kind: str = "long") -> RoundPlan:
        taken: list[Prompt] = []
        skipped: list[Prompt] = []
        uids: set[int] = set()
        while self._queue and len(taken) < n:  # a round's uids are distinct
            p = self._queue.popleft()
            (skipped if p.uid in uids else taken).append(p)
            uids.add(p.uid)
        self._queue.extendleft(reversed(skipped))
        return RoundPlan(
            round=round,
            kind=kind,
            prompts=tuple(taken),
            target=len(taken),
            max_new_tokens=self.cfg.long_max_new_tokens or None,
            response_eta=self.cfg.response_eta,
        )

    def replay(self, prompts: Iterable[Prompt]) -> None:
        """Draws `prompts` again, first and in order, before the source's next ones: prompts a
        checkpoint recorded in flight (rl.schedules.asynchronous, keep_sampling). They were
        counted in the epoch when first drawn."""
        self._replay.extendleft(reversed(list(prompts)))

    def _draw(self, n: int, *, bounded: bool) -> list[Prompt]:
        out = [self._replay.popleft() for _ in range(min(n, len(self._replay)))]
        n -= len(out)
        if bounded and self.epoch_size is not None:
            n = min(n, self.epoch_size - self._drawn)
        replayed = len(out)
        for _ in range(n):
            try:
                out.append(next(self.prompts))
            except StopIteration:
                self._exhausted = True
                break
        self._drawn += len(out) - replayed
        return out

    def refill(self, plan: RoundPlan, n: int) -> RoundPlan:
        """Draws up to `n` more fresh prompts into the open plain round (dynamic sampling).

        Returns:
          The open plan with the new prompts appended (their Request.index continues the round's);
          it replaces `plan` (pass it to `finish`). Fewer than `n` are drawn if the source ends.

        Raises:
          ValueError: `plan` is not the open plan, is not a plain round, or `n` < 1.
        """
        if plan is not self._open:
            raise ValueError(f"refill() got round {plan.round}, which is not the open plan.")
        if plan.kind != "plain" or self.cfg.enabled:
            raise ValueError(
                f"refill() of round {plan.round} ({plan.kind}); expected a plain round (dynamic "
                "sampling does not combine with tail batching)."
            )
        if n < 1:
            raise ValueError(f"refill() needs n >= 1 prompts; received {n}.")
        fresh = self._draw(n, bounded=False)
        self._open = dataclasses.replace(plan, prompts=plan.prompts + tuple(fresh))
        return self._open

    def finish(
        self,
        plan: RoundPlan,
        trained_uids: Iterable[int],
        discarded_uids: Iterable[int] = (),
    ) -> list[Prompt]:
        """Records which of `plan`'s prompts were trained; the others join the long queue.

        Args:
          plan: the open plan.
          trained_uids: the prompts trained, exactly `plan.target` of them unless some were
            discarded.
          discarded_uids: prompts sampled but not trained because their group carried no signal
            (dynamic sampling); they are consumed, not queued. With them, every prompt of the plan
            is trained or discarded and at most `plan.target` are trained (fewer when the
            round's oversampling budget ran out).

        Returns:
          The prompts moved to the long queue, in logical order.

        Raises:
          ValueError: `plan` is not the open plan, a uid is not one of its prompts or repeats, or
            the number trained differs from `plan.target` (without discarded prompts).
        """
        if plan is not self._open:
            raise ValueError(f"finish() got round {plan.round}, which is not the open plan.")
        trained = list(trained_uids)
        discarded = list(discarded_uids)
        planned = {p.uid for p in plan.prompts}
        unknown = [u for u in trained + discarded if u not in planned]
        if unknown or len(set(trained + discarded)) != len(trained) + len(discarded):
            raise ValueError(
                f"Round {plan.round}: trained and discarded uids must be distinct uids of the "
                f"plan's prompts; received {len(trained)} + {len(discarded)} uids, unknown "
                f"{unknown[:8]}."
            )
        if not discarded and len(trained) != plan.target:
            raise ValueError(
                f"Round {plan.round} ({plan.kind}) trained {len(trained)} groups; expected exactly "
                f"{plan.target}."
            )
        if discarded and (
            len(trained) > plan.target or len(trained) + len(discarded) != len(plan.prompts)
        ):
            raise ValueError(
                f"Round {plan.round} ({plan.kind}) trained {len(trained)} and discarded "
                f"{len(discarded)} of {len(plan.prompts)} prompts; expected every prompt trained "
                f"or discarded and at most {plan.target} trained."
            )
        done = set(trained) | set(discarded)
        moved = [p for p in plan.prompts if p.uid not in done]
        self._queue.extend(moved)
        self._open = None
        bounded = self.cfg.enabled and self.cfg.epoch_end == "flush" and self.epoch_size
        if bounded and self._drawn >= self.epoch_size:
            self._draining = True  # the epoch's fresh prompts are all drawn
        return moved

    # ------------------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """The planner's state between rounds, JSON-serializable (the prompt source's is not in
        it: checkpoint that alongside, e.g. the grain iterator's get_state())."""
        if self._open is not None:
            raise RuntimeError(
                f"state_dict() while round {self._open.round} is unfinished; checkpoint between "
                "rounds."
            )
        state = {
            "queue": [prompt_to_json(p) for p in self._queue],
            "replay": [prompt_to_json(p) for p in self._replay],
            "drawn": self._drawn,
            "draining": self._draining,
            "exhausted": self._exhausted,
        }
        try:
            json.dumps(state)
        except TypeError as e:
            raise TypeError(
                f"The long-prompt queue holds a prompt whose meta is not JSON-serializable ({e}); "
                "expected str/int/float/bool/list/dict values."
            ) from None
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores `state_dict()`'s output (tuples in meta come back as lists)."""
        expected = {"queue", "replay", "drawn", "draining", "exhausted"}
        if isinstance(state, dict) and set(state) == expected - {"replay"}:
            state = {**state, "replay": []}  # a checkpoint from before replays existed
        if not isinstance(state, dict) or set(state) != expected:
            got = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise ValueError(
                f"RoundPlanner state must have keys {sorted(expected)}; received {got}."
            )
        self._queue = collections.deque(map(prompt_from_json, state["queue"]))
        self._replay = collections.deque(map(prompt_from_json, state["replay"]))
        self._drawn = int(state["drawn"])
        self._draining = bool(state["draining"])
        self._exhausted = bool(state["exhausted"])
        self._open = None
