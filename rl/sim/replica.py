"""The simulated sampler's state: a replica's slots and the sequences in them (rl/sim/sampler.py
runs them on the virtual clock; rl/sim/migration.py moves them between replicas; rl/sim/paging.py
keeps their KV pages)."""

from __future__ import annotations

import dataclasses
import heapq
import itertools

from rl.admission import AdmissionPolicy
from rl.types import Completion, Request

_SERIALS = itertools.count()


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
    base: int = 0  # tokens it had made on other replicas (migrated) or before a swap
    order: int = 0  # when its request was first admitted (paging: the youngest is preempted first)
    # this object's number, in creation order: the finish heap breaks ties by it (deterministic,
    # unlike a memory address), and a copy (dataclasses.replace) gets a number of its own
    serial: int = dataclasses.field(init=False, default_factory=lambda: next(_SERIALS))


@dataclasses.dataclass
class Chunk:
    """A run of decode calls a replica makes without a boundary event in between."""

    start: float  # the first call's start
    calls: int
    slots: int  # active at the start
    context: float  # KV tokens held at the start
    factor: float  # contention slowdown


def pages(tokens: int, page: int) -> int:
    """Pages of `page` positions that `tokens` positions span (0 when not paged)."""
    return -(-tokens // page) if page else 0


class Replica:
    """One engine replica: its slots, decode-call count and the bookkeeping of what runs."""

    def __init__(self, index: int, slots: int, admission: AdmissionPolicy, page: int = 0):
        self.index, self.admission, self.page = index, admission, page
        self.seqs: list[Seq | None] = [None] * slots
        self.calls = 0
        self.heap: list[tuple[int, int, int]] = []  # (finish_call, seq.serial, slot)
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
        self.leaving = False  # recalled by the pool: admits nothing, its migration empties it
        # paged KV (rl/sim/paging.py; page > 0): running samples per group, the prompt pages of
        # the groups that have one here, and the preempted sequences with the tokens they made
        self.groups: dict[tuple[int, int], int] = {}
        self.prompt_pages = 0
        self.swapped: dict[int, tuple[Seq, int]] = {}  # seq.serial -> (seq, made)

    def free_slots(self) -> list[int]:
        if self.parked or self.leaving:
            return []
        return [i for i, s in enumerate(self.seqs) if s is None and i not in self.reserved]

    @property
    def vacant(self) -> bool:
        """Nothing runs, arrives or is planned here: the replica may serve another pipeline."""
        return not (
            self.busy or self.active or self.incoming or self.reserved or self.chunk or self.swapped
        )

    def context(self, k: int) -> float:
        return self.prompt_sum + k * (self.active * self.calls - self.admit_sum)

    def add(self, seq: Seq) -> None:
        """Puts `seq` in its slot; it runs from its admit_call."""
        self.seqs[seq.slot] = seq
        heapq.heappush(self.heap, (seq.finish_call, seq.serial, seq.slot))
        self.active += 1
        self.prompt_sum += len(seq.request.prompt)
        self.admit_sum += seq.admit_call
        key = seq.request.key
        self.groups[key] = self.groups.get(key, 0) + 1
        if self.groups[key] == 1:
            self.prompt_pages += pages(len(seq.request.prompt), self.page)

    def remove(self, seq: Seq) -> None:
        self.seqs[seq.slot] = None
        self.active -= 1
        self.prompt_sum -= len(seq.request.prompt)
        self.admit_sum -= seq.admit_call
        key = seq.request.key
        self.groups[key] -= 1
        if not self.groups[key]:
            del self.groups[key]
            self.prompt_pages -= pages(len(seq.request.prompt), self.page)


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
