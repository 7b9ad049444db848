"""Mode comparisons on the simulator (launch.simulate's blocks) and validation against a real run.

A mode name is what launch.bench_pipeline uses (rl.schedules.mode_fields parses it): "sync",
"cgp+<admission>+<batching>", "sync+tail", "cgp+<admission>+tail" (tail batching; cgp's batches
then form in completion order), "async+<admission>+s<max_staleness>", optionally "+u<N>" or
"+fill" (its own groups per update; rl.schedules.config).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from rl.admission import AdmissionPolicy, ShuffledFCFS, make_policy  # noqa: F401 (re-exported)
from rl.elastic.borrowing import BorrowConfig, BorrowPolicy
from rl.elastic.stage import StageModel
from rl.round_planner import TailConfig
from rl.schedules import mode_fields
from rl.schedules.asynchronous import fill_groups_per_update
from rl.schedules.config import FILL
from rl.sim.borrow import SimBorrower
from rl.sim.bounds import pooling_bound, predrain_bound
from rl.sim.simulator import SimConfig, SimResult, Simulator
from rl.sim.workload import Workload, WorkloadConfig

HEADLINE = ("rollout_to_train_end_s", "first_dispatch_s", "trainer_wait_ratio")


def make_admission(name: str) -> AdmissionPolicy:
    """rl.admission's policies by name ("shuffled" is rl.admission.ShuffledFCFS)."""
    return make_policy(name)


def sim_config(mode: str, *, tail_factor: float = 1.0, **fields: Any) -> SimConfig:
    """The SimConfig of a mode name (rl.schedules.mode_fields); `fields` fill the rest (tail fields
    via `tail`). An async "+fill" name's groups per update keeps every slot busy on a workload whose
    longest response is `tail_factor` x its mean (rl.schedules.asynchronous.fill_groups_per_update;
    fill_factor gives it for a WorkloadConfig)."""
    mf = mode_fields(mode)
    tail_cfg = fields.pop("tail", TailConfig())
    tail = dataclasses.replace(tail_cfg, enabled=mf.pop("tail_enabled"))
    if mf.get("groups_per_update") == FILL:  # the async row's window covers every slot
        mf["groups_per_update"] = fill_groups_per_update(
            slots=fields.get("slots", SimConfig.slots) * fields.get("replicas", SimConfig.replicas),
            group_size=fields.get("group_size", SimConfig.group_size),
            max_staleness=mf["max_staleness"],
            groups_per_round=fields.get("groups_per_round", SimConfig.groups_per_round),
            tail_factor=tail_factor,
        )
    return SimConfig(**{**fields, **mf}, tail=tail)


def fill_factor(workload: WorkloadConfig, group_size: int = 8) -> float:
    """The workload's tail factor for "+fill" modes: its cap over its mean response length."""
    return max(1.0, workload.max_new_tokens / Workload(workload).mean_length(group_size))


def summarize(result: SimResult, skip: int = 0) -> dict[str, Any]:
    """Means over rounds (the first `skip` left out), time per trained group, r2t per round."""
    rounds = result.rounds[skip:]
    out = {
        k: float(np.mean([float(r[k]) for r in rounds]))
        for k in (*HEADLINE, "rollout_s", "trainer_compute_s", "slot_occupancy")
    }
    groups = sum(float(r["groups_trained"]) for r in rounds)
    out["time_per_group_s"] = sum(float(r["rollout_to_train_end_s"]) for r in rounds) / groups
    # Throughput: groups over the time between round starts (publish included); the measure that
    # stays meaningful when rounds overlap (async), where r2t windows overlap too.
    out["groups_per_s"] = groups / sum(float(r["round_s"]) for r in rounds)
    lags = [float(r["lag_mean"]) for r in rounds]
    out["lag_mean"] = float(np.mean(lags)) if lags else math.nan
    out["lag_max"] = max((float(r["lag_max"]) for r in rounds), default=math.nan)
    out["rounds"] = float(len(rounds))
    out["long_rounds"] = float(sum(r["kind"] in ("long", "flush") for r in rounds))
    out["per_round_r2t_s"] = [float(r["rollout_to_train_end_s"]) for r in rounds]
    return out


