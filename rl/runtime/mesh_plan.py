"""The planner in the run: the stage-time models of `config.elastic.stage_model`, and the split.

A spec is either a `launch.profile` JSON (measured on this machine: one sampler replica of one
device, a learner of one device) or "preset:<model>:<gpu>" (rl/sim/presets.py, a roofline estimate
of a GPU). `split_models(spec)` returns the function rl.device_split needs: Split -> Preset (the StageModel
of one sampler replica of `split.tp` devices and of a learner of `split.learner_gpus` devices, and
the replica's slots). A profile's learner per-token term is scaled by 1 / learner devices (data
parallel); its sampler replica is what was measured, so it offers tp = 1 only.

`plan_mesh(config, devices)` is what a run does when `config.mesh.split == "plan"` (the split is
"open": the planner, not the config, picks mesh.learner_devices, mesh.sampler_replicas and
mesh.sampler_devices, the first and last of which must be left 0): rl.device_split.plan over every split
of the local devices into a learner and sampler replicas of mesh.sampler_tp devices, each an Engine
of config.engine.max_slots slots (what the threads runtime builds; splits whose learner fsdp does
not divide learner.micro_batch_rows are skipped), with the run's schedule (driver: mode, R, U, G)
and a workload of its response cap (median config.elastic.median_tokens). It returns the fixed
MeshConfig of the chosen split: learner_devices = learner GPUs, sampler_replicas = replicas,
sampler_devices = sampler_tp (devices per replica).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

from absl import logging

from learner.mesh import MeshConfig
from rl.device_split import Split, plan
from rl.driver import DriverConfig
from rl.elastic.stage import StageModel
from rl.sections import from_section
from rl.sim.presets import Preset, gpu_preset
from rl.sim.simulator import SimConfig
from rl.sim.workload import Workload, WorkloadConfig
from rl.types import SamplingParams

PROFILE_LEARNER_DEVICES = 1  # launch.profile measures a learner of one device


def split_models(spec: str, *, slots: int = 0) -> Callable[[Split], Preset]:
    """Split -> Preset for a stage-model spec; see the module docstring.

    Args:
      spec: a launch.profile JSON path, or "preset:<model>:<gpu>".
      slots: slots per replica; 0: the profile's (its config) or the preset's.

    Raises:
      ValueError: an empty or malformed spec, or a file that is not a profile.
    """
    if not spec:
        raise ValueError(
            "config.elastic.stage_model is empty; expected a launch.profile JSON path or "
            "'preset:<model>:<gpu>' (needed by elastic.borrowing and mesh.split='plan')."
        )
    if spec.startswith("preset:"):
        parts = spec.split(":")
        if len(parts) != 3:
            raise ValueError(
                f"config.elastic.stage_model={spec!r}; expected 'preset:<model>:<gpu>', e.g. "
                "'preset:qwen3-1.7b:h100'."
            )
        _, name, gpu = parts

        def preset(split: Split) -> Preset:
            p = gpu_preset(name, gpu, sampler_tp=split.tp, learner_gpus=split.learner_gpus)
            return dataclasses.replace(p, slots=slots) if slots else p

        return preset
    try:
        with open(spec, encoding="utf-8") as f:
            raw = json.load(f)
        model = StageModel.from_dict(raw.get("model", raw))
    except (OSError, ValueError, TypeError, AttributeError) as e:
        raise ValueError(
            f"config.elastic.stage_model={spec!r} is not a readable launch.profile JSON: {e}"
        ) from None
    measured_slots = slots or int(raw.get("config", {}).get("slots", 0) or 0)
    if measured_slots < 1:
        raise ValueError(
            f"config.elastic.stage_model={spec!r} gives no slots per replica; expected a profile "
            "whose config holds 'slots'."
        )

    def profiled(split: Split) -> Preset:
        if split.tp != 1:
            raise ValueError(f"A profile measures replicas of one device; received tp={split.tp}.")
        scale = PROFILE_LEARNER_DEVICES / split.learner_gpus
        m = model.replace(learner_per_token=model.learner_per_token * scale)
        return Preset(m, measured_slots, {})

    return profiled


@dataclasses.dataclass(frozen=True)
class MeshPlan:
    """The planner's choice for a run: the split, its predicted round time, every split's."""

    split: Split
    predicted_round_s: float
    rows: tuple[tuple[str, float], ...]  # (split, predicted seconds per round) of each candidate

    def __str__(self) -> str:
        return f"planned split: {self.split}, predicted {self.predicted_round_s:.3g} s per round"


def plan_mesh(config: Any, devices: int) -> tuple[Any, MeshPlan]:
    """The MeshConfig (split "fixed") the planner picks for `devices`; see the module docstring."""

    mesh = from_section(MeshConfig, config.mesh, name="mesh")
    if mesh.split != "plan":
        raise ValueError(f"plan_mesh needs config.mesh.split='plan'; received {mesh.split!r}.")
    if mesh.learner_devices or mesh.sampler_devices or mesh.sampler_replicas != 1 or mesh.colocated:
        raise ValueError(
            "config.mesh.split='plan' picks the learner devices and the sampler replicas; expected "
            "mesh.learner_devices=0, sampler_devices=0, sampler_replicas=1, colocated=False; "
            f"received {mesh.learner_devices}, {mesh.sampler_devices}, {mesh.sampler_replicas}, "
            f"{mesh.colocated}."
        )

    cap = config.sampling.max_new_tokens
    driver = from_section(
        DriverConfig, config.driver, name="driver", sampling=SamplingParams(max_new_tokens=cap)
    )
    shared = {f.name for f in dataclasses.fields(SimConfig)} & {
        f.name for f in dataclasses.fields(driver)
    }
    cfg = SimConfig(**{n: getattr(driver, n) for n in shared}, max_new_tokens=cap)
    median = config.elastic.median_tokens or max(1.0, cap / 4)
    workload = Workload(WorkloadConfig(max_new_tokens=cap, median_tokens=median, seed=config.seed))
    models = split_models(config.elastic.stage_model, slots=config.engine.max_slots)
    rows_per_micro = config.learner.micro_batch_rows

    def make(
        split: Split,
    ) -> Preset:  # only splits the runtime can build (rl.device_split skips others)
        fsdp = split.learner_gpus // mesh.learner_tp
        if split.learner_gpus % mesh.learner_tp or rows_per_micro % fsdp:
            raise ValueError(f"{split}: learner fsdp does not divide the micro-batch rows")
        return models(split)

    choice, rows = plan(devices, make, cfg, workload, tps=(mesh.sampler_tp,))
    best = min(rows, key=lambda r: r.predicted_s)
    out = MeshPlan(choice, best.predicted_s, tuple((str(r.split), r.predicted_s) for r in rows))
    logging.info("%s (%s, %s)", out, config.elastic.stage_model, cfg.name)
    fixed = dataclasses.replace(
        mesh,
        split="fixed",
        learner_devices=choice.learner_gpus,
        sampler_devices=choice.tp,  # per replica
        sampler_replicas=choice.replicas,
    )
    return fixed, out
