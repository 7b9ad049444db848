"""Sequence packing over a run: packed vs unpacked learners on long-tailed lengths, compiles counted.

    python -m launch.bench_learner --run_updates 200 --json /tmp/bench_learner.json  # runs it

Three Learners of one model (the "tiny" preset widened to d_model 128, float32, one device):
`packed` (the defaults: learner.packing, and an update's last micro-batch on a flush shape of half
the token budget when that holds it), `no_flush` (packed, learner.flush_halvings 0: the last
micro-batch takes the whole budget) and `unpacked` (one sequence per row, padded to its
power-of-two row length). Each compiles its programs at start (Learner.precompile: every
micro-batch shape of the config, the optimizer update), timed, and runs one untimed update (the
host's eager ops compile); then `updates` updates, each on fresh random groups (groups x
group_size completions, prompts of 16-48 tokens, responses drawn from a lognormal of median
`median` and sigma `sigma`, clipped to [1, max_response]: the long tail of RL responses), the
three in rotating order on the same groups so the machine's load falls on each.
Reported: warm tokens/s (loss tokens over the updates' wall time) and over the whole run including
the start compiles, as packed / unpacked and packed / no_flush ratios; compiles after start (must
be 0) and the distinct programs of each learner; the padded fraction of the model positions; the
spread of the ratios over the run (min / median / max of 10-update windows). Nothing may compile
while the updates run (compiles timed, launch/bench_util.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import statistics
import time
from typing import Any

import jax
import numpy as np

from launch.bench_util import CompileWatch
from learner.config import LearnerConfig, OptimizerConfig
from learner.learner import Learner
from learner.mesh import MeshConfig, make_meshes
from rl.models import create_model, get_preset
from rl.types import Completion, Group, Request, SamplingParams

PROMPT_TOKENS = (16, 48)  # prompt lengths are drawn uniformly from this range
# each learner's LearnerConfig beyond the workload's (module docstring)
CONTESTANTS = {
    "packed": {},
    "no_flush": {"flush_halvings": 0},
    "unpacked": {"packing": False},
}


def long_tail_groups(
    rng: np.random.Generator,
    *,
    groups: int,
    group_size: int,
    vocab: int,
    max_response: int,
    median: float,
    sigma: float,
    uid: int,
) -> list[Group]:
    """Random complete groups with lognormal response lengths; log-probs near uniform's."""
    out = []
    for g in range(groups):
        prompt = tuple(int(t) for t in rng.integers(1, vocab, rng.integers(*PROMPT_TOKENS)))
        request = Request(
            uid=uid + g, prompt=prompt, group_size=group_size, params=SamplingParams()
        )
        lengths = np.clip(np.round(rng.lognormal(math.log(median), sigma, group_size)), 1, None)
        completions = tuple(
            Completion(
                uid=uid + g,
                round=0,
                sample=i,
                versions=(0,) * min(int(n), max_response),
                prompt=prompt,
                tokens=tuple(int(t) for t in rng.integers(1, vocab, min(int(n), max_response))),
                logprobs=tuple(
                    float(x)
                    for x in -math.log(vocab) + rng.normal(0, 0.1, min(int(n), max_response))
                ),
                reward=float(rng.integers(0, 2)),
                finish_reason="stop",
            )
            for i, n in enumerate(np.minimum(lengths, max_response).astype(int))
        )
        out.append(Group(request=request, completions=completions))
    return out


