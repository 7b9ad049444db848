"""Scheduling simulator: sync vs cgp vs tail batching at paper scale, a device-split planner, and a
validation of the simulator against a real run.

    python -m launch.simulate --json /tmp/sim.json [--gpu h100 --sampler_gpus 4 --learner_gpus 4]
    python -m launch.simulate --profile /tmp/profile.json --validate /tmp/bench_pipeline.json
    python -m launch.simulate --plan_budgets 8,16,32
    python -m launch.simulate --papers --json /tmp/papers.json   # the seed headlines, ~80 s
    python -m launch.simulate --borrowing off,both,off+migration,both+migration \
        --sampler_gpus 8 --learner_gpus 24 --setups 256
    python -m launch.simulate --migration tail --modes sync,cgp+frontier+fifo,async+frontier+s1
    python -m launch.simulate --multiplex 2,3,4 --setups 64 --balance_wait 0.7
    python -m launch.simulate --kv_layouts dense,paged --setups 64   # the H100 preset, 8k cap
    python -m launch.simulate --workload rollpacker --modes sync,sync+tail,cgp+frontier+fifo,\
        cgp+frontier+tail --setups 64,128 --balance_wait 0.7

Comparison table (default): for each RolloutPipe setup (G = 8, U = 2, R in --setups) the modes
sync (slime-like: rollout all, then train), cgp+fcfs / cgp+frontier (complete-group pipelining,
batches in completion order as RolloutPipe), cgp+shuffled (requests reach the engine in a random
order, as slime's asynchronous submission; frontier is immune to it), sync+tail and
cgp+frontier+tail (RollPacker tail batching, eta --eta), and async (bounded staleness: a publish
after every update, the sampler up to s versions ahead): async+frontier+s1 at U = 2, whose window
of (s + 1) x U = 4 groups (32 sequences) cannot fill the sampler's slots (4 x 256 on the H100
preset), so it runs a fraction of the engine and looks several times slower than sync; then
async+frontier+s1+fill and s4+fill, where each row's U is the smallest divisor of R whose window
keeps every slot busy on the workload's long tail, (s + 1) x U x G >= slots x cap / mean response
(rl.schedules.asynchronous.fill_groups_per_update; U = R = 64 at R = 64 on the H100 preset: AReaL
and PipelineRL train batches of hundreds of sequences per update for the same reason), and
async+shuffled+s4+fill (FCFS over requests arriving in a random order, where frontier differs).
Simulated with rl/sim on the stage-time
model of --preset on --gpu (rl/sim/presets.py; or --profile's fitted model) and a long-tailed
workload (rl/sim/workload.py). Every mode runs --rounds rounds of the same prompt stream; the
figures are means over rounds. A second block ("paper balance") scales the learner so that sync's
trainer waiting ratio is 50%, the balance RolloutPipe reports for slime (47-52%), and compares again.
`--workload rollpacker` draws RollPacker's length statistics instead (median 500 tokens per median
prompt, which gives P75 ~910 tokens, inside the paper's 755-1.1k, and a 16k cap that runaway
prompts reach); `--balance_wait 0.7` then matches its balance (rollout ~70% of a sync step). The
table's s/group (rollout-to-train-end per trained group) and groups/s (throughput) columns, with
their ratios to sync, are RollPacker's per-prompt measure; its tail-batching-alone figure is 1.48x.
The JSON holds, per setup and mode, rollout_to_train_end_s, first_dispatch_s, trainer_wait_ratio,
reduction_vs_sync (1 - r2t / sync's), time_per_group_s, groups_per_s and throughput_vs_sync,
lag_mean and lag_max.

--validate PATH reads launch.bench_pipeline's JSON and simulates its workload (the same lengths per
prompt, the same epoch, R, U, G, slots, steps per call) with --profile's model: per mode the real
and simulated figures and the error, cgp also without the contention term.

--migration tail (or always) adds a JigsawRL block: per setup and mode, the replicas' static split
(requests routed round-robin at submission, as the runtimes do) against the same with long-tail
migration (rl/elastic/migration.py, thresholds --migration_fraction and --migration_min_left; a
move costs StageModel.migrate_s: the request's KV bytes over NVLink plus a fixed 10 ms in the GPU
presets): throughput (groups/s) and the sampler replica-seconds busy, each vs the static split.
`tail` is forced on here to measure what consolidating costs: in a run it stays off, since in one
pipeline the replicas it frees have no work the others would not take (rl/elastic/migration.py).

--papers prints only the seed systems' headline table (rl/sim/papers.py): for RolloutPipe,
PipelineRL, RollPacker, BiDiRL and JigsawRL, our figure at the paper's setting as close as the
presets allow, beside the paper's, with the baseline and the setting; --json writes
{"papers": {NAME: {"paper", "ours", "metric", "setting"}}}.

--multiplex 2,3,4 runs JigsawRL's pipeline multiplexing (rl/elastic/multiplex.py, carried out by
rl/sim/multiplex.py): for each setup, mode of --multiplex_modes and pipeline count N, N pipelines
of that mode (workload seeds --seed ... --seed + N - 1) back to back on the whole pool, on a static
partition (each on its share of the replicas and of the learner's devices), and multiplexed (every
replica and the learner shared, tail migration on): the wall times, the multiplexed run's ratio
to each, and the bound no multiplexing beats (the slowest pipeline alone on the pool, or the
learner's total work without a gap); with --balance_wait > 0 the learner is scaled first so that
sync waits that share of its round (0: the preset's learner).

--kv_layouts dense,paged compares the sampler's KV layouts at the same HBM (rl/sim/kv_layouts.py):
the preset sized with max_length (prompt_max + the cap) reserved per slot vs a paged pool
(rl/sim/paging.py), each mode of --kv_modes on each, per setup: sequences in flight (mean, peak),
preemptions, swap seconds, round time, groups/s and tokens/s, and each layout's groups/s over the
first's.

--plan_budgets runs rl/device_split.py on each budget: the planner's split beside every split's simulated
time per round.

--borrowing compares BiDiRL's bidirectional borrowing (rl/elastic/borrowing.py, carried out by
rl/sim/borrow.py) with the static split: for each setup, sync, cgp+frontier+fifo and
async+frontier+s4+fill (--borrow_modes) with each setting (off = static split; learner: the
learner trains on the sampler's devices once the rollout drains; sampler: the learner's devices
decode as extra replicas while the learner waits, under async until its next batch is complete,
when they are taken back mid-rollout and what ran there resumes on the other replicas,
re-prefilled with the tokens it made; both; each also as "<setting>+migration" with JigsawRL's
long-tail migration, policy --migration or tail, so "off+migration" is migration alone), the
throughput (groups/s), its ratio to the static split, the moves made and the static split's
pooling bound (its device-seconds over those its devices worked: what borrowing could gain at
most), against BiDiRL's up-to-1.94x (and JigsawRL's up-to-1.85x); with --balance_wait > 0 again
with the learner scaled so that sync waits that share of its round ("borrowing_balanced"). The
switch cost is --switch_cost_s (BiDiRL measures seconds; weighed by the policy and charged by the
simulator); the sampler side predicts from the workload's true lengths (an oracle the runtime
lacks).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from absl import app, flags

from rl.device_split import Split, compare, format_table
from rl.elastic.migration import MIGRATION_POLICIES, MigrationConfig
from rl.elastic.stage import StageModel
from rl.round_planner import TailConfig
from rl.sim import papers
from rl.sim.compare import (
    balance_learner,
    compare_borrowing,
    compare_migration,
    run_modes,
    sim_config,
    validate,
)
from rl.sim.kv_layouts import compare_kv_layouts, format_kv_table
from rl.sim.multiplex import MultiplexResult, compare_multiplexing
from rl.sim.presets import gpu_preset
from rl.sim.simulator import SimResult
from rl.sim.workload import Workload, WorkloadConfig
from rl.sim.workload import summarize as summarize_lengths
from rl.types import Request, SamplingParams

MODES = (
    "sync",
    "cgp+fcfs+fifo",
    "cgp+shuffled+fifo",
    "cgp+frontier+fifo",
    "sync+tail",
    "cgp+frontier+tail",
    "async+frontier+s1",  # at U = --groups_per_update: the window is too small (see the docstring)
    "async+frontier+s1+fill",
    "async+frontier+s4+fill",
    "async+shuffled+s4+fill",
)

_JSON = flags.DEFINE_string("json", "", "Write the results here as JSON; empty: don't.")
_MODES = flags.DEFINE_list("modes", list(MODES), "Modes to compare; the first is the baseline.")
_SETUPS = flags.DEFINE_list("setups", ["32", "64", "96"], "Groups per round (R) of each setup.")
_ROUNDS = flags.DEFINE_integer("rounds", 10, "Simulated rounds per mode and setup.")
_PRESET = flags.DEFINE_string("preset", "qwen3-1.7b", "Model (rl.models preset) of the GPU preset.")
_GPU = flags.DEFINE_string("gpu", "h100", "GPU of the preset: h100 | h200.")
_SAMPLER_GPUS = flags.DEFINE_integer("sampler_gpus", 4, "Sampler GPUs.")
_SAMPLER_TP = flags.DEFINE_integer("sampler_tp", 1, "GPUs per sampler replica.")
_LEARNER_GPUS = flags.DEFINE_integer("learner_gpus", 4, "Learner GPUs.")
_PROFILE = flags.DEFINE_string("profile", "", "A launch.profile JSON: use its fitted model.")
_SLOTS = flags.DEFINE_integer("slots", 0, "Slots per replica; 0: the preset's (--profile: its).")
_GROUP_SIZE = flags.DEFINE_integer("group_size", 8, "Samples per group (G).")
_PER_UPDATE = flags.DEFINE_integer("groups_per_update", 2, "Groups per update (U).")
_ETA = flags.DEFINE_float("eta", 1.25, "Tail batching: short rounds launch ceil(eta * R) prompts.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 8192, "Response cap.")
_MEDIAN = flags.DEFINE_float("median_tokens", 1500, "Median response length of a median prompt.")
_PROMPT_SIGMA = flags.DEFINE_float("prompt_sigma", 0.8, "Lognormal spread across prompts.")
_SAMPLE_SIGMA = flags.DEFINE_float("sample_sigma", 0.35, "Lognormal spread within a prompt.")
_RUNAWAY = flags.DEFINE_float(
    "runaway_fraction", 0.05, "Prompts whose samples may loop to the cap."
)
_RUNAWAY_P = flags.DEFINE_float("runaway_p", 0.5, "Chance a runaway prompt's sample hits the cap.")
_SEED = flags.DEFINE_integer("seed", 0, "Workload seed.")
_WORKLOAD = flags.DEFINE_enum(
    "workload",
    "custom",
    ["custom", "rollpacker"],
    "custom: the length flags above; rollpacker: median 500, cap 16384 (P75 ~910, RollPacker's "
    "755-1.1k), the spread and runaway flags as given.",
)
_RESPONSE_ETA = flags.DEFINE_float(
    "response_eta", 1.0, "Tail batching: launch ceil(response_eta * G) samples, keep G (1: off)."
)
_BALANCE = flags.DEFINE_float(
    "balance_wait", 0.5, "Paper-balance block: sync's wait ratio; 0: skip."
)
_VALIDATE = flags.DEFINE_string("validate", "", "A launch.bench_pipeline JSON to validate against.")
_PLAN = flags.DEFINE_list("plan_budgets", [], "Device budgets for the split planner.")
_BORROWING = flags.DEFINE_list(
    "borrowing", [], "Borrowing settings to compare (off,learner,sampler,both); empty: skip."
)
_BORROW_MODES = flags.DEFINE_list(
    "borrow_modes",
    ["sync", "cgp+frontier+fifo", "async+frontier+s4+fill"],
    "Modes of the borrowing comparison.",
)
_SWITCH = flags.DEFINE_float("switch_cost_s", 5.0, "Borrowing: the switch cost (there and back).")
_MIGRATION = flags.DEFINE_enum(
    "migration", "off", MIGRATION_POLICIES, "Add the static-split vs migration block (tail)."
)
_MIG_FRACTION = flags.DEFINE_float(
    "migration_fraction", 0.25, "Migration: act once running <= this * all slots."
)
_MIG_MIN_LEFT = flags.DEFINE_integer(
    "migration_min_left", 0, "Migration: requests with fewer tokens to go stay put."
)
_CHECKPOINTS = flags.DEFINE_list(
    "checkpoint_every",
    [],
    "Add the async checkpoint block: throughput of the async --modes with a checkpoint every k "
    "rounds (exact: a barrier, nothing in flight; no_bubble), for each k given, vs none.",
)
_PAPERS = flags.DEFINE_bool(
    "papers",
    False,
    "Only the seed systems' headline table (rl/sim/papers.py), ours vs the paper's.",
)
_MULTIPLEX = flags.DEFINE_list(
    "multiplex", [], "Pipeline counts of the multiplexing block (e.g. 2,3,4); empty: skip."
)
_MUX_MODES = flags.DEFINE_list(
    "multiplex_modes", ["sync", "cgp+frontier+fifo"], "Modes of the multiplexing block."
)
_KV_LAYOUTS = flags.DEFINE_list(
    "kv_layouts", [], "KV layouts to compare at the same HBM (dense,paged); empty: skip."
)
_KV_MODES = flags.DEFINE_list(
    "kv_modes", ["sync", "async+frontier+s4+fill"], "Modes of the KV layout comparison."
)
_GANTT_DIR = flags.DEFINE_string(
    "gantt_dir", "", "Write simulated Gantt PNGs here (setup R=32; --multiplex: every run)."
)


def stage_model() -> tuple[StageModel, int]:
    if _PROFILE.value:
        with open(_PROFILE.value, encoding="utf-8") as f:
            profiled = json.load(f).get("config", {}).get("slots", 32)
        return StageModel.load(_PROFILE.value), _SLOTS.value or profiled
    preset = gpu_preset(
        _PRESET.value, _GPU.value, sampler_tp=_SAMPLER_TP.value, learner_gpus=_LEARNER_GPUS.value
    )
    return preset.model, _SLOTS.value or preset.slots


def print_modes(title: str, rows: dict[str, dict[str, float]]) -> None:
    print(title)
    print(
        f"  {'mode':<30}{'U':>4}{'r2t_end s':>10}{'vs sync':>9}{'1st disp s':>11}{'wait':>7}"
        f"{'rollout s':>10}{'train s':>9}{'s/group':>9}{'vs sync':>8}{'long rds':>9}"
        f"{'groups/s':>9}"
        f"{'vs sync':>8}{'vs cgp':>7}{'lag':>6}"
    )
    cgp = rows.get("cgp+frontier+fifo", {}).get("groups_per_s", float("nan"))
    for m, r in rows.items():
        print(
            f"  {m:<30}{r['groups_per_update']:>4}{r['rollout_to_train_end_s']:>10.2f}{-r['reduction_vs_sync']:>+9.1%}"
            f"{r['first_dispatch_s']:>11.2f}{r['trainer_wait_ratio']:>7.2f}{r['rollout_s']:>10.2f}"
            f"{r['trainer_compute_s']:>9.2f}{r['time_per_group_s']:>9.3f}"
            f"{r['speedup_per_group_vs_sync']:>7.2f}x{r['long_rounds']:>9.0f}"
            f"{r['groups_per_s']:>9.3f}{r['throughput_vs_sync']:>7.2f}x"
            f"{r['groups_per_s'] / cgp:>6.2f}x{r['lag_mean']:>6.2f}"
        )
    print(
        "  U: groups per update (a +fill row's is the smallest whose staleness window, (s + 1) x U "
        "groups, keeps every slot busy); s/group: rollout-to-train-end per trained group, its vs sync: sync's s/group / the "
        "mode's (a speedup); groups/s: groups trained / time between round starts (the throughput; async rounds "
        "overlap, so their r2t, 1st disp and s/group count from a round's first submission, which "
        "precedes the previous round's end); vs cgp: vs cgp+frontier+fifo; lag: mean version lag "
        "(simulated: the version at admission, an upper bound)"
    )


ROLLPACKER = papers.ROLLPACKER_WORKLOAD  # P75 ~910, max 16k


def max_new_tokens() -> int:
    return ROLLPACKER["max_new_tokens"] if _WORKLOAD.value == "rollpacker" else _MAX_NEW.value


def workload_config() -> WorkloadConfig:
    return WorkloadConfig(
        max_new_tokens=max_new_tokens(),
        median_tokens=ROLLPACKER["median_tokens"]
        if _WORKLOAD.value == "rollpacker"
        else _MEDIAN.value,
        prompt_sigma=_PROMPT_SIGMA.value,
        sample_sigma=_SAMPLE_SIGMA.value,
        runaway_fraction=_RUNAWAY.value,
        runaway_p=_RUNAWAY_P.value,
        seed=_SEED.value,
    )


def length_stats(workload: WorkloadConfig, group_size: int, prompts: int = 2000) -> dict:
    """Median, P75, P90, max and mean response length of `prompts` prompts' samples."""
    w = Workload(workload)
    params = SamplingParams(max_new_tokens=workload.max_new_tokens)
    lengths = [
        n
        for uid in range(prompts)
        for n in w.lengths(Request(uid=uid, prompt=(0,), group_size=group_size, params=params))
    ]
    return summarize_lengths(lengths)


