"""The blocks launch.simulate prints (its docstring says what each compares), from its settings.

Each block runs one comparison of rl/sim over the setups, records it under its key of the JSON
(`out`) and prints its table (rl/sim/tables.py) under a title naming the setting. `Settings` is
what the blocks read, built from the flags in one place (launch.simulate.settings).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from rl.device_split import Split, compare, format_table
from rl.elastic.migration import MigrationConfig
from rl.elastic.stage import StageModel
from rl.round_planner import TailConfig
from rl.sim import papers
from rl.sim.compare import (
    balance_learner,
    compare_borrowing,
    compare_checkpoints,
    compare_migration,
    run_modes,
    sim_config,
    validate,
)
from rl.sim.kv_layouts import compare_kv_layouts, format_kv_table
from rl.sim.multiplex import MultiplexResult, compare_multiplexing
from rl.sim.presets import gpu_preset
from rl.sim.simulator import SimResult
from rl.sim.tables import (
    format_borrowing,
    format_checkpoints,
    format_headlines,
    format_migration,
    format_modes,
    format_multiplexing,
    format_validation,
)
from rl.sim.workload import Workload, WorkloadConfig
from rl.sim.workload import summarize as summarize_lengths


@dataclasses.dataclass(frozen=True, kw_only=True)
class Settings:
    """What the blocks read; each field is the flag of the same name unless its comment says."""

    modes: tuple[str, ...]  # the comparison's modes; the first is the baseline
    setups: tuple[int, ...]  # groups per round (R) of each setup
    rounds: int  # simulated rounds per run
    preset: str  # the model of the GPU preset
    gpu: str  # h100 | h200
    sampler_gpus: int
    sampler_tp: int  # GPUs per sampler replica
    learner_gpus: int
    profile: str  # a launch.profile JSON whose model is used; "": the GPU preset's
    group_size: int  # G
    groups_per_update: int  # U
    eta: float  # tail batching: short rounds launch ceil(eta * R) prompts
    response_eta: float  # tail batching: launch ceil(response_eta * G) samples, keep G
    workload: WorkloadConfig  # --workload and the length flags (rollpacker: its median and cap)
    seed: int  # the workload's seed (--multiplex: of its first pipeline)
    balance_wait: float  # sync's wait ratio of the balanced blocks; 0: none
    validate: str  # a launch.bench_pipeline JSON to validate against; "": none
    plan_budgets: tuple[int, ...]  # device budgets of the split planner
    borrowing: tuple[str, ...]  # borrowing settings to compare
    borrow_modes: tuple[str, ...]
    switch_cost_s: float  # borrowing's switch cost (there and back)
    migration: MigrationConfig  # --migration and its thresholds (policy "off": no block)
    checkpoint_every: tuple[int, ...]  # intervals of the async checkpoint block
    multiplex: tuple[int, ...]  # pipeline counts of the multiplexing block, ascending
    multiplex_modes: tuple[str, ...]
    kv_layouts: tuple[str, ...]  # KV layouts compared at the same HBM
    kv_modes: tuple[str, ...]
    gantt_dir: str  # where simulated Gantt PNGs go; "": none

    @property
    def replicas(self) -> int:
        """Sampler replicas of the GPU preset: --sampler_gpus / --sampler_tp."""
        return self.sampler_gpus // self.sampler_tp

    @property
    def mode_replicas(self) -> int:
        """Replicas of the mode, migration and checkpoint blocks: one with --profile (its model is
        the profiled machine's one engine), else `replicas`."""
        return 1 if self.profile else self.replicas


def setup_fields(
    s: Settings, groups_per_round: int, replicas: int, slots: int, *, tail: bool = True
) -> dict[str, Any]:
    """The SimConfig fields of one setup (R groups per round) from the settings; `tail`: with the
    tail-batching settings (--eta, --response_eta)."""
    fields = dict(
        groups_per_round=groups_per_round,
        groups_per_update=s.groups_per_update,
        group_size=s.group_size,
        max_new_tokens=s.workload.max_new_tokens,
        replicas=replicas,
        slots=slots,
    )
    if tail:
        fields["tail"] = TailConfig(eta=s.eta, response_eta=s.response_eta)
    return fields


def balanced(
    s: Settings, model: StageModel, balance: float, fields: dict[str, Any]
) -> tuple[StageModel, float]:
    """(model, its learner's scale): scaled so that sync waits `balance` of its round (0: as is)."""
    if not balance:
        return model, 1.0
    return balance_learner(model, s.workload, target_wait=balance, rounds=s.rounds, **fields)


def balance_blocks(label: str, balanced_label: str, balance: float) -> list[tuple[str, float]]:
    """A block's runs: (label, 0) on the model as is, then (balanced_label, balance) unless 0."""
    return [(label, 0.0)] + [(balanced_label, balance)] * bool(balance)


def balance_note(scale: float, balance: float) -> str:
    """A balanced run's title note ("" for the model as is)."""
    return f", learner x{scale:.1f} for sync wait {balance:.0%}" if balance else ""


def gantt_path(s: Settings, stem: str) -> str:
    """`stem`.png in --gantt_dir, which this creates."""
    os.makedirs(s.gantt_dir, exist_ok=True)
    return os.path.join(s.gantt_dir, f"{stem}.png")


def comparison(s: Settings, model: StageModel, slots: int, out: dict[str, Any]) -> None:
    replicas = s.mode_replicas
    print(
        f"stage model: {model.source}; {replicas} replica(s) x {slots} slots; workload "
        f"{s.workload}; {s.rounds} rounds per mode"
    )
    lengths = Workload(s.workload).sample_lengths(s.group_size, prompts=2000)
    stats = summarize_lengths(lengths)
    print(
        "  response lengths (2,000 prompts): " + ", ".join(f"{k} {v:.0f}" for k, v in stats.items())
    )
    out["workload"] = s.workload.__dict__ | {"fixed_lengths": None, "length_stats": stats}
    out["stage_model"], out["replicas"], out["slots"] = model.to_dict(), replicas, slots
    for label, balance in balance_blocks("setups", "paper_balance", s.balance_wait):
        out[label] = {}
        for r in s.setups:
            fields = setup_fields(s, r, replicas, slots)
            mdl, scale = balanced(s, model, balance, fields)

            def gantt(name: str, result: SimResult, r: int = r, label: str = label) -> None:
                if s.gantt_dir and r == s.setups[0] and label == "setups":
                    path = gantt_path(s, f"sim_R{r}_{name.replace('+', '_')}")
                    result.timeline.write_gantt_png(path, title=f"simulated {name}, R={r}")

            rows = run_modes(s.modes, mdl, s.workload, rounds=s.rounds, on_result=gantt, **fields)
            out[label][f"R{r}"] = dict(modes=rows, learner_scale=scale)
            print(
                f"{label} R={r} (G={s.group_size}, U={s.groups_per_update} unless a row says"
                + balance_note(scale, balance)
                + ")"
            )
            print(format_modes(rows))


def validation(s: Settings, model: StageModel, out: dict[str, Any]) -> None:
    with open(s.validate, encoding="utf-8") as f:
        real = json.load(f)
    rows = validate(real, model)
    out["validation"] = dict(real=s.validate, profile=s.profile, modes=rows)
    print(
        f"validation: {s.validate} (real) vs the simulator with {model.source} "
        f"(contention {model.contention:.2f}); means over the timed rounds"
    )
    print(format_validation(rows))


def migration_block(s: Settings, model: StageModel, slots: int, out: dict[str, Any]) -> None:
    replicas, mig = s.mode_replicas, s.migration
    out["migration"] = {"config": mig.__dict__, "replicas": replicas}
    for r in s.setups:
        fields = setup_fields(s, r, replicas, slots)
        rows = compare_migration(s.modes, model, s.workload, mig, rounds=s.rounds, **fields)
        out["migration"][f"R{r}"] = rows
        print(
            f"migration ({mig.policy}, {replicas} replicas x {slots} slots, round-robin routing) "
            f"R={r}:"
        )
        print(format_migration(rows))


def planning(s: Settings, out: dict[str, Any]) -> None:
    out["plan"] = {}
    for budget in s.plan_budgets:
        cfg = sim_config(
            "cgp+frontier+fifo",
            groups_per_round=s.setups[0],
            groups_per_update=s.groups_per_update,
            group_size=s.group_size,
            max_new_tokens=s.workload.max_new_tokens,
        )

        def make(split: Split) -> Any:
            return gpu_preset(s.preset, s.gpu, sampler_tp=split.tp, learner_gpus=split.learner_gpus)

        choice, rows = compare(budget, make, cfg, Workload(s.workload), rounds=3, tps=(1, 2))
        print(f"planner, {budget} x {s.gpu}, {cfg.name}, R={cfg.groups_per_round}:")
        print(format_table(choice, rows))
        out["plan"][str(budget)] = dict(
            choice=str(choice),
            rows=[
                dict(split=str(r.split), predicted_s=r.predicted_s, simulated_s=r.simulated_s)
                for r in rows
            ],
        )


def borrowing(s: Settings, model: StageModel, slots: int, out: dict[str, Any]) -> None:
    replicas = s.replicas
    print(
        f"borrowing vs static split: {s.sampler_gpus} sampler GPUs ({replicas}x tp"
        f"{s.sampler_tp}, {slots} slots) / {s.learner_gpus} learner GPUs, switch cost "
        f"{s.switch_cost_s:g} s; BiDiRL reports up to 1.94x, JigsawRL up to 1.85x"
    )
    # "<setting>+migration" runs the policy of --migration, or tail when that is off
    mig = s.migration
    if mig.policy == "off":
        mig = dataclasses.replace(mig, policy="tail")
    for label, balance in balance_blocks("borrowing", "borrowing_balanced", s.balance_wait):
        out[label] = {}
        for r in s.setups:
            fields = setup_fields(s, r, replicas, slots, tail=False)
            mdl, scale = balanced(s, model, balance, fields)
            rows = compare_borrowing(
                s.borrow_modes,
                mdl,
                s.workload,
                rounds=s.rounds,
                learner_devices=s.learner_gpus,
                replica_devices=s.sampler_tp,
                borrowings=s.borrowing,
                switch_cost_s=s.switch_cost_s,
                migration=mig,
                **fields,
            )
            out[label][f"R{r}"] = rows
            print(f"  R={r}{balance_note(scale, balance)}:")
            print(format_borrowing(rows))


def checkpoint_barriers(s: Settings, model: StageModel, slots: int, out: dict[str, Any]) -> None:
    """Async checkpoints every k rounds: "exact" drains the pipeline (a barrier), "no_bubble" holds
    only the learner (config.async_resume); groups/s of each vs no checkpoint."""
    replicas = s.mode_replicas
    modes = [m for m in s.modes if m.startswith("async")]
    print(
        f"\nasync checkpoints (groups/s; vs no checkpoint; G={s.group_size}, "
        f"U={s.groups_per_update}, {s.rounds} rounds; the save itself is not modelled):"
    )
    rows = {
        r: compare_checkpoints(
            modes,
            model,
            s.workload,
            s.checkpoint_every,
            rounds=s.rounds,
            **setup_fields(s, r, replicas, slots),
        )
        for r in s.setups
    }
    out["checkpoint_barriers"] = {f"R{r}": by_mode for r, by_mode in rows.items()}
    print(format_checkpoints(rows, s.checkpoint_every))


def multiplexing(s: Settings, model: StageModel, slots: int, out: dict[str, Any]) -> None:
    replicas = s.replicas
    out["multiplexing"] = {}
    for r in s.setups:
        fields = setup_fields(s, r, replicas, slots, tail=False)
        scaled, scale = balanced(s, model, s.balance_wait, fields)
        note = (
            f"learner x{scale:.1f} (sync waits {s.balance_wait:.0%})"
            if s.balance_wait
            else "the preset's learner"
        )
        print(f"multiplexing, {replicas} replicas x {slots} slots and one learner, R={r}, {note}:")
        rows: dict[str, dict[int, dict[str, Any]]] = {}
        for mode in s.multiplex_modes:
            rows[mode] = {}
            for n in s.multiplex:
                workloads = [dataclasses.replace(s.workload, seed=s.seed + i) for i in range(n)]
                gantt = None
                if s.gantt_dir:
                    path = gantt_path(s, f"multiplex_R{r}_{mode}_{n}")
                    title = f"{n} x {mode} multiplexed, R={r}"

                    def gantt(res: MultiplexResult, path: str = path, title: str = title) -> None:
                        res.write_gantt_png(path, title)

                row = compare_multiplexing(
                    mode, scaled, workloads, rounds=s.rounds, on_result=gantt, **fields
                )
                out["multiplexing"][f"R{r}/{mode}/{n}"] = rows[mode][n] = row
        print(format_multiplexing(rows))


def kv_layouts(s: Settings, out: dict[str, Any]) -> None:
    replicas = s.replicas
    out["kv_layouts"] = {}
    for r in s.setups:
        fields = setup_fields(s, r, replicas, 0, tail=False)
        del fields["slots"]  # each layout sizes its own
        rows = compare_kv_layouts(
            s.kv_layouts,
            s.kv_modes,
            s.workload,
            rounds=s.rounds,
            model=s.preset,
            gpu=s.gpu,
            sampler_tp=s.sampler_tp,
            learner_gpus=s.learner_gpus,
            **fields,
        )
        out["kv_layouts"][f"R{r}"] = rows
        print(
            f"KV layouts at the same HBM: {s.preset} on {replicas} x {s.gpu} (tp "
            f"{s.sampler_tp}), cap {s.workload.max_new_tokens}, R={r}, G={s.group_size}, "
            f"{s.rounds} rounds:"
        )
        print(format_kv_table(rows))


def paper_headlines(s: Settings, model: StageModel, slots: int, out: dict[str, Any]) -> None:
    borrow = gpu_preset(s.preset, s.gpu, learner_gpus=papers.PaperSetup.borrow_learner_gpus)
    setup = papers.PaperSetup(
        model=model,
        borrow_model=borrow.model,
        replicas=s.replicas,
        slots=slots,
        rounds=s.rounds,
        seed=s.seed,
    )
    rows = papers.headlines(setup)
    out["papers"] = {name: dataclasses.asdict(h) for name, h in rows.items()}
    print(
        f"seed systems' headlines: {model.source}, {setup.replicas} x {slots} slots, "
        f"{s.rounds} rounds per run, workload seed {s.seed}"
    )
    print(format_headlines(rows))
