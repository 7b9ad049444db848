"""The device-split planner: its choice is within 5% of the best simulated split."""

import pytest

from rl.device_split import Split, candidate_splits, compare, format_table, plan
from rl.sim.compare import sim_config
from rl.sim.presets import gpu_preset
from rl.sim.workload import Workload, WorkloadConfig

WORKLOAD = WorkloadConfig(max_new_tokens=4096, median_tokens=800, runaway_fraction=0.05)


def make(split: Split):
    return gpu_preset("qwen3-1.7b", "h100", sampler_tp=split.tp, learner_gpus=split.learner_gpus)


@pytest.mark.parametrize("budget, mode", [(4, "sync"), (8, "cgp+frontier+fifo"), (12, "sync")])
def test_planner_choice_is_within_5_percent_of_the_best_simulated_split(budget, mode):
    cfg = sim_config(
        mode, groups_per_round=32, groups_per_update=2, group_size=8, max_new_tokens=4096
    )
    choice, rows = compare(budget, make, cfg, Workload(WORKLOAD), rounds=2, tps=(1, 2))
    best = min(r.simulated_s for r in rows)
    chosen = next(r for r in rows if r.split == choice)
    assert chosen.simulated_s <= 1.05 * best, format_table(choice, rows)
    assert "<- planner" in format_table(choice, rows)


def test_splits_and_errors():
    assert [str(s) for s in candidate_splits(3)] == [
        "1 sample (1x tp1) / 2 train",
        "2 sample (2x tp1) / 1 train",
    ]
    assert Split(4, 2, 4).replicas == 2
    with pytest.raises(ValueError, match=r"budget must be >= 2 \(one per side\); received 1"):
        candidate_splits(1)
    cfg = sim_config("sync", groups_per_round=8, group_size=8)

    def too_big(split: Split):
        raise ValueError("does not fit")

    with pytest.raises(ValueError, match="No split of 2 devices fits"):
        plan(2, too_big, cfg, Workload(WORKLOAD))