def setup_fields(
    groups_per_round: int, replicas: int, slots: int, *, tail: bool = True
) -> dict[str, Any]:
    """The SimConfig fields of one setup (R groups per round) from the flags; `tail`: with the
    tail-batching flags (--eta, --response_eta)."""
    fields = dict(
        groups_per_round=groups_per_round,
        groups_per_update=_PER_UPDATE.value,
        group_size=_GROUP_SIZE.value,
        max_new_tokens=max_new_tokens(),
        replicas=replicas,
        slots=slots,
    )
    if tail:
        fields["tail"] = TailConfig(eta=_ETA.value, response_eta=_RESPONSE_ETA.value)
    return fields


def comparison(model: StageModel, slots: int, out: dict[str, Any]) -> None:
    workload = workload_config()
    replicas = 1 if _PROFILE.value else _SAMPLER_GPUS.value // _SAMPLER_TP.value
    print(
        f"stage model: {model.source}; {replicas} replica(s) x {slots} slots; workload "
        f"{workload}; {_ROUNDS.value} rounds per mode"
    )
    stats = length_stats(workload, _GROUP_SIZE.value)
    print(
        "  response lengths (2,000 prompts): " + ", ".join(f"{k} {v:.0f}" for k, v in stats.items())
    )
    out["workload"] = workload.__dict__ | {"fixed_lengths": None, "length_stats": stats}
    out["stage_model"], out["replicas"], out["slots"] = model.to_dict(), replicas, slots
    for label, balance in (("setups", 0.0), ("paper_balance", _BALANCE.value)):
        if label == "paper_balance" and not balance:
            continue
        out[label] = {}
        for r in map(int, _SETUPS.value):
            fields = setup_fields(r, replicas, slots)
            mdl, scale = model, 1.0
            if balance:
                mdl, scale = balance_learner(
                    model, workload, target_wait=balance, rounds=_ROUNDS.value, **fields
                )

            def gantt(name: str, result: SimResult, r: int = r, label: str = label) -> None:
                if _GANTT_DIR.value and r == int(_SETUPS.value[0]) and label == "setups":
                    os.makedirs(_GANTT_DIR.value, exist_ok=True)
                    stem = os.path.join(_GANTT_DIR.value, f"sim_R{r}_{name.replace('+', '_')}")
                    result.timeline.write_gantt_png(stem + ".png", title=f"simulated {name}, R={r}")

            rows = run_modes(
                _MODES.value, mdl, workload, rounds=_ROUNDS.value, on_result=gantt, **fields
            )
            out[label][f"R{r}"] = dict(modes=rows, learner_scale=scale)
            print_modes(
                f"{label} R={r} (G={_GROUP_SIZE.value}, U={_PER_UPDATE.value} unless a row says"
                + (f", learner x{scale:.1f} for sync wait {balance:.0%}" if balance else "")
                + ")",
                rows,
            )


