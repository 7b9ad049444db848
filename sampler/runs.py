"""The sampler loop's bookkeeping: each admitted request's run, and which slot holds which sample.

A Run is one request from admission until its group is emitted or aborted: its samples' tokens so
far, the slot each started in, the finished samples with their rewards' Futures. A SlotTable maps
the engine's slots to (run, sample) and keeps what waits for the next step boundary (slots to free,
slots promised to an adoption, adopted state to import). Nothing here locks: the SamplerLoop
(sampler/loop.py) holds its lock around every change.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
from typing import Any

from rl.types import Completion, Group, Request
from sampler.slot_export import SlotState


@dataclasses.dataclass
class Sample:
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    start: float = 0.0  # when it entered its slot
    base: int = 0  # tokens it had when it entered this slot (> 0 after a migration)
    # multi-turn (sampler/episodes.py): which tokens the environment wrote, each turn's reward,
    # and whether its cached KV predates a weight swap it waited through (recompute_kv)
    observed: list[bool] = dataclasses.field(default_factory=list)
    turn_rewards: list[float] = dataclasses.field(default_factory=list)
    stale: bool = False


@dataclasses.dataclass
class Run:
    request: Request
    slots: list[int | None]  # sample i's (last) slot; None: not started yet (per-sample admission)
    samples: list[Sample]
    # finished samples, each with its reward's Future
    done: dict[int, tuple[Completion, concurrent.futures.Future]] = dataclasses.field(
        default_factory=dict
    )
    aborted: bool = False  # aborted, or its group is already emitted
    waiting: set[int] = dataclasses.field(default_factory=set)  # samples between turns

    @classmethod
    def of(cls, request: Request) -> Run:
        """A run of `request` with no sample started."""
        g = request.group_size
        return cls(request=request, slots=[None] * g, samples=[Sample() for _ in range(g)])

    def completion(self, i: int) -> Completion:
        """Sample i as a Completion (its reward still 0)."""
        r, sample = self.request, self.samples[i]
        stop = bool(sample.tokens) and sample.tokens[-1] in r.params.stop_token_ids
        multi_turn = bool(sample.turn_rewards)
        return Completion(
            uid=r.uid,
            round=r.round,
            sample=i,
            prompt=r.prompt,
            tokens=tuple(sample.tokens),
            logprobs=tuple(sample.logprobs),
            versions=tuple(sample.versions),
            finish_reason="stop" if stop else "length",
            observation_mask=tuple(sample.observed) if any(sample.observed) else (),
            turn_rewards=tuple(sample.turn_rewards) if multi_turn else (),
        )


@dataclasses.dataclass(frozen=True)
class Complete:
    """A complete group whose rewards may still be running: emitted once they are all in."""

    request: Request
    done: tuple[tuple[Completion, concurrent.futures.Future], ...]

    def ready(self) -> bool:
        return all(f.done() for _, f in self.done)

    def group(self) -> Group:
        """The Group (waits for the rewards; a reward runner's failure is raised here)."""
        return Group(
            request=self.request,
            completions=tuple(
                dataclasses.replace(c, reward=float(f.result())) for c, f in self.done
            ),
        )


class SlotTable:
    """Which run and sample each of `n` slots holds, and the runs admitted and not yet done."""

    def __init__(self, n: int):
        self.run: list[Run | None] = [None] * n  # slot -> its run; None: free
        self.sample = [0] * n  # slot -> the sample index it holds
        self.runs: dict[tuple[int, int], Run] = {}  # by request key, until emitted or aborted
        self.partial: collections.deque[Run] = collections.deque()  # runs with unstarted samples
        self.to_free: list[int] = []  # released slots, freed in the engine at the next step
        self.ended: list[int] = []  # slots whose sequence ended on the engine (pages go back)
        self.reserved: set[int] = set()  # free slots promised to an adoption
        self.imports: list[tuple[list[int], SlotState]] = []  # adopted, imported at the next step
        self.unmovable: set[tuple[int, int]] = set()  # adopted runs not decoded here yet
        self.held: tuple[Run, list[int]] | None = None  # taken, waiting for KV pages (admit.py)

    def free_slots(self) -> list[int]:
        """Slots that can take a sample now (a slot released since the last step is freed at the
        next one; a reserved slot waits for its adoption)."""
        return [
            s
            for s, r in enumerate(self.run)
            if r is None and s not in self.reserved and s not in self.to_free
        ]

    def busy(self) -> int:
        return sum(r is not None for r in self.run)

    def holding(self, run: Run) -> list[int]:
        """The slots `run` holds now."""
        return [s for s, r in enumerate(self.run) if r is run]

    def running(self) -> list[tuple[int, Run, int]]:
        """(slot, run, sample index) of every occupied slot."""
        return [(s, run, self.sample[s]) for s, run in enumerate(self.run) if run is not None]

    def assign(self, run: Run, i: int, slot: int) -> None:
        """Sample i of `run` starts in `slot`."""
        run.slots[i] = slot
        self.run[slot], self.sample[slot] = run, i

    def release(self, run: Run) -> None:
        """Frees the slots `run` still holds (before the next decode step)."""
        for s in self.holding(run):
            self.run[s] = None
            self.to_free.append(s)


def slot_span(timeline: Any, slot: int, run: Run, i: int, end: float, **extra: Any) -> None:
    """Sample i of `run`'s time in `slot`, up to `end`, on `timeline` (rl.timeline), if any."""
    if timeline is None:
        return
    r, sample = run.request, run.samples[i]
    timeline.span(
        f"sampler/slot{slot}",
        f"{r.uid}/{i}",
        sample.start,
        end,
        round=r.round,
        uid=r.uid,
        sample=i,
        tokens=len(sample.tokens) - sample.base,
        **extra,
    )