def run_workload(
    *,
    updates: int,
    groups: int = 16,
    group_size: int = 8,
    max_response: int = 448,
    median: float = 24.0,
    sigma: float = 1.0,
    rows: int = 2,
    min_length_bucket: int = 64,
    d_model: int = 128,
    seed: int = 0,
    watch: CompileWatch | None = None,
) -> dict[str, Any]:
    """Packed vs unpacked learners over `updates` updates of fresh long-tailed groups; the updates
    are booked as timed in `watch` (if given), whose compiles_timed must not grow."""
    preset = dataclasses.replace(get_preset("tiny"), d_model=d_model, dtype="float32")
    model = create_model(preset, seed=seed)
    mesh, _ = make_meshes(MeshConfig(learner_devices=1, learner_tp=1, colocated=True))
    cfg = LearnerConfig(
        optimizer=OptimizerConfig(lr=1e-4),
        micro_batch_rows=rows,
        min_length_bucket=min_length_bucket,
        max_length=PROMPT_TOKENS[1] + max_response,
        old_logprobs="sampler",
    )
    learners, start_s = {}, {}
    for name, overrides in CONTESTANTS.items():
        learner = Learner(model, dataclasses.replace(cfg, **overrides), mesh=mesh)
        t = time.perf_counter()
        learner.precompile(updates_per_round=1)
        start_s[name] = time.perf_counter() - t
        learner.compiles.start()
        learner.begin_round(updates=1 << 30)
        learners[name] = learner
    draw = lambda rng, uid: long_tail_groups(  # noqa: E731
        rng,
        groups=groups,
        group_size=group_size,
        vocab=preset.vocab_size,
        max_response=max_response,
        median=median,
        sigma=sigma,
        uid=uid,
    )
    # One untimed update each on groups of their own: the host's eager ops (GRPO advantages,
    # staging) compile here, not in the first timed update.
    warm = draw(np.random.default_rng(seed + 1), updates * groups)
    for learner in learners.values():
        learner.add_groups(warm)
        learner.update()
    rng = np.random.default_rng(seed)
    seconds: dict[str, list[float]] = {n: [] for n in CONTESTANTS}
    tokens: list[float] = []
    positions = dict.fromkeys(CONTESTANTS, 0)
    real = 0
    timed_before = watch.compiles_timed if watch else 0
    names = list(CONTESTANTS)
    for k in range(updates):
        batch = draw(rng, k * groups)
        lengths = [len(c.prompt) + len(c.tokens) - 1 for g in batch for c in g.completions]
        real += sum(lengths)
        for name in names[k % 3 :] + names[: k % 3]:  # rotating order
            learner = learners[name]
            with watch.timed() if watch else contextlib.nullcontext():
                t = time.perf_counter()
                learner.add_groups(batch)
                metrics = learner.update()
                seconds[name].append(time.perf_counter() - t)
            positions[name] += int(metrics["positions"])
        tokens.append(metrics["tokens"])
    total_tokens = sum(tokens)
    warm = {n: total_tokens / sum(s) for n, s in seconds.items()}
    whole = {n: total_tokens / (sum(s) + start_s[n]) for n, s in seconds.items()}

    def windows(baseline: str) -> dict[str, float]:
        """packed / baseline tokens/s over each 10 updates: min / median / max."""
        ratios = [
            sum(seconds[baseline][i : i + 10]) / sum(seconds["packed"][i : i + 10])
            for i in range(0, updates - 9, 10)
        ]
        if not ratios:
            return dict.fromkeys(("min", "median", "max"), float("nan"))
        return {"min": min(ratios), "median": statistics.median(ratios), "max": max(ratios)}

    programs = {
        n: sum(v for k, v in learner.compile_counts().items()) for n, learner in learners.items()
    }
    return {
        "packing_speedup": warm["packed"] / warm["unpacked"],
        "packing_speedup_with_compiles": whole["packed"] / whole["unpacked"],
        "packing_speedup_windows": windows("unpacked"),
        "flush_speedup": warm["packed"] / warm["no_flush"],
        "flush_speedup_windows": windows("no_flush"),
        "compiles_after_start": int(
            sum(sum(lr.compiles.after_start().values()) for lr in learners.values())
        ),
        "compiles_timed": (watch.compiles_timed - timed_before) if watch else None,
        "learner_programs": programs,
        "row_lengths": list(learners["packed"].micro_batches.lengths),
        "padded_fraction": {n: 1.0 - real / p for n, p in positions.items()},
        "tokens_per_s": warm,
        "tokens_per_s_with_compiles": whole,
        "start_compile_s": start_s,
        "updates_s": {n: sum(s) for n, s in seconds.items()},
        "loss_tokens": total_tokens,
        "config": dict(
            updates=updates,
            groups=groups,
            group_size=group_size,
            max_response=max_response,
            tail_median=median,
            tail_sigma=sigma,
            micro_batch_rows=rows,
            min_length_bucket=min_length_bucket,
            d_model=d_model,
            seed=seed,
            backend=jax.default_backend(),
        ),
    }


def print_table(r: dict[str, Any]) -> None:
    c = r["config"]
    print(
        f"workload: {c['updates']} updates x {c['groups']} groups x G={c['group_size']}, prompts "
        f"{PROMPT_TOKENS[0]}-{PROMPT_TOKENS[1]} tokens, responses lognormal(median "
        f"{c['tail_median']:g}, sigma {c['tail_sigma']:g}) <= {c['max_response']}; tiny d_model "
        f"{c['d_model']}, {c['micro_batch_rows']} rows x {r['row_lengths']} positions"
    )
    print(
        f"{'learner':<10}{'start compile s':>16}{'updates s':>11}{'tokens/s':>10}"
        f"{'with compiles':>15}{'padded':>8}{'programs':>10}"
    )
    for n in CONTESTANTS:
        print(
            f"{n:<10}{r['start_compile_s'][n]:>16.1f}{r['updates_s'][n]:>11.1f}"
            f"{r['tokens_per_s'][n]:>10.0f}{r['tokens_per_s_with_compiles'][n]:>15.0f}"
            f"{r['padded_fraction'][n]:>8.1%}{r['learner_programs'][n]:>10}"
        )
    w = r["packing_speedup_windows"]
    print(
        f"packed / unpacked: {r['packing_speedup']:.2f}x warm (10-update windows: min "
        f"{w['min']:.2f} / median {w['median']:.2f} / max {w['max']:.2f}), "
        f"{r['packing_speedup_with_compiles']:.2f}x with the start compiles"
    )
    w = r["flush_speedup_windows"]
    print(
        f"packed / no_flush: {r['flush_speedup']:.2f}x warm (10-update windows: min "
        f"{w['min']:.2f} / median {w['median']:.2f} / max {w['max']:.2f}); compiles after "
        f"start: {r['compiles_after_start']} (learners' counters), compiles timed: "
        f"{r['compiles_timed']} (any XLA program)"
    )