def validation(model: StageModel, out: dict[str, Any]) -> None:
    with open(_VALIDATE.value, encoding="utf-8") as f:
        real = json.load(f)
    rows = validate(real, model)
    out["validation"] = dict(real=_VALIDATE.value, profile=_PROFILE.value, modes=rows)
    print(
        f"validation: {_VALIDATE.value} (real) vs the simulator with {model.source} "
        f"(contention {model.contention:.2f}); means over the timed rounds"
    )
    print(
        f"  {'mode':<32}{'real r2t':>9}{'sim r2t':>9}{'error':>8}{'real 1st':>9}{'sim 1st':>9}"
        f"{'real wait':>10}{'sim wait':>9}"
    )
    for m, r in rows.items():
        print(
            f"  {m:<32}{r['real_rollout_to_train_end_s']:>9.3f}{r['sim_rollout_to_train_end_s']:>9.3f}"
            f"{r['error_rollout_to_train_end_s']:>+8.1%}{r['real_first_dispatch_s']:>9.3f}"
            f"{r['sim_first_dispatch_s']:>9.3f}{r['real_trainer_wait_ratio']:>10.2f}"
            f"{r['sim_trainer_wait_ratio']:>9.2f}"
        )


def migration_block(model: StageModel, slots: int, out: dict[str, Any]) -> None:
    workload = workload_config()
    replicas = 1 if _PROFILE.value else _SAMPLER_GPUS.value // _SAMPLER_TP.value
    mig = MigrationConfig(
        policy=_MIGRATION.value,
        max_running_fraction=_MIG_FRACTION.value,
        min_tokens_left=_MIG_MIN_LEFT.value,
    )
    out["migration"] = {"config": mig.__dict__, "replicas": replicas}
    for r in map(int, _SETUPS.value):
        rows = compare_migration(
            _MODES.value,
            model,
            workload,
            mig,
            rounds=_ROUNDS.value,
            **setup_fields(r, replicas, slots),
        )
        out["migration"][f"R{r}"] = rows
        print(
            f"migration ({mig.policy}, {replicas} replicas x {slots} slots, round-robin routing) "
            f"R={r}:"
        )
        print(
            f"  {'mode':<36}{'r2t_end s':>10}{'groups/s':>9}{'vs static':>10}"
            f"{'replica-s busy':>15}{'vs static':>10}{'moves/rd':>9}{'MB/rd':>9}"
        )
        for name, row in rows.items():
            print(
                f"  {name:<36}{row['rollout_to_train_end_s']:>10.2f}{row['groups_per_s']:>9.3f}"
                f"{row['groups_per_s_vs_static']:>9.2f}x{row['replica_busy_s']:>15.1f}"
                f"{row['busy_vs_static']:>9.2f}x{row['migrations']:>9.1f}{row['migrated_mb']:>9.1f}"
            )