def run_modes(
    modes: Sequence[str],
    model: StageModel,
    workload: WorkloadConfig,
    *,
    rounds: int,
    skip: int = 0,
    contention_off: bool = False,
    on_result: Callable[[str, SimResult], None] | None = None,
    **fields: Any,
) -> dict[str, dict[str, Any]]:
    """Simulates every mode on the same workload; adds reductions vs the first mode (sync).

    Args:
      modes: mode names; the first is the baseline.
      model: the stage-time model.
      workload: response and prompt lengths.
      rounds: rounds per mode (fewer if a finite workload runs out).
      skip: leading rounds left out of the means (a real run's warm-up round).
      contention_off: simulate without the model's contention too ("<mode>/no_contention" keys,
        cgp modes only).
      on_result: called with each mode's SimResult (e.g. to write its Gantt chart).
      **fields: SimConfig fields (R, U, G, slots, replicas, tail, epoch_size, ...).
    """
    out: dict[str, dict[str, float]] = {}
    factor = fill_factor(workload, fields.get("group_size", SimConfig.group_size))
    variants = [(m, model) for m in modes]
    if contention_off and model.contention:
        variants += [
            (f"{m}/no_contention", model.replace(contention=0.0))
            for m in modes
            if m.startswith("cgp")
        ]
    for name, mdl in variants:
        cfg = sim_config(name.split("/")[0], tail_factor=factor, **dict(fields))
        result = Simulator(cfg, mdl, Workload(workload), make_admission=make_admission).run(rounds)
        if on_result is not None:
            on_result(name, result)
        out[name] = summarize(result, skip) | {"groups_per_update": cfg.groups_per_update}
    base = out[modes[0]]
    for r in out.values():
        r["reduction_vs_sync"] = 1.0 - r["rollout_to_train_end_s"] / base["rollout_to_train_end_s"]
        r["speedup_per_group_vs_sync"] = base["time_per_group_s"] / r["time_per_group_s"]
        r["throughput_vs_sync"] = r["groups_per_s"] / base["groups_per_s"]
    return out


def balance_learner(
    model: StageModel, workload: WorkloadConfig, *, target_wait: float, rounds: int, **fields: Any
) -> tuple[StageModel, float]:
    """Scales the learner's terms so that simulated sync has trainer_wait_ratio `target_wait`.

    In sync, wait = rollout and compute = training, so the scale is exact up to the learner terms
    being linear: scale = rollout (1 - w) / (w * train). Returns (scaled model, scale).
    """
    if not 0.0 < target_wait < 1.0:
        raise ValueError(f"target_wait must be in (0, 1); received {target_wait}.")
    s = summarize(
        Simulator(sim_config("sync", **dict(fields)), model, Workload(workload)).run(rounds)
    )
    wait, train = s["rollout_to_train_end_s"] - s["trainer_compute_s"], s["trainer_compute_s"]
    scale = wait * (1 - target_wait) / (target_wait * train)
    scaled = model.replace(
        learner_fixed=model.learner_fixed * scale,
        learner_per_token=model.learner_per_token * scale,
        update_s=model.update_s * scale,
    )
    return scaled, scale


