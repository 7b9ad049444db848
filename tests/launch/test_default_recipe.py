"""The default recipe, shortened, visibly learns: held-out accuracy rises by >= 10 points."""

import pytest

from configs import default
from rl.run import train


@pytest.mark.slow
def test_default_recipe_learns(tmp_path):
    config = default.get_config()
    config.workdir = str(tmp_path)
    config.rounds = 10
    config.eval.every_rounds = 0
    summary = train(config, stdout=False)
    assert summary["heldout_acc_before"] >= config.sft.target_accuracy  # the warm start reached it
    assert summary["heldout_acc_after"] >= summary["heldout_acc_before"] + 0.10, summary