def planning(out: dict[str, Any]) -> None:
    workload = workload_config()
    out["plan"] = {}
    for budget in map(int, _PLAN.value):
        cfg = sim_config(
            "cgp+frontier+fifo",
            groups_per_round=int(_SETUPS.value[0]),
            groups_per_update=_PER_UPDATE.value,
            group_size=_GROUP_SIZE.value,
            max_new_tokens=_MAX_NEW.value,
        )

        def make(s: Split) -> Any:
            return gpu_preset(
                _PRESET.value, _GPU.value, sampler_tp=s.tp, learner_gpus=s.learner_gpus
            )

        choice, rows = compare(budget, make, cfg, Workload(workload), rounds=3, tps=(1, 2))
        print(f"planner, {budget} x {_GPU.value}, {cfg.name}, R={cfg.groups_per_round}:")
        print(format_table(choice, rows))
        out["plan"][str(budget)] = dict(
            choice=str(choice),
            rows=[
                dict(split=str(r.split), predicted_s=r.predicted_s, simulated_s=r.simulated_s)
                for r in rows
            ],
        )


def borrowing(model: StageModel, slots: int, out: dict[str, Any]) -> None:
    workload = workload_config()
    replicas = _SAMPLER_GPUS.value // _SAMPLER_TP.value
    print(
        f"borrowing vs static split: {_SAMPLER_GPUS.value} sampler GPUs ({replicas}x tp"
        f"{_SAMPLER_TP.value}, {slots} slots) / {_LEARNER_GPUS.value} learner GPUs, switch cost "
        f"{_SWITCH.value:g} s; BiDiRL reports up to 1.94x, JigsawRL up to 1.85x"
    )
    blocks = [("borrowing", 0.0)] + (
        [("borrowing_balanced", _BALANCE.value)] * bool(_BALANCE.value)
    )
    for label, balance in blocks:
        out[label] = {}
        for r in map(int, _SETUPS.value):
            fields = setup_fields(r, replicas, slots, tail=False)
            mdl, scale = model, 1.0
            if balance:
                mdl, scale = balance_learner(
                    model, workload, target_wait=balance, rounds=_ROUNDS.value, **fields
                )
            rows = compare_borrowing(
                _BORROW_MODES.value,
                mdl,
                workload,
                rounds=_ROUNDS.value,
                learner_devices=_LEARNER_GPUS.value,
                replica_devices=_SAMPLER_TP.value,
                borrowings=_BORROWING.value,
                switch_cost_s=_SWITCH.value,
                migration=MigrationConfig(
                    policy=_MIGRATION.value if _MIGRATION.value != "off" else "tail",
                    max_running_fraction=_MIG_FRACTION.value,
                    min_tokens_left=_MIG_MIN_LEFT.value,
                ),
                **fields,
            )
            out[label][f"R{r}"] = rows
            what = f", learner x{scale:.1f} for sync wait {balance:.0%}" if balance else ""
            print(f"  R={r}{what}:")
            print(
                f"  {'mode':<26}{'borrowing':<16}{'groups/s':>9}{'vs static':>10}{'moves L/S':>10}"
                f"{'bound':>7}"
            )
            for mode, by in rows.items():
                for i, (b, x) in enumerate(by.items()):
                    bound = f"{x['pooling_bound']:>6.2f}x" if i == 0 else ""
                    print(
                        f"  {mode:<26}{b:<16}{x['groups_per_s']:>9.3f}"
                        f"{x['throughput_vs_static']:>9.2f}x"
                        f"{x['moves_learner']:>6.0f}/{x['moves_sampler']:<4.0f}{bound}"
                    )
            print(
                "  bound (on the static row): its device-seconds over the device-seconds its "
                "devices worked, the most any borrowing can gain there with free switches"
            )


