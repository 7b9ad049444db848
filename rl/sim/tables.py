"""The simulator comparisons' text tables (what `launch.simulate` prints), one function per table.

Each takes the rows a comparison returns (rl/sim/compare.py, rl/sim/multiplex.py, rl/sim/papers.py)
and gives the table as text: a header line, a line per row, then what the columns mean where the
table has a note. The titles (which setup, which model) are the caller's. The KV layouts' table
and the split planner's sit beside their comparisons (rl.sim.kv_layouts.format_kv_table,
rl.device_split.format_table).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from rl.sim.compare import CHECKPOINT_KINDS
from rl.sim.papers import Headline

Rows = Mapping[str, Mapping[str, Any]]


def format_modes(rows: Rows) -> str:
    """run_modes' rows: per mode the round figures, each vs sync (the first mode) and vs cgp."""
    lines = [
        f"  {'mode':<30}{'U':>4}{'r2t_end s':>10}{'vs sync':>9}{'1st disp s':>11}{'wait':>7}"
        f"{'rollout s':>10}{'train s':>9}{'s/group':>9}{'vs sync':>8}{'long rds':>9}"
        f"{'groups/s':>9}"
        f"{'vs sync':>8}{'vs cgp':>7}{'lag':>6}"
    ]
    cgp = rows.get("cgp+frontier+fifo", {}).get("groups_per_s", float("nan"))
    for m, r in rows.items():
        lines.append(
            f"  {m:<30}{r['groups_per_update']:>4}{r['rollout_to_train_end_s']:>10.2f}{-r['reduction_vs_sync']:>+9.1%}"
            f"{r['first_dispatch_s']:>11.2f}{r['trainer_wait_ratio']:>7.2f}{r['rollout_s']:>10.2f}"
            f"{r['trainer_compute_s']:>9.2f}{r['time_per_group_s']:>9.3f}"
            f"{r['speedup_per_group_vs_sync']:>7.2f}x{r['long_rounds']:>9.0f}"
            f"{r['groups_per_s']:>9.3f}{r['throughput_vs_sync']:>7.2f}x"
            f"{r['groups_per_s'] / cgp:>6.2f}x{r['lag_mean']:>6.2f}"
        )
    lines.append(
        "  U: groups per update (a +fill row's is the smallest whose staleness window, (s + 1) x U "
        "groups, keeps every slot busy); s/group: rollout-to-train-end per trained group, its vs sync: sync's s/group / the "
        "mode's (a speedup); groups/s: groups trained / time between round starts (the throughput; async rounds "
        "overlap, so their r2t, 1st disp and s/group count from a round's first submission, which "
        "precedes the previous round's end); vs cgp: vs cgp+frontier+fifo; lag: mean version lag "
        "(simulated: the version at admission, an upper bound)"
    )
    return "\n".join(lines)


def format_validation(rows: Rows) -> str:
    """validate's rows: per mode the real and simulated headline figures and the error."""
    lines = [
        f"  {'mode':<32}{'real r2t':>9}{'sim r2t':>9}{'error':>8}{'real 1st':>9}{'sim 1st':>9}"
        f"{'real wait':>10}{'sim wait':>9}"
    ]
    for m, r in rows.items():
        lines.append(
            f"  {m:<32}{r['real_rollout_to_train_end_s']:>9.3f}{r['sim_rollout_to_train_end_s']:>9.3f}"
            f"{r['error_rollout_to_train_end_s']:>+8.1%}{r['real_first_dispatch_s']:>9.3f}"
            f"{r['sim_first_dispatch_s']:>9.3f}{r['real_trainer_wait_ratio']:>10.2f}"
            f"{r['sim_trainer_wait_ratio']:>9.2f}"
        )
    return "\n".join(lines)


def format_migration(rows: Rows) -> str:
    """compare_migration's rows: per mode and with migration, throughput and busy replica-seconds."""
    lines = [
        f"  {'mode':<36}{'r2t_end s':>10}{'groups/s':>9}{'vs static':>10}"
        f"{'replica-s busy':>15}{'vs static':>10}{'moves/rd':>9}{'MB/rd':>9}"
    ]
    for name, row in rows.items():
        lines.append(
            f"  {name:<36}{row['rollout_to_train_end_s']:>10.2f}{row['groups_per_s']:>9.3f}"
            f"{row['groups_per_s_vs_static']:>9.2f}x{row['replica_busy_s']:>15.1f}"
            f"{row['busy_vs_static']:>9.2f}x{row['migrations']:>9.1f}{row['migrated_mb']:>9.1f}"
        )
    return "\n".join(lines)


