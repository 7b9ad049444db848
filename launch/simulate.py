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
learner trains on the sampler's devices once the rollout drains, under async once the staleness
bound has drained the sampler, until the update's publish; sampler: the learner's devices
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

import json
from typing import Any

from absl import app, flags

from launch import simulate_blocks as blocks
from rl.elastic.migration import MIGRATION_POLICIES, MigrationConfig
from rl.elastic.stage import StageModel
from rl.sim import papers
from rl.sim.presets import gpu_preset
from rl.sim.workload import WorkloadConfig

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


ROLLPACKER = papers.ROLLPACKER_WORKLOAD  # P75 ~910, max 16k


def workload_config() -> WorkloadConfig:
    rollpacker = _WORKLOAD.value == "rollpacker"
    return WorkloadConfig(
        max_new_tokens=ROLLPACKER["max_new_tokens"] if rollpacker else _MAX_NEW.value,
        median_tokens=ROLLPACKER["median_tokens"] if rollpacker else _MEDIAN.value,
        prompt_sigma=_PROMPT_SIGMA.value,
        sample_sigma=_SAMPLE_SIGMA.value,
        runaway_fraction=_RUNAWAY.value,
        runaway_p=_RUNAWAY_P.value,
        seed=_SEED.value,
    )


def settings() -> blocks.Settings:
    """The blocks' settings from the flags."""
    return blocks.Settings(
        modes=tuple(_MODES.value),
        setups=tuple(map(int, _SETUPS.value)),
        rounds=_ROUNDS.value,
        preset=_PRESET.value,
        gpu=_GPU.value,
        sampler_gpus=_SAMPLER_GPUS.value,
        sampler_tp=_SAMPLER_TP.value,
        learner_gpus=_LEARNER_GPUS.value,
        profile=_PROFILE.value,
        group_size=_GROUP_SIZE.value,
        groups_per_update=_PER_UPDATE.value,
        eta=_ETA.value,
        response_eta=_RESPONSE_ETA.value,
        workload=workload_config(),
        seed=_SEED.value,
        balance_wait=_BALANCE.value,
        validate=_VALIDATE.value,
        plan_budgets=tuple(map(int, _PLAN.value)),
        borrowing=tuple(_BORROWING.value),
        borrow_modes=tuple(_BORROW_MODES.value),
        switch_cost_s=_SWITCH.value,
        migration=MigrationConfig(
            policy=_MIGRATION.value,
            max_running_fraction=_MIG_FRACTION.value,
            min_tokens_left=_MIG_MIN_LEFT.value,
        ),
        checkpoint_every=tuple(map(int, _CHECKPOINTS.value)),
        multiplex=tuple(sorted(map(int, _MULTIPLEX.value))),
        multiplex_modes=tuple(_MUX_MODES.value),
        kv_layouts=tuple(_KV_LAYOUTS.value),
        kv_modes=tuple(_KV_MODES.value),
        gantt_dir=_GANTT_DIR.value,
    )


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    if _VALIDATE.value and not _PROFILE.value:
        raise app.UsageError("--validate needs --profile (the fitted model of the same machine).")
    s = settings()
    model, slots = stage_model()
    out: dict[str, Any] = {}
    if _PAPERS.value:
        blocks.paper_headlines(s, model, slots, out)
    elif s.validate:
        blocks.validation(s, model, out)
    elif (not s.borrowing and not s.multiplex and not s.kv_layouts) or flags.FLAGS["modes"].present:
        # --borrowing, --multiplex or --kv_layouts alone: only that block
        blocks.comparison(s, model, slots, out)
    if s.migration.policy != "off":
        blocks.migration_block(s, model, slots, out)
    if s.checkpoint_every:
        blocks.checkpoint_barriers(s, model, slots, out)
    if s.plan_budgets:
        blocks.planning(s, out)
    if s.borrowing:
        blocks.borrowing(s, model, slots, out)
    if s.multiplex and not _PAPERS.value:
        blocks.multiplexing(s, model, slots, out)
    if s.kv_layouts:
        blocks.kv_layouts(s, out)
    if _JSON.value:
        with open(_JSON.value, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=2, default=str)
        print(f"wrote {_JSON.value}")


if __name__ == "__main__":
    app.run(main)