def checkpoint_barriers(model: StageModel, slots: int, out: dict[str, Any]) -> None:
    """Async checkpoints every k rounds: "exact" drains the pipeline (a barrier), "no_bubble" holds
    only the learner (config.async_resume); groups/s of each vs no checkpoint."""
    workload = workload_config()
    replicas = 1 if _PROFILE.value else _SAMPLER_GPUS.value // _SAMPLER_TP.value
    modes = [m for m in _MODES.value if m.startswith("async")]
    intervals = list(map(int, _CHECKPOINTS.value))
    out["checkpoint_barriers"] = {}
    print(
        f"\nasync checkpoints (groups/s; vs no checkpoint; G={_GROUP_SIZE.value}, "
        f"U={_PER_UPDATE.value}, {_ROUNDS.value} rounds; the save itself is not modelled):"
    )
    print(
        f"  {'setup':<8}{'mode':<22}{'none':>8}"
        + "".join(f"{f'{kind} /{k}':>19}" for k in intervals for kind in ("exact", "no_bubble"))
    )
    for r in map(int, _SETUPS.value):
        fields = setup_fields(r, replicas, slots)
        runs = {"none": run_modes(modes, model, workload, rounds=_ROUNDS.value, **fields)}
        for k in intervals:
            for kind in ("exact", "no_bubble"):
                runs[f"{kind}/{k}"] = run_modes(
                    modes,
                    model,
                    workload,
                    rounds=_ROUNDS.value,
                    checkpoint_every=k,
                    keep_sampling=kind == "no_bubble",
                    **fields,
                )
        out["checkpoint_barriers"][f"R{r}"] = {
            m: {name: rows[m]["groups_per_s"] for name, rows in runs.items()} for m in modes
        }
        for m in modes:
            none = runs["none"][m]["groups_per_s"]
            cells = [
                f"{rows[m]['groups_per_s']:>8.3f} {rows[m]['groups_per_s'] / none:>5.2f}x"
                for name, rows in runs.items()
                if name != "none"
            ]
            print(f"  R={r:<6}{m:<22}{none:>8.3f}" + "".join(f"{c:>19}" for c in cells))


