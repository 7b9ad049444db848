"""The default recipe on two seeds: the warm start leaves the SFT plateau within a fixed budget,
then a shortened RL phase visibly learns. The recipe before the operand order and optimizer fix
failed the budget on both seeds (seed 0 left the plateau at ~1400 steps, seed 1 after 675)."""

import pytest

from configs import default
from rl.run import train

# steps; seeds 0 / 1 reached the 50% target in 325 / 425 (seeds 0-4: 325-1075, README; the cap is
# 2000): where the plateau ends moves with float rounding, so the budget leaves room for that.
SFT_BUDGET = 1000
# 30 RL rounds gained +12 / +15.5 / +14.5 / +19.5 / +21.5 points on seeds 0-4 (seed 0: 56% -> 68%)
# with 16-row micro-batches (+12 / +15.5 / +14.5 / +20 / +21.5 with 64), and +21 / +29.5 on seeds
# 0 / 1 before sequence packing and the new attention path changed the rounding: the trajectory
# moves with float rounding, so the bar leaves room for that.
MIN_GAIN = 0.08


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
def test_default_recipe_leaves_the_plateau_and_learns(tmp_path, seed):
    config = default.get_config()
    config.workdir = str(tmp_path)
    config.seed = seed
    config.sft.max_steps = SFT_BUDGET
    config.rounds = 30
    config.learner.optimizer.warmup_steps = (
        10  # of the 120 updates; the cosine decays over the rest
    )
    config.eval.every_rounds = 0
    summary = train(config, stdout=False)
    assert summary["sft_steps"] < SFT_BUDGET, summary  # stopped on reaching the target
    assert summary["heldout_acc_before"] >= config.sft.target_accuracy, summary
    assert summary["heldout_acc_after"] >= summary["heldout_acc_before"] + MIN_GAIN, summary
