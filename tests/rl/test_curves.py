"""The learning-curve picture: panels, series and size."""

import json

import numpy as np

from rl.curves import learning_curve_figure, read_metrics, write_learning_curve_png

ROWS = [
    {"step": 50, "prefix": "sft", "loss": 1.2, "heldout_acc": 0.05},
    {"step": 100, "prefix": "sft", "loss": 0.6, "heldout_acc": 0.3},
    {"step": 0, "prefix": "train", "reward_mean": 0.3},
    {"step": 1, "prefix": "train", "reward_mean": 0.4, "heldout_acc": 0.5},
    {"step": 2, "prefix": "train", "reward_mean": 0.6},
]


def test_figure_has_an_sft_panel_and_an_rl_panel():
    fig = learning_curve_figure(ROWS, before=0.3, after=0.7, rounds=3, title="t")
    sft, rl = fig.axes
    assert (sft.get_xlabel(), rl.get_xlabel()) == ("SFT step", "RL round")
    assert sft.get_ylim() == rl.get_ylim() == (0.0, 1.0)
    (sft_line,) = sft.get_lines()
    np.testing.assert_array_equal(sft_line.get_xdata(), [50, 100])
    np.testing.assert_array_equal(sft_line.get_ydata(), [0.05, 0.3])
    assert sft.patches  # the shaded SFT phase
    lines = {line.get_label(): line for line in rl.get_lines()}
    reward, acc = lines["mean reward (rollouts)"], lines["held-out accuracy (greedy)"]
    np.testing.assert_array_equal(reward.get_xdata(), [0, 1, 2])
    # before RL at round 0, after round 1 (evaluated after it), after RL at round 3
    np.testing.assert_array_equal(acc.get_xdata(), [0, 2, 3])
    np.testing.assert_array_equal(acc.get_ydata(), [0.3, 0.5, 0.7])


def test_png_size_and_read_metrics(tmp_path):
    import matplotlib.image

    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in ROWS) + '\n{"step": 3, "pre')  # torn line
    rows = read_metrics(path)
    assert rows == ROWS
    assert read_metrics(tmp_path / "missing.jsonl") == []
    png = tmp_path / "curve.png"
    write_learning_curve_png(png, rows, before=0.3, after=0.7, rounds=3)
    assert matplotlib.image.imread(png).shape == (450, 1200, 4)


def test_a_run_without_sft_still_draws():
    fig = learning_curve_figure([r for r in ROWS if r["prefix"] == "train"])
    assert len(fig.axes) == 2 and not fig.axes[0].get_lines()