def multiplexing(model: StageModel, slots: int, out: dict[str, Any]) -> None:
    replicas = _SAMPLER_GPUS.value // _SAMPLER_TP.value
    counts = sorted(map(int, _MULTIPLEX.value))
    out["multiplexing"] = {}
    for r in map(int, _SETUPS.value):
        fields = setup_fields(r, replicas, slots, tail=False)
        scaled, note = model, "the preset's learner"
        if _BALANCE.value:
            scaled, scale = balance_learner(
                model, workload_config(), target_wait=_BALANCE.value, rounds=_ROUNDS.value, **fields
            )
            note = f"learner x{scale:.1f} (sync waits {_BALANCE.value:.0%})"
        print(f"multiplexing, {replicas} replicas x {slots} slots and one learner, R={r}, {note}:")
        print(
            f"  {'mode':<24}{'N':>3}{'back2back s':>12}{'static s':>10}{'muxed s':>9}"
            f"{'vs static':>10}{'vs b2b':>8}{'bound':>7}{'switches':>9}{'learner':>8}"
        )
        for mode in _MUX_MODES.value:
            for n in counts:
                workloads = [
                    dataclasses.replace(workload_config(), seed=_SEED.value + i) for i in range(n)
                ]
                gantt = None
                if _GANTT_DIR.value:
                    os.makedirs(_GANTT_DIR.value, exist_ok=True)
                    path = os.path.join(_GANTT_DIR.value, f"multiplex_R{r}_{mode}_{n}.png")
                    title = f"{n} x {mode} multiplexed, R={r}"

                    def gantt(res: MultiplexResult, path: str = path, title: str = title) -> None:
                        res.write_gantt_png(path, title)

                row = compare_multiplexing(
                    mode, scaled, workloads, rounds=_ROUNDS.value, on_result=gantt, **fields
                )
                out["multiplexing"][f"R{r}/{mode}/{n}"] = row
                print(
                    f"  {mode:<24}{n:>3}{row['back_to_back_s']:>12.0f}{row['static_s']:>10.0f}"
                    f"{row['multiplexed_s']:>9.0f}{row['vs_static']:>9.2f}x"
                    f"{row['vs_back_to_back']:>7.2f}x{row['bound_vs_static']:>6.2f}x"
                    f"{row['replica_switches']:>9.0f}{row['learner_busy']:>8.0%}"
                )


