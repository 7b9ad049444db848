"""The seed systems' headline figures on the simulator, in one run (`launch.simulate --papers`).

For each of the five systems the project implements (../shared/PAPERS.md), the paper's setting as
close as the GPU presets allow, our figure beside the paper's, and the baseline both are measured
against. Every figure comes from the same stage-time model (rl/sim/presets.py: Qwen3-1.7B on H100,
4 sampler replicas x tp 1 and a 4-GPU learner unless a row says otherwise) and the same
long-tailed workload family (rl/sim/workload.py), one seed, `rounds` rounds per run.

NAME                   metric (ours and the paper's)
rolloutpipe_cgp        rollout-to-train-end reduction of cgp+frontier vs sync (slime), a fraction,
                       at the paper's balance (sync's trainer waits 50% of its round)
pipelinerl_async       groups/s of bounded-staleness async vs sync, the long-tailed workload
rollpacker_tail        time per trained prompt, sync vs sync+tail (tail batching alone), on
                       RollPacker's workload at its balance (rollout 70% of a sync step)
bidirl_borrowing       groups/s with bidirectional borrowing vs the same static split, both under
                       bounded-staleness async (BiDiRL's setting)
jigsawrl_migration     groups/s with long-tail migration vs the same static split
jigsawrl_multiplexing  groups/s of 3 sync pipelines multiplexed on one pool vs the same pipelines
                       on a static partition of it (rl/sim/multiplex.py), rollout 70% of a step

`paper` is the paper's figure (the top of its reported range where it gives one); `setting` says
which of our runs the figure comes from and what differs from the paper's.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from rl.elastic.migration import MigrationConfig
from rl.elastic.stage import StageModel
from rl.round_planner import TailConfig
from rl.sim.bounds import overlap_bound
from rl.sim.compare import (
    balance_learner,
    compare_borrowing,
    compare_migration,
    run_modes,
)
from rl.sim.multiplex import compare_multiplexing
from rl.sim.simulator import SimResult
from rl.sim.workload import WorkloadConfig

ROLLPACKER_WORKLOAD = dict(median_tokens=500.0, max_new_tokens=16384)  # P75 ~910, max 16k
ASYNC_MODE = "async+frontier+s4+fill"
BORROW_MODE = "async+frontier+s4+fill"
BORROWINGS = ("off", "learner", "sampler", "both")
MIGRATION_MODE = "async+frontier+s4+fill"
MULTIPLEX_MODE = "sync"  # JigsawRL's baseline is veRL (sync)


@dataclasses.dataclass(frozen=True)
class Headline:
    """One system's figure: ours beside the paper's (None: not measurable yet)."""

    paper: float | None
    ours: float | None
    metric: str
    setting: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class PaperSetup:
    """The shape of the headline runs (launch.simulate --papers fills it from its flags)."""

    model: StageModel  # the sampler replicas' and the learner's stage-time model
    borrow_model: StageModel  # the same on BiDiRL's split (its learner on borrow_learner_gpus)
    replicas: int = 4
    slots: int = 256  # per replica: the H100 preset's (paged KV; the model's pool bounds it)
    borrow_sampler_gpus: int = 8  # BiDiRL's 32 GPUs, rollout-light (the sampler borrows)
    borrow_learner_gpus: int = 24
    rounds: int = 10
    seed: int = 0
    group_size: int = 8
    groups_per_update: int = 2  # RolloutPipe's U; async rows fill the engine instead
    groups_per_round: int = 64  # rolloutpipe_cgp, pipelinerl_async, jigsawrl_migration
    rollpacker_groups: int = 128
    borrow_groups: int = 256
    pipelines: int = 3  # jigsawrl_multiplexing

    def fields(self, groups_per_round: int, max_new_tokens: int = 8192) -> dict[str, Any]:
        return dict(
            groups_per_round=groups_per_round,
            groups_per_update=self.groups_per_update,
            group_size=self.group_size,
            max_new_tokens=max_new_tokens,
            replicas=self.replicas,
            slots=self.slots,
        )

    def workload(self, **overrides: Any) -> WorkloadConfig:
        return WorkloadConfig(seed=self.seed, **overrides)


def rolloutpipe_cgp(p: PaperSetup) -> Headline:
    workload, fields = p.workload(), p.fields(p.groups_per_round)
    model, scale = balance_learner(p.model, workload, target_wait=0.5, rounds=p.rounds, **fields)
    results: dict[str, SimResult] = {}
    rows = run_modes(
        ["sync", "cgp+frontier+fifo"],
        model,
        workload,
        rounds=p.rounds,
        on_result=results.__setitem__,
        **fields,
    )
    bound = 1 - overlap_bound(results["cgp+frontier+fifo"]) / rows["sync"]["rollout_to_train_end_s"]
    return Headline(
        paper=0.423,
        ours=rows["cgp+frontier+fifo"]["reduction_vs_sync"],
        metric="rollout-to-train-end reduction vs sync (paper: 30.7-42.3% vs slime)",
        setting=(
            f"cgp+frontier+fifo vs sync, R = {p.groups_per_round}, U = {p.groups_per_update}, "
            f"G = {p.group_size}; learner x{scale:.1f} so that sync's trainer waits 50% (slime's "
            f"47-52%); bound {bound:.1%}: a trainer taking each group the moment it arrives, at "
            "the mean learner time per group (rl.sim.bounds.overlap_bound)"
        ),
    )


def pipelinerl_async(p: PaperSetup, mode: str = ASYNC_MODE) -> Headline:
    workload, fields = p.workload(), p.fields(p.groups_per_round)
    rows = run_modes(["sync", mode], p.model, workload, rounds=p.rounds, **fields)
    row = rows[mode]
    return Headline(
        paper=2.0,
        ours=row["throughput_vs_sync"],
        metric="groups/s vs sync on the long-tailed workload (paper: ~2x faster learning than "
        "conventional RL)",
        setting=(
            f"{mode} (U = {row['groups_per_update']}: its staleness window keeps the "
            f"{p.replicas} x {p.slots} slots busy on the long tail) vs sync (U = {p.groups_per_update}), R = "
            f"{p.groups_per_round}, the roofline learner"
        ),
    )


def rollpacker_tail(p: PaperSetup) -> Headline:
    workload = p.workload(**ROLLPACKER_WORKLOAD)
    fields = p.fields(p.rollpacker_groups, max_new_tokens=ROLLPACKER_WORKLOAD["max_new_tokens"])
    fields["tail"] = TailConfig(eta=1.25)
    model, scale = balance_learner(p.model, workload, target_wait=0.7, rounds=p.rounds, **fields)
    rows = run_modes(["sync", "sync+tail"], model, workload, rounds=p.rounds, **fields)
    return Headline(
        paper=1.48,
        ours=rows["sync+tail"]["speedup_per_group_vs_sync"],
        metric="time per trained prompt, sync / sync+tail (paper: tail batching alone)",
        setting=(
            f"sync+tail (eta 1.25) vs sync on RollPacker's length statistics (median 500, cap "
            f"16k), R = {p.rollpacker_groups}; learner x{scale:.1f} so that rollout is 70% of a "
            "sync step"
        ),
    )


def bidirl_borrowing(p: PaperSetup, mode: str = BORROW_MODE) -> Headline:
    """BiDiRL under bounded staleness on its 32-GPU split, twice: with the preset's learner (the
    learner's 24 GPUs idle most of the time: the static split BiDiRL's baselines leave) and with
    the learner slowed until sync's trainer waits 50% (a split balanced for sync). Each beside
    its static split's pooling bound (rl.sim.bounds.pooling_bound: what any borrowing could
    gain there with free switches)."""
    workload = p.workload()
    fields = p.fields(p.borrow_groups) | dict(replicas=p.borrow_sampler_gpus)
    balanced, scale = balance_learner(
        p.borrow_model, workload, target_wait=0.5, rounds=p.rounds, **fields
    )
    runs = {}
    for name, model in (("preset", p.borrow_model), ("balanced", balanced)):
        rows = compare_borrowing(
            [mode],
            model,
            workload,
            rounds=p.rounds,
            learner_devices=p.borrow_learner_gpus,
            borrowings=BORROWINGS,
            **fields,
        )[mode]
        best = max(BORROWINGS[1:], key=lambda b: rows[b]["throughput_vs_static"])
        runs[name] = (best, rows[best]["throughput_vs_static"], rows["off"]["pooling_bound"])
    best, ours, bound = runs["preset"]
    b_best, b_ours, b_bound = runs["balanced"]
    return Headline(
        paper=1.94,
        ours=ours,
        metric="groups/s vs the same static split (paper: up to 1.94x vs veRL/AReaL/ROLL)",
        setting=(
            f"{mode} with borrowing={best} (the best of {', '.join(BORROWINGS[1:])}) on "
            f"{p.borrow_sampler_gpus} sampler / {p.borrow_learner_gpus} learner H100s, R = "
            f"{p.borrow_groups}, a 5 s switch, the preset's learner (bound {bound:.2f}x); with "
            f"the learner x{scale:.1f} so that sync waits 50%: {b_ours:.2f}x ({b_best}; bound "
            f"{b_bound:.2f}x: async already keeps the split's devices busy)"
        ),
    )


def jigsawrl_migration(p: PaperSetup, mode: str = MIGRATION_MODE) -> Headline:
    rows = compare_migration(
        [mode],
        p.model,
        p.workload(),
        MigrationConfig(policy="tail"),
        rounds=p.rounds,
        **p.fields(p.groups_per_round),
    )
    return Headline(
        paper=1.85,
        ours=rows[f"{mode}+migration"]["groups_per_s_vs_static"],
        metric="groups/s with long-tail migration vs the same static split (paper: up to 1.85x "
        "vs veRL, migration and multiplexing together)",
        setting=(
            f"{mode}, migration tail forced on vs requests routed round-robin (work stealing in "
            f"both), R = {p.groups_per_round}; a run leaves tail off: in one pipeline a freed "
            "replica has no work the others would not take (the consumer is multiplexing)"
        ),
    )


def jigsawrl_multiplexing(p: PaperSetup, mode: str = MULTIPLEX_MODE) -> Headline:
    """`p.pipelines` pipelines of `mode`, each on its own workload seed, at RollPacker's balance
    (rollout 70% of a sync step), multiplexed vs a static partition of the same pool."""
    fields = p.fields(p.groups_per_round)
    model, scale = balance_learner(
        p.model, p.workload(), target_wait=0.7, rounds=p.rounds, **fields
    )
    workloads = [WorkloadConfig(seed=p.seed + i) for i in range(p.pipelines)]
    row = compare_multiplexing(mode, model, workloads, rounds=p.rounds, **fields)
    return Headline(
        paper=1.85,
        ours=row["vs_static"],
        metric="groups/s of pipelines multiplexed on one pool vs a static partition of it (paper: "
        "up to 1.85x vs veRL)",
        setting=(
            f"{p.pipelines} {mode} pipelines (workload seeds {p.seed}..{p.seed + p.pipelines - 1}, "
            f"R = {p.groups_per_round}) on {p.replicas} replicas and one learner, tail migration "
            "on demand (idle replicas spread a dense rollout; one is recalled when a queue "
            f"waits); learner x{scale:.1f} so that rollout is 70% of a sync step; "
            f"{row['vs_back_to_back']:.2f}x vs back to back; bound {row['bound_vs_static']:.2f}x "
            "(the slowest pipeline alone, or the learner's total work without a gap)"
        ),
    )


def headlines(p: PaperSetup) -> dict[str, Headline]:
    """Every seed system's headline (NAMES order)."""
    return {
        "rolloutpipe_cgp": rolloutpipe_cgp(p),
        "pipelinerl_async": pipelinerl_async(p),
        "rollpacker_tail": rollpacker_tail(p),
        "bidirl_borrowing": bidirl_borrowing(p),
        "jigsawrl_migration": jigsawrl_migration(p),
        "jigsawrl_multiplexing": jigsawrl_multiplexing(p),
    }