def validate(
    real: Mapping[str, Any], model: StageModel, *, modes: Sequence[str] | None = None
) -> dict[str, dict[str, Any]]:
    """The simulator on launch.bench_pipeline's workload vs that run's JSON (`real`).

    The real run's first round compiles and is not timed: the simulated means skip it too.
    Returns per mode the real and simulated headline metrics and the relative error.
    """
    c = real["config"]
    workload = WorkloadConfig(
        max_new_tokens=c["max_new_tokens"],
        fixed_lengths=tuple(c["lengths"]),
        prompt_min=c["prompt_min"],
        prompt_max=c["prompt_max"],
        seed=c["seed"],
    )
    modes = list(modes or real["modes"])
    if modes[0] != "sync":
        raise ValueError(f"validate needs sync first among the modes; received {modes}.")
    sim = run_modes(
        modes,
        model,
        workload,
        rounds=10**6,
        skip=1,
        contention_off=True,
        groups_per_round=c["groups"],
        groups_per_update=c["groups_per_update"],
        group_size=c["group_size"],
        max_new_tokens=c["max_new_tokens"],
        slots=c["slots"],
        tail=TailConfig(eta=c.get("eta", 1.25)),
        epoch_size=len(c["lengths"]),
    )
    out = {}
    for name, s in sim.items():
        r = real["modes"][name.split("/")[0]]
        row = {}
        for k in (*HEADLINE, "rollout_s", "trainer_compute_s", "time_per_group_s"):
            row[f"real_{k}"], row[f"sim_{k}"] = float(r[k]), s[k]
            row[f"error_{k}"] = s[k] / float(r[k]) - 1 if float(r[k]) else math.nan
        real_rounds = r.get("per_round", {}).get("rollout_to_train_end_s", [])
        if len(real_rounds) == len(s["per_round_r2t_s"]):  # the same prompts, round by round
            errors = [x / y - 1 for x, y in zip(s["per_round_r2t_s"], real_rounds, strict=True)]
            row["per_round_real_r2t_s"], row["per_round_sim_r2t_s"] = (
                real_rounds,
                s["per_round_r2t_s"],
            )
            row["median_round_error_r2t"] = float(np.median(errors))
        out[name] = row
    return out


def compare_borrowing(
    modes: Sequence[str],
    model: StageModel,
    workload: WorkloadConfig,
    *,
    rounds: int,
    learner_devices: int,
    replica_devices: int = 1,
    borrowings: Sequence[str] = ("off", "learner", "sampler", "both"),
    switch_cost_s: float = 5.0,
    margin: float = 1.0,
    migration: Any = None,
    **fields: Any,
) -> dict[str, dict[str, dict[str, Any]]]:
    """Each mode with each borrowing setting (rl.elastic.borrowing, rl/sim/borrow.py) on the same
    workload: summarize's figures, the moves made, the throughput vs the static split ("off") and
    each run's pooling_bound (on the static row: the most any borrowing could gain there).

    Args:
      modes: mode names (sync, cgp+..., async+...).
      model: the stage-time model (its learner terms for `learner_devices`).
      workload: response and prompt lengths.
      rounds: rounds per run.
      learner_devices, replica_devices: the split's learner devices and sampler tp.
      borrowings: the settings to compare (off | learner | sampler | both, each optionally
        "+migration": with long-tail migration too, forced on as in compare_migration); the
        first is the baseline.
      switch_cost_s: the switch cost (there and back) the policy weighs and the simulator charges.
      margin: move only when gain > margin x switch cost.
      migration: the MigrationConfig of the "+migration" settings.
      **fields: SimConfig fields (R, U, G, replicas, slots, ...).
    """

    out: dict[str, dict[str, dict[str, Any]]] = {}
    factor = fill_factor(workload, fields.get("group_size", SimConfig.group_size))
    for mode in modes:
        out[mode] = {}
        for name in borrowings:
            b, _, mig = name.partition("+")
            if mig not in ("", "migration") or (mig and migration is None):
                raise ValueError(
                    f"Borrowing setting {name!r}; expected off|learner|sampler|both, optionally "
                    "with '+migration' (and a MigrationConfig)."
                )
            extra = {"migration": migration, "migration_consumer": True} if mig else {}
            borrow = None
            if b != "off":
                bcfg = BorrowConfig(borrowing=b, switch_cost_s=switch_cost_s, margin=margin)
                policy = BorrowPolicy(bcfg, model, model_learner_devices=learner_devices)
                borrow = SimBorrower(
                    policy, learner_devices=learner_devices, replica_devices=replica_devices
                )
            cfg = sim_config(mode, tail_factor=factor, **extra, **dict(fields))
            sim = Simulator(cfg, model, Workload(workload), pool=borrow)
            result = sim.run(rounds)
            sim_rounds = result.rounds
            row = summarize(result)
            row["moves_learner"] = float(borrow.moves["learner"]) if borrow else 0.0
            row["moves_sampler"] = float(borrow.moves["sampler"]) if borrow else 0.0
            row["migrations"] = float(sum(float(r.get("migrations", 0)) for r in sim_rounds))
            row["pooling_bound"] = pooling_bound(
                result, learner_devices=learner_devices, replica_devices=replica_devices
            )
            row["predrain_bound"] = predrain_bound(
                result, learner_devices=learner_devices, replica_devices=replica_devices
            )
            out[mode][name] = row
        base = out[mode][borrowings[0]]["groups_per_s"]
        for row in out[mode].values():
            row["throughput_vs_static"] = row["groups_per_s"] / base
    return out