def kv_layouts(out: dict[str, Any]) -> None:
    workload = workload_config()
    replicas = _SAMPLER_GPUS.value // _SAMPLER_TP.value
    out["kv_layouts"] = {}
    for r in map(int, _SETUPS.value):
        fields = setup_fields(r, replicas, 0, tail=False)
        del fields["slots"]
        rows = compare_kv_layouts(
            _KV_LAYOUTS.value,
            _KV_MODES.value,
            workload,
            rounds=_ROUNDS.value,
            model=_PRESET.value,
            gpu=_GPU.value,
            sampler_tp=_SAMPLER_TP.value,
            learner_gpus=_LEARNER_GPUS.value,
            **fields,
        )
        out["kv_layouts"][f"R{r}"] = rows
        print(
            f"KV layouts at the same HBM: {_PRESET.value} on {replicas} x {_GPU.value} (tp "
            f"{_SAMPLER_TP.value}), cap {max_new_tokens()}, R={r}, G={_GROUP_SIZE.value}, "
            f"{_ROUNDS.value} rounds:"
        )
        print(format_kv_table(rows))


def paper_headlines(model: StageModel, slots: int, out: dict[str, Any]) -> None:
    borrow = gpu_preset(
        _PRESET.value, _GPU.value, learner_gpus=papers.PaperSetup.borrow_learner_gpus
    )
    setup = papers.PaperSetup(
        model=model,
        borrow_model=borrow.model,
        replicas=_SAMPLER_GPUS.value // _SAMPLER_TP.value,
        slots=slots,
        rounds=_ROUNDS.value,
        seed=_SEED.value,
    )
    rows = papers.headlines(setup)
    out["papers"] = {name: dataclasses.asdict(h) for name, h in rows.items()}
    print(
        f"seed systems' headlines: {model.source}, {setup.replicas} x {slots} slots, "
        f"{_ROUNDS.value} rounds per run, workload seed {_SEED.value}"
    )
    print(f"  {'system':<23}{'ours':>8}{'paper':>8}  metric / our setting")
    for name, h in rows.items():
        ours = "-" if h.ours is None else f"{h.ours:.3g}"
        print(f"  {name:<23}{ours:>8}{h.paper:>8.3g}  {h.metric}")
        print(f"  {'':<39}{h.setting}")


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    if _VALIDATE.value and not _PROFILE.value:
        raise app.UsageError("--validate needs --profile (the fitted model of the same machine).")
    model, slots = stage_model()
    out: dict[str, Any] = {}
    if _PAPERS.value:
        paper_headlines(model, slots, out)
    elif _VALIDATE.value:
        validation(model, out)
    elif (not _BORROWING.value and not _MULTIPLEX.value and not _KV_LAYOUTS.value) or flags.FLAGS[
        "modes"
    ].present:
        comparison(model, slots, out)  # --borrowing, --multiplex or --kv_layouts: only that block
    if _MIGRATION.value != "off":
        migration_block(model, slots, out)
    if _CHECKPOINTS.value:
        checkpoint_barriers(model, slots, out)
    if _PLAN.value:
        planning(out)
    if _BORROWING.value:
        borrowing(model, slots, out)
    if _MULTIPLEX.value and not _PAPERS.value:
        multiplexing(model, slots, out)
    if _KV_LAYOUTS.value:
        kv_layouts(out)
    if _JSON.value:
        with open(_JSON.value, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=2, default=str)
        print(f"wrote {_JSON.value}")


if __name__ == "__main__":
    app.run(main)