def format_borrowing(rows: Mapping[str, Rows]) -> str:
    """compare_borrowing's rows (mode -> setting -> row): throughput vs the static split, the moves
    each way, and the static split's pooling bound on its first row."""
    lines = [
        f"  {'mode':<26}{'borrowing':<16}{'groups/s':>9}{'vs static':>10}{'moves L/S':>10}"
        f"{'bound':>7}{'pre-drain':>10}"
    ]
    for mode, by in rows.items():
        for i, (b, x) in enumerate(by.items()):
            bound = f"{x['pooling_bound']:>6.2f}x" if i == 0 else ""
            pre = x.get("predrain_bound", math.nan) if i == 0 else math.nan
            lines.append(
                f"  {mode:<26}{b:<16}{x['groups_per_s']:>9.3f}"
                f"{x['throughput_vs_static']:>9.2f}x"
                f"{x['moves_learner']:>6.0f}/{x['moves_sampler']:<4.0f}{bound}"
                + (f"{pre:>9.3f}x" if math.isfinite(pre) else "")
            )
    lines.append(
        "  bound (on the static row): its device-seconds over the device-seconds its "
        "devices worked, the most any borrowing can gain there with free switches"
    )
    lines.append(
        "  pre-drain (round modes): the most a learner borrowing each replica as it goes idle "
        "before the rollout drains could add to one borrowing them all after (predrain_bound)"
    )
    return "\n".join(lines)


def format_checkpoints(
    rows: Mapping[int, Mapping[str, Mapping[str, float]]], intervals: Sequence[int]
) -> str:
    """compare_checkpoints' rows per setup (R -> mode -> "none" | "<kind>/<k>" -> groups/s) for
    checkpoints every k in `intervals`: each checkpointed run's groups/s and its ratio to "none"."""
    names = [f"{kind}/{k}" for k in intervals for kind in CHECKPOINT_KINDS]
    lines = [
        f"  {'setup':<8}{'mode':<22}{'none':>8}"
        + "".join(f"{f'{kind} /{k}':>19}" for k in intervals for kind in CHECKPOINT_KINDS)
    ]
    for r, by_mode in rows.items():
        for m, runs in by_mode.items():
            none = runs["none"]
            cells = [f"{runs[name]:>8.3f} {runs[name] / none:>5.2f}x" for name in names]
            lines.append(f"  R={r:<6}{m:<22}{none:>8.3f}" + "".join(f"{c:>19}" for c in cells))
    return "\n".join(lines)


def format_multiplexing(rows: Mapping[str, Mapping[int, Mapping[str, Any]]]) -> str:
    """compare_multiplexing's rows (mode -> pipelines N -> row): the wall times back to back, on a
    static partition and multiplexed, the ratios, the bound, switches and the learner's busy share."""
    lines = [
        f"  {'mode':<24}{'N':>3}{'back2back s':>12}{'static s':>10}{'muxed s':>9}"
        f"{'vs static':>10}{'vs b2b':>8}{'bound':>7}{'switches':>9}{'learner':>8}"
    ]
    for mode, by in rows.items():
        for n, row in by.items():
            lines.append(
                f"  {mode:<24}{n:>3}{row['back_to_back_s']:>12.0f}{row['static_s']:>10.0f}"
                f"{row['multiplexed_s']:>9.0f}{row['vs_static']:>9.2f}x"
                f"{row['vs_back_to_back']:>7.2f}x{row['bound_vs_static']:>6.2f}x"
                f"{row['replica_switches']:>9.0f}{row['learner_busy']:>8.0%}"
            )
    return "\n".join(lines)


def format_headlines(rows: Mapping[str, Headline]) -> str:
    """papers.headlines' rows: ours beside the paper's, the metric, then our setting below."""
    lines = [f"  {'system':<23}{'ours':>8}{'paper':>8}  metric / our setting"]
    for name, h in rows.items():
        ours = "-" if h.ours is None else f"{h.ours:.3g}"
        lines.append(f"  {name:<23}{ours:>8}{h.paper:>8.3g}  {h.metric}")
        lines.append(f"  {'':<39}{h.setting}")
    return "\n".join(lines)
