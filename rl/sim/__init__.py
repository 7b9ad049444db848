"""Discrete-event simulator of the driver's rounds, run by the project's own policy objects.

from rl.sim import Simulator, SimConfig, StageModel, Workload, WorkloadConfig, gpu_preset
preset = gpu_preset("qwen3-1.7b", "h100", learner_gpus=4)
cfg = SimConfig(mode="cgp", admission="frontier", batching="fifo", groups_per_round=64,
                replicas=4, slots=preset.slots)
result = Simulator(cfg, preset.model, Workload(WorkloadConfig())).run(rounds=8)
result.rounds[0]["rollout_to_train_end_s"]; result.timeline.write_gantt_png("sim.png")
"""

from rl.elastic.stage import StageModel, fit_linear
from rl.sim.presets import GPUS, Assumptions, Preset, gpu_preset
from rl.sim.simulator import SimConfig, SimResult, Simulator
from rl.sim.workload import Workload, WorkloadConfig

__all__ = [
    "GPUS",
    "Assumptions",
    "Preset",
    "SimConfig",
    "SimResult",
    "Simulator",
    "StageModel",
    "Workload",
    "WorkloadConfig",
    "fit_linear",
    "gpu_preset",
]
