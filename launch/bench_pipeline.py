"""Pipelining: synchronous rounds vs complete-group pipelining (cgp), on real runs of a tiny model.

    python -m launch.bench_pipeline [--json /tmp/bench_pipeline.json] [--rounds 2 --groups 16 ...]

One process, the "tiny" preset (init_std 0.3, float32), a learner mesh and a sampler mesh of one
CPU device each (disjoint; the process asks XLA for 2 host devices, and JAX_PLATFORMS defaults to
cpu). Every mode runs the same workload through rl.driver.Driver, built fresh from the same seeds:
R groups per round of G samples, U groups per update (S = R / U updates per round), a long tail of
response lengths drawn once from --seed and the same every round (so the warm-up round compiles all
the timed rounds run): most groups short (uniform in [--short_min, --short_max]), a
--long_fraction of them (at least one) at the cap --max_new_tokens, at random positions of the
round's logical order (printed: an ordered batch waits for a long group in it). The Driver takes
one SamplingParams for all requests, so a Driver subclass sets each request's max_new_tokens from
the draw; there are no stop tokens, so every response has exactly its drawn length (checked).
Reward: parity of the first response token.
Modes:
  sync                   rollout all R groups, then S updates in logical order (the baseline);
  cgp+{fcfs,frontier}+{fifo,ordered}
                         each complete group goes on the queue at once; an update starts as soon as
                         U groups form a batch (fifo: the next U to complete; ordered: the logical
                         batch k), while the rest of the round still decodes.
Per mode: one warm-up round (compiles; reported, not timed), then --rounds timed rounds, interleaved
across the modes (round r of every mode in turn, the order rotated each round). The table gives
per-mode means of rl.metrics.round_metrics (rollout_to_train_end_s, first_dispatch_s,
trainer_wait_ratio, rollout_s, slot_occupancy) and ratios against sync measured in the same run.
XLA's persistent compilation cache (--compilation_cache) turns the later modes' recompiles of the
same programs into lookups. Expect cgp+*+fifo's first_dispatch_s at most half of sync's (the first
U groups to finish are short), an ordered batch's only when no long group sits in logical batch 0,
and a shorter rollout_to_train_end_s. On a machine with few cores the sampler and learner threads
compete for the same cores (both sides slow down while they overlap), so the gain is well below the
learner's share of a sync round. fcfs and frontier admit in the same order here (one round in
flight, submitted in logical order): same tokens, same schedule; their figures differ by noise.
fifo also tends to pair the long groups (they finish last) into one batch, so it pads fewer
sequences to the longest length bucket than sync and ordered do.
"""

from __future__ import annotations

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
    ).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import dataclasses  # noqa: E402
import functools  # noqa: E402
import hashlib  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

from learner.config import LearnerConfig, OptimizerConfig  # noqa: E402
from learner.learner import Learner  # noqa: E402
from learner.mesh import MeshConfig, make_meshes  # noqa: E402
from learner.publish import DevicePutSync  # noqa: E402
from rl.driver import Driver, DriverConfig, RoundResult  # noqa: E402
from rl.models import create_model, get_preset  # noqa: E402
from rl.types import Completion, Prompt, Request, SamplingParams  # noqa: E402
from sampler.engine import Engine, EngineConfig  # noqa: E402

MODES = (
    "sync",
    "cgp+fcfs+fifo",
    "cgp+fcfs+ordered",
    "cgp+frontier+fifo",
    "cgp+frontier+ordered",
)
METRICS = (
    "rollout_to_train_end_s",
    "first_dispatch_s",
    "trainer_wait_ratio",
    "rollout_s",
    "slot_occupancy",
    "trainer_compute_s",
    "sampler_tokens_per_s",
    "learner_tokens_per_s",
)

