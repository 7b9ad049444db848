"""Dense vs paged KV at the same HBM (`launch.simulate --kv_layouts dense,paged`).

A GPU preset (rl/sim/presets.py) sized each way: "dense" reserves max_length (the workload's
prompt + response cap) per slot, so the KV memory left after the weights fits few slots; "paged"
runs up to max_slots sequences on a pool of pages that each takes as it grows (rl/sim/paging.py),
preempting the youngest to host when the pool runs out. Every mode runs on both with the same
workload, replicas and learner; a row gives the sequences in flight per replica (mean while the
replica is busy, and peak), preemptions and seconds spent swapping, the mean round time, groups/s
and decoded tokens/s, each layout's groups/s over the first layout's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rl.sim.compare import fill_factor, sim_config, summarize
from rl.sim.presets import gpu_preset
from rl.sim.simulator import Simulator
from rl.sim.workload import Workload, WorkloadConfig


def compare_kv_layouts(
    layouts: Sequence[str],
    modes: Sequence[str],
    workload: WorkloadConfig,
    *,
    rounds: int,
    model: str = "qwen3-1.7b",
    gpu: str = "h100",
    sampler_tp: int = 1,
    learner_gpus: int = 4,
    **fields: Any,
) -> dict[str, dict[str, dict[str, Any]]]:
    """Simulates each mode on the preset sized for each KV layout.

    Args:
      layouts: rl.sim.presets.KV_LAYOUTS names; the first is the baseline of the ratios.
      modes: mode names (rl.sim.compare.sim_config).
      workload: prompt and response lengths; a dense slot reserves prompt_max + max_new_tokens.
      rounds: rounds per run.
      model, gpu, sampler_tp, learner_gpus: the preset (rl.sim.presets.gpu_preset).
      **fields: SimConfig fields (R, U, G, replicas, max_new_tokens, ...); not slots.

    Returns:
      mode -> layout -> row (slots, kv_pages, in_flight_mean, in_flight_peak, preemptions,
      swap_s, round_s, groups_per_s, tokens_per_s, groups_per_update, vs_<first layout>).
    """
    if not layouts or not modes:
        raise ValueError(
            f"compare_kv_layouts needs layouts and modes; received {layouts}, {modes}."
        )
    if "slots" in fields:
        raise ValueError("compare_kv_layouts sizes the slots from each layout; do not pass slots.")
    max_length = workload.prompt_max + min(
        workload.max_new_tokens, fields.get("max_new_tokens", workload.max_new_tokens)
    )
    presets = {
        layout: gpu_preset(
            model,
            gpu,
            sampler_tp=sampler_tp,
            learner_gpus=learner_gpus,
            kv_layout=layout,
            max_length=max_length,
        )
        for layout in layouts
    }
    factor = fill_factor(workload, fields.get("group_size", 8))
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for mode in modes:
        out[mode] = {}
        for layout, preset in presets.items():
            cfg = sim_config(mode, tail_factor=factor, slots=preset.slots, **dict(fields))
            result = Simulator(cfg, preset.model, Workload(workload)).run(rounds)
            s, c = summarize(result), result.counters
            out[mode][layout] = dict(
                slots=float(preset.slots),
                kv_pages=float(preset.model.kv_pages),
                in_flight_mean=c["seq_s"] / c["replica_busy_s"] if c["replica_busy_s"] else 0.0,
                in_flight_peak=float(c["peak_running"]),
                preemptions=float(c["preemptions"]),
                swap_s=float(c["swap_s"]),
                round_s=sum(float(r["round_s"]) for r in result.rounds) / len(result.rounds),
                groups_per_s=s["groups_per_s"],
                tokens_per_s=c["tokens"] / result.end_s,
                groups_per_update=float(cfg.groups_per_update),
            )
        base = out[mode][layouts[0]]["groups_per_s"]
        for row in out[mode].values():
            row[f"vs_{layouts[0]}"] = row["groups_per_s"] / base
    return out


def format_kv_table(rows: dict[str, dict[str, dict[str, Any]]]) -> str:
    """The comparison as a text table, one line per mode and layout."""
    base = next(iter(next(iter(rows.values()))))
    lines = [
        f"  {'mode':<26}{'layout':<8}{'slots':>6}{'pages':>8}{'U':>4}{'in flight':>10}{'peak':>6}"
        f"{'preempt':>8}{'swap s':>8}{'round s':>9}{'groups/s':>9}{'tok/s':>9}{f'vs {base}':>10}"
    ]
    for mode, by in rows.items():
        for layout, r in by.items():
            lines.append(
                f"  {mode:<26}{layout:<8}{r['slots']:>6.0f}{r['kv_pages']:>8.0f}"
                f"{r['groups_per_update']:>4.0f}{r['in_flight_mean']:>10.1f}"
                f"{r['in_flight_peak']:>6.0f}{r['preemptions']:>8.0f}{r['swap_s']:>8.2f}"
                f"{r['round_s']:>9.1f}{r['groups_per_s']:>9.3f}{r['tokens_per_s']:>9.0f}"
                f"{r[f'vs_{base}']:>9.2f}x"
            )
    lines.append(
        "  per replica: slots (the engine's cap; dense: what max_length per slot leaves), pages "
        "(the paged pool; 0: dense), in flight (mean sequences running while the replica is busy) "
        "and peak; preempt: sequences swapped to host; swap s: replica-seconds copying them out "
        "and back; round s: mean time between round starts; tok/s: decoded tokens over the run"
    )
    return "\n".join(lines)
