"""The loop's migration endpoints: what a migration policy sees, and requests moved out and in.

JigsawRL migration (rl/elastic/migration.py decides what moves): at a step boundary the source
loop's `handoff` takes a running request out, with its samples' decode state
(Engine.export_slots), as a Handoff; the destination loop `reserve`s free slots for it and `adopt`s
it, and imports the state before its next decode step, where the request's group then completes.
sampler/transfer.py carries a Handoff between processes.

A replica taken back mid-rollout (async borrowing) gives up everything at once: `evict` empties
its table (each run's samples out of their slots, tokens kept), another loop parks the runs and
`place`s each, whole, into free slots, to be re-prefilled with its prompt and tokens so far
(Engine.reprefill) instead of importing state. The functions here are the bookkeeping on a loop's
SlotTable (callers hold the loop's lock); SamplerLoop runs the engine calls.
"""

from __future__ import annotations

import collections
import dataclasses

from rl.admission import AdmissionPolicy
from rl.elastic.migration import ReplicaView, RunningView
from rl.types import Request
from sampler.paged import PagePool
from sampler.runs import Run, SlotTable
from sampler.slot_export import SlotState


@dataclasses.dataclass(frozen=True)
class Handoff:
    """A request's running samples taken out of one loop (`handoff`) for another (`adopt`).

    Attributes:
      run: the request's bookkeeping (tokens, log-probs and versions so far, finished samples
        with their rewards in flight).
      samples: the sample indices that were running, in the order of `state`'s rows.
      state: their decode state (Engine.export_slots), on the source's devices.
    """

    run: Run
    samples: tuple[int, ...]
    state: SlotState


def movable(table: SlotTable, run: Run) -> bool:
    """A run can move: not done, every sample started, decoded here since it came, none between
    turns (waiting for its environment)."""
    return (
        not run.aborted
        and not run.waiting
        and None not in run.slots
        and run.request.key not in table.unmovable
        and run.request.key in table.runs
    )


def view(table: SlotTable, *, queued: bool, pool: PagePool | None = None) -> ReplicaView:
    """The loop as a migration policy sees it: its running requests, free slots, queue; with a
    paged engine's `pool`, the pages a move may fill (free, less what its swapped-out sequences
    and the adoptions not yet imported will take) and each request's KV in pages (its live
    positions, as import_slots takes them). The pool is the engine's, changed on the loop's
    thread: a snapshot, and a destination that turns out short swaps its youngest sequences out,
    losing nothing. An adoption reserved and not yet taken in (Ray) is not counted."""
    count: dict[int, int] = {}
    runs: dict[int, Run] = {}
    left: dict[int, int] = {}
    pages: dict[int, int] = {}
    live = lambda run, i: len(run.request.prompt) + len(run.samples[i].tokens)
    for _, run, i in table.running():
        count[id(run)] = count.get(id(run), 0) + 1
        runs[id(run)] = run
        rest = run.request.params.max_new_tokens - len(run.samples[i].tokens)
        left[id(run)] = max(left.get(id(run), 0), rest)
        if pool is not None:
            pages[id(run)] = pages.get(id(run), 0) + pool.pages_for(live(run, i))
    running = tuple(
        RunningView(
            key=run.request.key,
            sequences=count[i],
            tokens_left=left[i],
            movable=movable(table, run),
            kv_pages=pages.get(i, 0),
        )
        for i, run in runs.items()
    )
    out = ReplicaView(
        slots=len(table.run), free=len(table.free_slots()), queued=queued, running=running
    )
    if pool is None:  # dense: the slots alone limit
        return out
    arriving = sum(
        pool.pages_for(live(run, table.sample[s]))
        for slots, _ in table.imports
        for s in slots
        if (run := table.run[s]) is not None
    )
    owed = sum(pool.pages_for(x.written + 1) for x in list(pool.swapped.values()))
    free = min(pool.pages, max(0, pool.free - owed - arriving))
    return dataclasses.replace(out, pages=pool.pages, free_pages=free, page=pool.page)