_JSON = flags.DEFINE_string("json", "", "Write the results here as JSON; empty: don't.")
_MODES = flags.DEFINE_list("modes", list(MODES), f"Modes to run, from {MODES}; sync is required.")
_ROUNDS = flags.DEFINE_integer("rounds", 2, "Timed rounds per mode (after one warm-up round).")
_GROUPS = flags.DEFINE_integer("groups", 16, "Groups (prompts) per round (R).")
_GROUP_SIZE = flags.DEFINE_integer("group_size", 8, "Samples per group (G).")
_PER_UPDATE = flags.DEFINE_integer("groups_per_update", 2, "Groups per optimizer update (U).")
_SLOTS = flags.DEFINE_integer("slots", 32, "Engine slots (max concurrent sequences).")
_STEPS = flags.DEFINE_integer("steps_per_call", 4, "Decode steps fused into one generate call.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 96, "Length cap: the long tail's length.")
_LONG_FRACTION = flags.DEFINE_float(
    "long_fraction", 0.1, "Fraction of a round's groups at the cap (rounded; at least one)."
)
_SHORT_MIN = flags.DEFINE_integer("short_min", 8, "Shortest response of the other groups.")
_SHORT_MAX = flags.DEFINE_integer("short_max", 16, "Longest response of the other groups.")
_PROMPT_MIN = flags.DEFINE_integer("prompt_min", 4, "Shortest prompt (random byte tokens).")
_PROMPT_MAX = flags.DEFINE_integer("prompt_max", 12, "Longest prompt.")
_LR = flags.DEFINE_float("lr", 1e-3, "Learning rate (AdamW, constant).")
_SEED = flags.DEFINE_integer("seed", 0, "Seeds the workload, the model init and the sampler.")
_CACHE = flags.DEFINE_string(
    "compilation_cache",
    os.environ.get(
        "ROLLOUTPIPE_JAX_CACHE", os.path.join(tempfile.gettempdir(), "rolloutpipe-jax-cache")
    ),
    "XLA persistent compilation cache directory; empty: off.",
)
_GANTT_DIR = flags.DEFINE_string(
    "gantt_dir", "", "Write each mode's timeline (Chrome trace + Gantt PNG) here; empty: don't."
)
_ALL_FLAGS = (
    _MODES,
    _ROUNDS,
    _GROUPS,
    _GROUP_SIZE,
    _PER_UPDATE,
    _SLOTS,
    _STEPS,
    _MAX_NEW,
    _LONG_FRACTION,
    _SHORT_MIN,
    _SHORT_MAX,
    _PROMPT_MIN,
    _PROMPT_MAX,
    _LR,
    _SEED,
    _CACHE,
)


@functools.cache
def response_lengths() -> tuple[int, ...]:
    """Response length per logical index, the same every round: short, a few at the cap.

    One draw for all rounds, so the warm-up round runs every program the timed rounds run: the
    learner compiles one per (length bucket, first update of a round or not), and which bucket the
    first update meets depends on where the long groups sit.
    """
    rng = np.random.default_rng([_SEED.value, 1])
    n = _GROUPS.value
    lengths = rng.integers(_SHORT_MIN.value, _SHORT_MAX.value + 1, n)
    n_long = max(1, round_half_up(_LONG_FRACTION.value * n))
    lengths[rng.choice(n, size=min(n_long, n), replace=False)] = _MAX_NEW.value
    return tuple(int(x) for x in lengths)


def round_half_up(x: float) -> int:
    return int(math.floor(x + 0.5))


def prompts(seed: int) -> Iterator[Prompt]:
    rng = np.random.default_rng(seed)
    for uid in itertools.count():
        n = int(rng.integers(_PROMPT_MIN.value, _PROMPT_MAX.value + 1))
        yield Prompt(uid=uid, tokens=tuple(int(t) for t in rng.integers(0, 256, n)))


def parity_reward(request: Request, completion: Completion) -> float:
    return float(completion.tokens[0] % 2)


class LongTailDriver(Driver):
    """A Driver whose requests take their max_new_tokens from response_lengths()."""

    def _requests(self, round: int) -> list[Request]:
        lengths = response_lengths()
        return [
            dataclasses.replace(
                r, params=dataclasses.replace(r.params, max_new_tokens=int(lengths[r.index]))
            )
            for r in super()._requests(round)
        ]


def driver_config(mode: str) -> DriverConfig:
    """DriverConfig of a mode name: "sync" or "cgp+<admission>+<batching>"."""
    if mode == "sync":
        kind, admission, batching = "sync", "fcfs", "ordered"
    else:
        parts = mode.split("+")
        if len(parts) != 3 or parts[0] != "cgp":
            raise app.UsageError(f"Mode {mode!r}; expected one of {MODES}.")
        kind, admission, batching = parts
    cfg = DriverConfig(
        mode=kind,
        admission=admission,
        batching=batching,
        groups_per_round=_GROUPS.value,
        groups_per_update=_PER_UPDATE.value,
        group_size=_GROUP_SIZE.value,
        sampling=SamplingParams(temperature=1.0, max_new_tokens=_MAX_NEW.value),
    )
    if cfg.name != mode:
        raise app.UsageError(f"Mode {mode!r} builds a driver named {cfg.name!r}.")
    return cfg


def build(mode: str, max_length: int, max_prefill: int) -> tuple[LongTailDriver, Engine]:
    """Fresh model, learner, engine, weight sync and driver; the same seeds for every mode."""
    learner_mesh, sampler_mesh = make_meshes(MeshConfig(learner_devices=1, sampler_devices=1))
    model = create_model(get_preset("tiny", init_std=0.3), seed=_SEED.value)
    learner = Learner(
        model,
        LearnerConfig(
            optimizer=OptimizerConfig(lr=_LR.value),
            micro_batch_rows=_PER_UPDATE.value * _GROUP_SIZE.value,
        ),
        mesh=learner_mesh,
        seed=_SEED.value,
    )
    engine = Engine(
        model,
        EngineConfig(
            max_slots=_SLOTS.value,
            max_length=max_length,
            max_prefill_length=max_prefill,
            steps_per_call=_STEPS.value,
            seed=_SEED.value,
        ),
        mesh=sampler_mesh,
    )
    driver = LongTailDriver(
        driver_config(mode),
        engine=engine,
        learner=learner,
        weight_sync=DevicePutSync(learner.params, sampler_mesh),
        prompts=prompts(_SEED.value),
        reward_fn=parity_reward,
    )
    return driver, engine


def compile_counts(driver: Driver, engine: Engine) -> dict[str, int]:
    """Programs compiled so far by the engine's and the learner's jitted entry points."""
    counts = {f"engine.{k}": v for k, v in engine.compile_counts().items()}
    for name in ("_zero", "_accumulate", "_apply", "_copy"):
        fn = getattr(driver.learner, name, None)
        if hasattr(fn, "_cache_size"):
            counts[f"learner.{name.lstrip('_')}"] = fn._cache_size()
    return counts


def check_round(result: RoundResult) -> str:
    """Checks every group was trained with its drawn lengths; returns a digest of the tokens."""
    lengths = response_lengths()
    if sorted(g.request.index for g in result.groups) != list(range(_GROUPS.value)):
        raise RuntimeError(
            f"Round {result.round} trained indices {[g.request.index for g in result.groups]}; "
            f"expected each of 0..{_GROUPS.value - 1} once."
        )
    digest = hashlib.sha256()
    for g in sorted(result.groups, key=lambda g: g.request.index):
        got = {len(c.tokens) for c in g.completions}
        if got != {int(lengths[g.request.index])}:
            raise RuntimeError(
                f"Round {result.round} index {g.request.index}: response lengths {sorted(got)}; "
                f"expected {int(lengths[g.request.index])} (no stop tokens)."
            )
        for c in g.completions:
            digest.update(np.asarray(c.tokens, np.int64).tobytes())
    return digest.hexdigest()[:16]


def run_modes(modes: list[str], max_length: int, max_prefill: int) -> dict[str, dict[str, Any]]:
    """Fresh objects per mode, one warm-up round each, then the timed rounds interleaved.

    Timed round r runs every mode in turn, the order rotated by one each round, so a drift in the
    machine's speed (others' load, clocks) spreads over the modes instead of favouring the last.
    """
    built: dict[str, tuple[LongTailDriver, Engine]] = {}
    warmup_s, compiles_warm, results = {}, {}, {m: [] for m in modes}
    try:
        for m in modes:
            start = time.perf_counter()
            built[m] = driver, engine = build(m, max_length, max_prefill)
            check_round(driver.run_round(0))
            warmup_s[m] = time.perf_counter() - start
            compiles_warm[m] = compile_counts(driver, engine)
            print(f"{m}: built and warmed up in {warmup_s[m]:.1f} s", flush=True)
        for r in range(1, _ROUNDS.value + 1):
            k = (r - 1) % len(modes)
            for m in modes[k:] + modes[:k]:
                results[m].append(built[m][0].run_round(r))
    finally:
        for driver, _ in built.values():
            driver.close()
    out = {}
    for m, (driver, engine) in built.items():
        if _GANTT_DIR.value:
            os.makedirs(_GANTT_DIR.value, exist_ok=True)
            stem = os.path.join(_GANTT_DIR.value, m.replace("+", "_"))
            driver.timeline.write_chrome_trace(stem + ".json")
            driver.timeline.write_gantt_png(stem + ".png", title=f"{m}: warm-up + timed rounds")
        per_round = {k: [r.metrics[k] for r in results[m]] for k in METRICS}
        compiles = compile_counts(driver, engine)
        out[m] = dict(
            **{k: float(np.mean(v)) for k, v in per_round.items()},
            per_round=per_round,
            warmup_s=warmup_s[m],
            digests=[check_round(r) for r in results[m]],
            reward_mean=float(np.mean([r.metrics["reward_mean"] for r in results[m]])),
            loss=float(np.mean([r.metrics["loss"] for r in results[m]])),
            first_batch_indices=[
                sorted(g.request.index for g in r.groups[: _PER_UPDATE.value]) for r in results[m]
            ],
            compile_counts=compiles,
            new_compiles_while_timed=sum(compiles.values()) - sum(compiles_warm[m].values()),
        )
    return out


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    modes = _MODES.value
    if "sync" not in modes or any(m not in MODES for m in modes):
        raise app.UsageError(f"--modes={modes}; expected some of {MODES}, sync among them.")
    if _SLOTS.value < _GROUP_SIZE.value or _ROUNDS.value < 1:
        raise app.UsageError(
            f"--slots ({_SLOTS.value}) must be >= --group_size ({_GROUP_SIZE.value}) and "
            f"--rounds ({_ROUNDS.value}) >= 1."
        )
    if not 1 <= _SHORT_MIN.value <= _SHORT_MAX.value <= _MAX_NEW.value:
        raise app.UsageError("Expected 1 <= --short_min <= --short_max <= --max_new_tokens.")
    if not 1 <= _PROMPT_MIN.value <= _PROMPT_MAX.value:
        raise app.UsageError("Expected 1 <= --prompt_min <= --prompt_max.")
    for m in modes:
        driver_config(m)  # a bad --groups / --groups_per_update fails here, before any compile
    if _CACHE.value:
        jax.config.update("jax_compilation_cache_dir", _CACHE.value)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    max_prefill = max(16, _PROMPT_MAX.value)
    max_length = max_prefill + _MAX_NEW.value

    total_start = time.perf_counter()
    out = run_modes(modes, max_length, max_prefill)
    total_s = time.perf_counter() - total_start

    base = out["sync"]
    for r in out.values():
        r["rollout_to_train_end_reduction"] = 1.0 - (
            r["rollout_to_train_end_s"] / base["rollout_to_train_end_s"]
        )
        r["speedup_vs_sync"] = base["rollout_to_train_end_s"] / r["rollout_to_train_end_s"]
        r["first_dispatch_ratio"] = r["first_dispatch_s"] / base["first_dispatch_s"]
        r["same_tokens_as_sync"] = r["digests"] == base["digests"]

    all_lengths = np.asarray(response_lengths())
    long_at = [int(i) for i in np.flatnonzero(all_lengths == _MAX_NEW.value)]
    print(
        f"workload: {_GROUPS.value} groups x {_GROUP_SIZE.value} samples per round, U = "
        f"{_PER_UPDATE.value} ({_GROUPS.value // _PER_UPDATE.value} updates), {_SLOTS.value} "
        f"slots, {_STEPS.value} steps per call; response lengths median "
        f"{np.median(all_lengths):.0f}, mean {all_lengths.mean():.1f}, cap {_MAX_NEW.value} at "
        f"logical indices {long_at}; {_ROUNDS.value} timed round(s) per mode; "
        f"backend {jax.default_backend()}, {os.cpu_count()} CPU cores"
    )
    print(
        f"{'mode':<22}{'r2t_end s':>10}{'vs sync':>9}{'1st disp s':>11}{'ratio':>7}"
        f"{'wait':>7}{'rollout s':>10}{'train s':>9}{'slot occ':>9}{'warm-up s':>10}"
    )
    for m, r in out.items():
        print(
            f"{m:<22}{r['rollout_to_train_end_s']:>10.3f}"
            f"{-r['rollout_to_train_end_reduction']:>+9.1%}{r['first_dispatch_s']:>11.3f}"
            f"{r['first_dispatch_ratio']:>7.2f}{r['trainer_wait_ratio']:>7.2f}"
            f"{r['rollout_s']:>10.3f}{r['trainer_compute_s']:>9.3f}{r['slot_occupancy']:>9.2f}"
            f"{r['warmup_s']:>10.1f}"
        )
    print(
        "r2t_end: rollout start -> last update's end (round mean); vs sync: its change; 1st disp: "
        "rollout start -> first learner span; ratio: vs sync; wait: trainer_wait_ratio; train s: "
        "learner busy time in the window"
    )
    for m, r in out.items():
        print(
            f"{m:<22}first batch (logical indices) {r['first_batch_indices']}, tokens same as "
            f"sync: {r['same_tokens_as_sync']}, new compiles while timed: "
            f"{r['new_compiles_while_timed']}, r2t_end per round "
            f"{[round(x, 3) for x in r['per_round']['rollout_to_train_end_s']]}"
        )
    print(f"total (all modes, warm-ups included): {total_s:.1f} s")

    if _JSON.value:
        result = dict(
            modes=out,
            config=dict(
                {f.name: f.value for f in _ALL_FLAGS},
                model="tiny",
                init_std=0.3,
                dtype="float32",
                max_length=max_length,
                max_prefill_length=max_prefill,
                mesh=dict(learner_devices=1, sampler_devices=1),
                backend=jax.default_backend(),
                devices=jax.device_count(),
                cpu_count=os.cpu_count(),
                lengths=list(response_lengths()),
                long_at=long_at,
                total_s=total_s,
            ),
        )
        with open(_JSON.value, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {_JSON.value}")


if __name__ == "__main__":
    app.run(main)
