"""The device-split planner (BiDiRL's static half): how many GPUs sample, how many train.

For a budget of D devices it enumerates the splits (sampler GPUs in replicas of `tp` each, the
rest to the learner), predicts each one's time per round from the stage-time models alone (a few
array operations, no simulation), and picks the fastest. `compare` also simulates every split
(rl/sim) so the choice can be checked against the best simulated split.

The prediction, per round of R groups x G samples (lengths drawn from the workload):
  rollout   the sequences dealt to the replicas in logical order, each replica list-scheduling its
            sequences on its slots (a sequence starts when a slot frees); a replica's time is the
            sum over its decode steps of a + b * active + c * context (the StageModel terms) plus
            one prefill per group; the rollout ends with the slowest replica.
  train     the round's tokens through the learner model: micro-batches and updates.
  round     the schedule's `predict_round_s` (rl.schedules): sync: rollout + train + publish;
            cgp: max(rollout + one update, first batch + train) + publish, the first batch ready
            when U groups' worth of the shortest sequences end; async: see AsyncSchedule.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Callable, Sequence

import numpy as np

from rl.elastic.stage import StageModel
from rl.schedules import SCHEDULES, StageTimes
from rl.sim.presets import Preset
from rl.sim.simulator import SimConfig, Simulator
from rl.sim.workload import Workload
from rl.types import Request, SamplingParams


@dataclasses.dataclass(frozen=True)
class Split:
    sampler_gpus: int
    tp: int  # GPUs per sampler replica
    learner_gpus: int

    @property
    def replicas(self) -> int:
        return self.sampler_gpus // self.tp

    def __str__(self) -> str:
        return (
            f"{self.sampler_gpus} sample ({self.replicas}x tp{self.tp}) / {self.learner_gpus} train"
        )


MakePreset = Callable[[Split], Preset]


def candidate_splits(budget: int, tps: Sequence[int] = (1,)) -> list[Split]:
    """Every split of `budget` devices: sampler GPUs a multiple of tp, at least one each side."""
    if budget < 2:
        raise ValueError(f"A device budget must be >= 2 (one per side); received {budget}.")
    return [
        Split(s, tp, budget - s) for tp in tps for s in range(tp, budget, tp) if budget - s >= 1
    ]


def sample_groups(
    workload: Workload, cfg: SimConfig, rounds: int = 2
) -> list[tuple[int, tuple[int, ...]]]:
    """(prompt length, sample lengths) of `rounds` rounds of the workload, in logical order."""
    stream, out = workload.prompts(), []
    params = SamplingParams(max_new_tokens=cfg.max_new_tokens)
    for r in range(rounds):
        for i in range(cfg.groups_per_round):
            p = next(stream)
            q = Request(
                uid=p.uid,
                round=r,
                index=i,
                prompt=p.tokens,
                group_size=cfg.group_size,
                params=params,
            )
            out.append((len(p.tokens), workload.lengths(q)))
    return out


def _replica_rollout_s(model: StageModel, slots: int, seqs: list[tuple[int, int]]) -> float:
    """List scheduling of (prompt, length) sequences on `slots` slots; the sum of step times."""
    free = [0] * slots  # step at which each slot frees
    starts, ends, prompts = [], [], []
    for p, n in seqs:
        t = heapq.heappop(free)
        starts.append(t)
        ends.append(t + n)
        prompts.append(p)
        heapq.heappush(free, t + n)
    horizon = max(ends, default=0)
    if not horizon:
        return 0.0
    active = np.zeros(horizon + 1)
    context = np.zeros(horizon + 1)
    for s, e, p in zip(starts, ends, prompts, strict=True):
        active[s] += 1
        active[e] -= 1
        context[s] += p - s  # context at step t of this sequence: p + (t - s)
        context[e] -= p - s
    active = np.cumsum(active)[:horizon]
    slope = np.cumsum(context)[:horizon] + active * np.arange(horizon)
    k = model.steps_per_call
    step = model.decode_a + model.decode_b * active + model.decode_c * slope
    return float(step.sum() + (model.call_overhead / k) * horizon)


def predict(
    split: Split, preset: Preset, cfg: SimConfig, groups: Sequence[tuple[int, tuple[int, ...]]]
) -> dict[str, float]:
    """Predicted seconds per round of one split (see the module docstring)."""
    m, r = preset.model, cfg.groups_per_round
    rounds = [groups[i : i + r] for i in range(0, len(groups) - r + 1, r)]
    rollout, train, first = [], [], []
    for rnd in rounds:
        per_replica: list[list[tuple[int, int]]] = [[] for _ in range(split.replicas)]
        for i, (p, lengths) in enumerate(rnd):
            per_replica[i % split.replicas] += [(p, n) for n in lengths]
        prefill = [
            sum(m.prefill_s(p) for p, _ in rnd[i :: split.replicas]) for i in range(split.replicas)
        ]
        rollout.append(
            max(
                _replica_rollout_s(m, preset.slots, seqs) + pre
                for seqs, pre in zip(per_replica, prefill, strict=True)
            )
        )
        t = 0.0
        for b in range(0, r, cfg.groups_per_update):
            t += m.update_total_s(
                [[(p, n) for n in ls] for p, ls in rnd[b : b + cfg.groups_per_update]]
            )
        train.append(t)
        shortest = sorted(max(ls) for _, ls in rnd)[: cfg.groups_per_update]
        first.append(
            max(shortest) * (m.decode_a + m.decode_b * min(preset.slots, r * cfg.group_size))
        )
    roll, tr, fd = (float(np.mean(x)) for x in (rollout, train, first))
    times = StageTimes(
        rollout_s=roll,
        train_s=tr,
        first_batch_s=fd,
        update_s=tr / (r // cfg.groups_per_update),
        publish_s=m.publish_s(),
    )
    round_s = SCHEDULES.get(cfg.mode).predict_round_s(cfg, times)  # the schedule's own formula
    return dict(rollout_s=roll, train_s=tr, round_s=round_s)


def simulate(
    split: Split, preset: Preset, cfg: SimConfig, workload: Workload, rounds: int
) -> float:
    """Simulated seconds per round of one split (mean over `rounds`, publish included)."""
    cfg = dataclasses.replace(cfg, replicas=split.replicas, slots=preset.slots)
    result = Simulator(cfg, preset.model, Workload(workload.cfg)).run(rounds)
    return float(np.mean([x["round_s"] for x in result.rounds]))


@dataclasses.dataclass
class PlanRow:
    split: Split
    predicted_s: float
    simulated_s: float = float("nan")


def plan(
    budget: int,
    make_preset: MakePreset,
    cfg: SimConfig,
    workload: Workload,
    *,
    tps: Sequence[int] = (1,),
    sample_rounds: int = 2,
) -> tuple[Split, list[PlanRow]]:
    """The split with the least predicted time per round, and every split's prediction.

    Args:
      budget: devices to split.
      make_preset: the stage models of a split (one sampler replica, the learner).
      cfg: the run (mode, R, U, G; replicas and slots come from the split and its preset).
      workload: response lengths.
      tps: GPUs per sampler replica to consider.
      sample_rounds: rounds of the workload the prediction averages over.
    """
    groups = sample_groups(workload, cfg, sample_rounds)
    rows = []
    for split in candidate_splits(budget, tps):
        try:
            preset = make_preset(split)
        except ValueError:  # the model does not fit this replica size
            continue
        if preset.slots < cfg.group_size:
            continue
        rows.append(PlanRow(split, predict(split, preset, cfg, groups)["round_s"]))
    if not rows:
        raise ValueError(f"No split of {budget} devices fits the model (tps {tuple(tps)}).")
    return min(rows, key=lambda x: x.predicted_s).split, rows


def compare(
    budget: int,
    make_preset: MakePreset,
    cfg: SimConfig,
    workload: Workload,
    *,
    rounds: int = 3,
    tps: Sequence[int] = (1,),
) -> tuple[Split, list[PlanRow]]:
    """`plan`, then every split simulated for `rounds` rounds (for the table and the check)."""
    choice, rows = plan(budget, make_preset, cfg, workload, tps=tps, sample_rounds=rounds)
    for row in rows:
        row.simulated_s = simulate(row.split, make_preset(row.split), cfg, workload, rounds)
    return choice, rows


def format_table(choice: Split, rows: Sequence[PlanRow]) -> str:
    """The planner's choice beside every split's predicted and simulated time per round."""
    best = min(rows, key=lambda x: x.simulated_s)
    lines = [f"{'split':<28}{'predicted s':>12}{'simulated s':>12}  "]
    for r in rows:
        mark = ("<- planner" if r.split == choice else "") + (
            " <- best simulated" if r.split == best.split else ""
        )
        lines.append(f"{str(r.split):<28}{r.predicted_s:>12.1f}{r.simulated_s:>12.1f}  {mark}")
    chosen = next(r for r in rows if r.split == choice)
    lines.append(
        f"planner's split is {chosen.simulated_s / best.simulated_s - 1:+.1%} vs the best simulated"
    )
    return "\n".join(lines)
