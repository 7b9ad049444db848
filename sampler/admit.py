"""The loop's admission side: which waiting requests start now, and in which free slots.

The AdmissionPolicy (rl/admission.py) picks which waiting request comes next; this decides when.
Group-atomic (the default): a request is taken when its G slots are free and its G samples start
together. Per-sample (`group_atomic=False`, as slime/SGLang post each sample as its own request):
a request is taken as soon as one slot is free, whatever its group size, and its samples start one
by one as slots free up; the samples of requests already taken start before the policy is asked
again. Tokens are the same either way (a sample's random stream depends on its index, not its
slot); only when each sample starts changes. Callers hold the loop's lock.
"""

from __future__ import annotations

from collections.abc import Callable

from rl.admission import AdmissionPolicy
from rl.types import Request
from sampler.runs import Run, SlotTable
from sampler.stats import SamplerStats


def take(
    table: SlotTable,
    admission: AdmissionPolicy,
    free: int,
    *,
    group_atomic: bool,
    stats: SamplerStats,
) -> tuple[Run, list[int]] | None:
    """The run and the sample indices to start in `free` slots now, or None."""
    if free < 1:
        return None
    if not group_atomic:
        while table.partial and table.partial[0].aborted:  # aborted or emitted meanwhile
            table.partial.popleft()
        if table.partial:
            run = table.partial[0]
            i = run.slots.index(None)
            if None not in run.slots[i + 1 :]:
                table.partial.popleft()
            return run, [i]
    # per-sample: any free slot takes the policy's next request, whatever its group size
    fits = free if group_atomic else len(table.run)
    request = admission.next(fits)
    if request is None:
        return None
    run = Run.of(request)
    table.runs[request.key] = run
    stats.groups_admitted += 1
    if group_atomic:
        return run, list(range(request.group_size))
    if request.group_size > 1:
        table.partial.append(run)
    return run, [0]


def admit(
    table: SlotTable,
    admission: AdmissionPolicy,
    *,
    group_atomic: bool,
    stats: SamplerStats,
    budget: int | None = None,
    cost: Callable[[Request, int], int] | None = None,
) -> list[tuple[Run, list[int]]]:
    """Takes what fits into the free slots now, each sample assigned its slot; returns the
    (run, sample indices) started, for one batched prefill.

    With a paged engine, `budget` is the KV pages new sequences may take now and `cost(request,
    samples)` the pages a start takes: a run that does not fit is held (`table.held`) and goes
    first once it does, so the policy's order stands and nothing overtakes it."""
    admitted = []
    while True:
        free = table.free_slots()
        if table.held is not None and table.held[0].aborted:
            table.held = None
        taken = table.held or take(
            table, admission, len(free), group_atomic=group_atomic, stats=stats
        )
        if taken is None:
            return admitted
        run, samples = taken
        if len(samples) > len(free) or (
            budget is not None and (need := cost(run.request, len(samples))) > budget
        ):
            table.held = taken
            return admitted
        if budget is not None:
            budget -= need
        table.held = None
        for i, s in zip(samples, free, strict=False):
            table.assign(run, i, s)
        admitted.append((run, samples))
