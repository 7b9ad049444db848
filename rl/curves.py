"""The learning-curve picture of a run: held-out accuracy and mean reward, SFT phase marked.

    rows = read_metrics("runs/default/metrics.jsonl")
    write_learning_curve_png("runs/default/learning_curve.png", rows, before=0.25, after=0.9)

Reads the rows rl.metrics_writer.MetricsWriter writes: `sft` rows (step = SFT step, `heldout_acc`,
`loss`) and `train` rows (step = round, `reward_mean`, `heldout_acc` after the round when
evaluated). The figure has two panels sharing the accuracy axis: the supervised warm start by
SFT step (shaded), then RL by round.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The rows of a metrics.jsonl file (a missing file: no rows); a torn last line is skipped."""
    if not os.path.exists(path):
        return []
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut by a crash mid-write
                continue
    return rows


def _series(rows: Sequence[Mapping[str, Any]], prefix: str, key: str) -> tuple[list, list]:
    """(steps, values) of `key` in rows of `prefix`, sorted by step, the last row of a step kept."""
    points = {
        int(r["step"]): r[key] for r in rows if r.get("prefix") == prefix and r.get(key) is not None
    }
    steps = sorted(points)
    return steps, [points[s] for s in steps]


def learning_curve_figure(
    rows: Sequence[Mapping[str, Any]],
    *,
    before: float | None = None,
    after: float | None = None,
    first_round: int = 0,
    rounds: int | None = None,
    title: str = "",
) -> Figure:
    """A matplotlib Figure (Agg canvas, 1200 x 450 px): SFT panel left, RL panel right.

    Args:
      rows: metrics.jsonl rows (see the module docstring).
      before: held-out accuracy when RL started (drawn at round `first_round`), if known.
      after: held-out accuracy when RL ended (drawn at round `rounds`), if known.
      first_round: the round RL started from in this process (> 0 after a resume).
      rounds: the run's last round; default: one past the last train row.
      title: the figure title.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12.0, 4.5), dpi=100)
    FigureCanvasAgg(fig)
    sft_ax, rl_ax = fig.subplots(1, 2, sharey=True, gridspec_kw={"width_ratios": [1, 3]})
    sft_steps, sft_acc = _series(rows, "sft", "heldout_acc")
    if sft_steps:
        sft_ax.axvspan(0, sft_steps[-1], color="C7", alpha=0.15)
        sft_ax.plot(sft_steps, sft_acc, "o-", color="C0", markersize=3)
        sft_ax.set_xlim(0, sft_steps[-1])
    else:
        sft_ax.text(0.5, 0.5, "no SFT phase", ha="center", va="center", transform=sft_ax.transAxes)
    sft_ax.set_xlabel("SFT step")
    sft_ax.set_ylabel("held-out accuracy / mean reward")
    sft_ax.set_title("supervised warm start")

    acc_rounds, acc = _series(rows, "train", "heldout_acc")
    acc_x = [r + 1 for r in acc_rounds]  # evaluated after the round
    if before is not None:
        acc_x, acc = [first_round, *acc_x], [before, *acc]
    if after is not None and rounds is not None and (not acc_x or acc_x[-1] != rounds):
        acc_x, acc = [*acc_x, rounds], [*acc, after]
    reward_rounds, reward = _series(rows, "train", "reward_mean")
    rl_ax.plot(reward_rounds, reward, "-", color="C1", linewidth=1, label="mean reward (rollouts)")
    rl_ax.plot(acc_x, acc, "o-", color="C0", markersize=3, label="held-out accuracy (greedy)")
    rl_ax.set_xlabel("RL round")
    rl_ax.set_title("GRPO")
    rl_ax.legend(loc="lower right", fontsize=8)
    for ax in (sft_ax, rl_ax):
        ax.set_ylim(0.0, 1.0)
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.subplots_adjust(left=0.07, right=0.98, bottom=0.13, top=0.85 if title else 0.9, wspace=0.05)
    return fig


def write_learning_curve_png(
    path: str | os.PathLike, rows: Sequence[Mapping[str, Any]], **kw: Any
) -> None:
    """Writes `learning_curve_figure(rows, **kw)` as a PNG to `path`."""
    learning_curve_figure(rows, **kw).savefig(path, format="png")