def reserve(table: SlotTable, n: int) -> list[int] | None:
    """Promises n free slots to an adoption; None if fewer are free now."""
    free = table.free_slots()
    if n < 1 or len(free) < n:
        return None
    table.reserved.update(free[:n])
    return free[:n]


def take_out(
    table: SlotTable, key: tuple[int, int]
) -> tuple[Run, list[int], tuple[int, ...]] | None:
    """Removes request `key`'s run and empties its slots (the caller exports and frees them in the
    engine); returns the run, its slots and the samples in them, or None when it no longer runs
    here."""
    run = table.runs.get(key)
    if run is None:
        return None
    if not movable(table, run):
        raise ValueError(
            f"handoff: request {key} is not a movable running request here; expected "
            "one with every sample started and decoded here since it came."
        )
    slots = table.holding(run)
    samples = tuple(table.sample[s] for s in slots)
    del table.runs[key]
    for s in slots:
        table.run[s] = None
    return run, slots, samples


def check_reserved(table: SlotTable, slots: list[int]) -> None:
    if not set(slots) <= table.reserved:
        raise ValueError(f"adopt: slots {slots} were not reserved here.")


def take_in(table: SlotTable, handoff: Handoff, slots: list[int], now: float) -> None:
    """Puts a handed-off run into its reserved `slots`; its state is imported at the next step
    (`imports`), and it cannot move again before it has decoded here (`decoded`)."""
    run = handoff.run
    for s, i in zip(slots, handoff.samples, strict=True):
        table.assign(run, i, s)
        run.samples[i].start, run.samples[i].base = now, len(run.samples[i].tokens)
    table.reserved.difference_update(slots)
    table.runs[run.request.key] = run
    table.unmovable.add(run.request.key)
    table.imports.append((list(slots), handoff.state))


def imports(table: SlotTable) -> list[tuple[list[int], SlotState]]:
    """Takes the adopted state to import now (an adoption aborted before its import has its
    slots released already: nothing to import)."""
    out = [
        (slots, moved)
        for slots, moved in table.imports
        if all(table.run[x] is not None for x in slots)
    ]
    table.imports = []
    return out


def decoded(table: SlotTable, imported: list[tuple[list[int], SlotState]]) -> None:
    """The runs of `imported` have decoded here once: movable again."""
    table.unmovable.difference_update(
        run.request.key for slots, _ in imported for s in slots if (run := table.run[s]) is not None
    )


def evict(
    table: SlotTable, admission: AdmissionPolicy, parked: collections.deque[Run]
) -> tuple[list[Request], list[Run], list[tuple[int, Run, int]]]:
    """Takes everything out of a stopped loop's table, admission and parked runs.

    Returns:
      (the requests waiting for admission; the runs admitted or parked and not done, every sample
      out of its slot with its tokens so far; the (slot, run, sample) that were running).
    """
    queued = []
    while (r := admission.next(1 << 30)) is not None:
        queued.append(r)
    running = table.running()
    runs = [run for run in [*table.runs.values(), *parked] if not run.aborted]
    for run in runs:
        run.slots = [None] * len(run.slots)
    parked.clear()
    return queued, runs, running


def place(
    table: SlotTable, parked: collections.deque[Run], now: float
) -> list[tuple[int, Request, int, tuple[int, ...]]]:
    """Parked runs into free slots, oldest first, each whole (all its unfinished samples);
    Engine.reprefill's (slot, request, sample, tokens so far) items."""
    items = []
    while parked:
        run = parked[0]
        if run.aborted:
            parked.popleft()
            continue
        need = [i for i in range(len(run.samples)) if i not in run.done]
        free = table.free_slots()
        if len(free) < len(need):
            break
        parked.popleft()
        table.runs[run.request.key] = run
        for i, slot in zip(need, free, strict=False):
            table.assign(run, i, slot)
            sample = run.samples[i]
            sample.start, sample.base = now, len(sample.tokens)
            items.append((slot, run.request, i, tuple(sample.tokens)))
    return items
