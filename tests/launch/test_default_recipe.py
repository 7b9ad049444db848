"""The default recipe, shortened, visibly learns: held-out accuracy rises by >= 10 points."""

import pytest

from configs import default
from rl.run import train


@pytest.mark.slow
def test_default_recipe_learns(tmp_path):
    config = default.get_config()
    config.workdir = str(tmp_path)
    config.rounds = 30  # 27.5% -> 42% measured; 20 rounds without warmup only reach 29%
    config.learner.optimizer.warmup_steps = (
        10  # of the 120 updates; the cosine decays over the rest
    )
    config.eval.every_rounds = 0
    summary = train(config, stdout=False)
    assert summary["heldout_acc_before"] >= config.sft.target_accuracy  # the warm start reached it
    assert summary["heldout_acc_after"] >= summary["heldout_acc_before"] + 0.10, summary