def compare_migration(
    modes: Sequence[str],
    model: StageModel,
    workload: WorkloadConfig,
    migration: Any,
    *,
    rounds: int,
    **fields: Any,
) -> dict[str, dict[str, Any]]:
    """Each mode with its replicas' static split (requests routed round-robin at submission, as
    the runtimes route) and with long-tail migration (`migration`, a MigrationConfig), `tail`
    forced on (SimConfig.migration_consumer: a run has no consumer for it in one pipeline) to
    measure what consolidating costs.

    Returns, per "<mode>" and "<mode>+migration": summarize's figures, replica_busy_s (sampler
    replica-seconds busy, what freed replicas give back), migrations and migrated_mb per round,
    and groups_per_s_vs_static / busy_vs_static (the migration row over its static row).
    """
    out: dict[str, dict[str, Any]] = {}
    factor = fill_factor(workload, fields.get("group_size", SimConfig.group_size))
    for mode in modes:
        for name, mig in ((mode, None), (f"{mode}+migration", migration)):
            extra = {} if mig is None else {"migration": mig, "migration_consumer": True}
            cfg = sim_config(
                mode, routing="round_robin", tail_factor=factor, **extra, **dict(fields)
            )
            result = Simulator(cfg, model, Workload(workload)).run(rounds)
            row = summarize(result)
            n = max(1, len(result.rounds))
            row["replica_busy_s"] = float(result.counters["replica_busy_s"])
            row["migrations"] = sum(float(r["migrations"]) for r in result.rounds) / n
            row["migrated_mb"] = sum(float(r["migrated_bytes"]) for r in result.rounds) / n / 1e6
            out[name] = row
        static, moved = out[mode], out[f"{mode}+migration"]
        for r in (static, moved):
            r["groups_per_s_vs_static"] = r["groups_per_s"] / static["groups_per_s"]
            r["busy_vs_static"] = r["replica_busy_s"] / static["replica_busy_s"]
        del moved  # both rows filled
    return out


CHECKPOINT_KINDS = ("exact", "no_bubble")  # config.async_resume


def compare_checkpoints(
    modes: Sequence[str],
    model: StageModel,
    workload: WorkloadConfig,
    intervals: Sequence[int],
    *,
    rounds: int,
    **fields: Any,
) -> dict[str, dict[str, float]]:
    """Each (async) mode with a checkpoint every k rounds, for k in `intervals`, of each kind:
    "exact" drains the pipeline (a barrier, nothing in flight), "no_bubble" holds only the learner
    (config.async_resume); the save itself is not modelled.

    Returns mode -> "none" | "<kind>/<k>" -> groups/s (run_modes' groups_per_s).
    """
    runs = {"none": run_modes(modes, model, workload, rounds=rounds, **fields)}
    for k in intervals:
        for kind in CHECKPOINT_KINDS:
            runs[f"{kind}/{k}"] = run_modes(
                modes,
                model,
                workload,
                rounds=rounds,
                checkpoint_every=k,
                keep_sampling=kind == "no_bubble",
                **fields,
            )
    return {m: {name: rows[m]["groups_per_s"] for name, rows in runs.items()} for m in modes}
