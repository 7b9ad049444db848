"""The simulated sampler's state: a replica's slots and the sequences in them (rl/sim/sampler.py
runs them on the virtual clock; rl/sim/migration.py moves them between replicas)."""

from __future__ import annotations

import dataclasses

from rl.admission import AdmissionPolicy
from rl.types import Completion, Request


@dataclasses.dataclass
class Seq:
    """One running sample: where it sits and when it ends (in the replica's calls)."""

    request: Request
    sample: int
    slot: int  # within the replica
    length: int  # response tokens it will produce
    admit_call: int  # the replica's call count when it started
    finish_call: int  # ... when it ends
    start: float
    base: int = 0  # tokens it had made on other replicas (migrated)


@dataclasses.dataclass
class Chunk:
    """A run of decode calls a replica makes without a boundary event in between."""

    start: float  # the first call's start
    calls: int
    slots: int  # active at the start
    context: float  # KV tokens held at the start
    factor: float  # contention slowdown


class Replica:
    """One engine replica: its slots, decode-call count and the bookkeeping of what runs."""

    def __init__(self, index: int, slots: int, admission: AdmissionPolicy):
        self.index, self.admission = index, admission
        self.seqs: list[Seq | None] = [None] * slots
        self.calls = 0
        self.heap: list[tuple[int, int, int]] = []  # (finish_call, id(seq), slot)
        self.prompt_sum = self.admit_sum = self.active = 0
        self.chunk: Chunk | None = None
        self.epoch = 0
        self.busy = False
        self.reserved: set[int] = set()  # slots promised to migrating sequences
        self.incoming: list[tuple[float, Pending, list[tuple[Seq, int, int]]]] = []
        self.fresh: set[tuple[int, int]] = set()  # adopted, no call run here yet: not movable
        self.busy_since = 0.0
        self.busy_s = 0.0  # total time busy (replica-seconds)
        self.parked = False  # serving another pipeline (rl/sim/multiplex.py): no slots here

    def free_slots(self) -> list[int]:
        if self.parked:
            return []
        return [i for i, s in enumerate(self.seqs) if s is None and i not in self.reserved]

    @property
    def vacant(self) -> bool:
        """Nothing runs, arrives or is planned here: the replica may serve another pipeline."""
        return not (self.busy or self.active or self.incoming or self.reserved or self.chunk)

    def context(self, k: int) -> float:
        return self.prompt_sum + k * (self.active * self.calls - self.admit_sum)

    def remove(self, seq: Seq) -> None:
        self.seqs[seq.slot] = None
        self.active -= 1
        self.prompt_sum -= len(seq.request.prompt)
        self.admit_sum -= seq.admit_call


@dataclasses.dataclass
class Pending:
    """A request being sampled: its group's finished samples and running sequences."""

    request: Request
    replica: int
    lengths: tuple[int, ...]
    done: dict[int, Completion] = dataclasses.field(default_factory=dict)
    seqs: list[Seq] = dataclasses.field(default_factory=list)
    version: int = 0  # the weights' version at admission
    resume: dict[int, int] = dataclasses.field(default_factory=dict)  # sample -> tokens made
