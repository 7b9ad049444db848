"""Pipelining: synchronous rounds vs complete-group pipelining (cgp), on real runs of a tiny model.

    python -m launch.bench_pipeline [--json /tmp/bench_pipeline.json] [--rounds 2 --groups 16 ...]

One process, the "tiny" preset (init_std 0.3, float32), a learner mesh and a sampler mesh of one
CPU device each (disjoint; the process asks XLA for 2 host devices, and JAX_PLATFORMS defaults to
cpu). Every mode runs the same workload through rl.driver.Driver, built fresh from the same seeds:
R groups per round of G samples, U groups per update (S = R / U updates per round), a long tail of
response lengths that belongs to the prompt (RollPacker's premise: a prompt that runs long runs long
again): each prompt's length is drawn from (--seed, its uid): at the cap --max_new_tokens with
probability --long_fraction, else uniform in [--short_min, --short_max]. Every mode trains the same
epoch of R * (--rounds + 1) prompts. Each prompt carries its drawn length as its max_new_tokens
(rl.types.Prompt); there are no stop tokens, so every response has exactly its drawn length
(checked). Reward: parity of the first response token.
Modes:
  sync                   rollout all R groups, then S updates in logical order (the baseline);
  cgp+{fcfs,frontier}+{fifo,ordered}
                         each complete group goes on the queue at once; an update starts as soon as
                         U groups form a batch (fifo: the next U to complete; ordered: the logical
                         batch k), while the rest of the round still decodes.
  sync+tail, cgp+frontier+tail
                         tail batching (rl/round_planner.py): short rounds launch ceil(--eta * R) prompts
                         and train the first R to complete, the rest wait in the long-prompt queue
                         until R of them make a long round; the epoch ends with a flush round.
                         cgp+frontier+tail forms batches in completion order (stream trainer).
  async+{frontier,fcfs,shuffled}+s{1,2}
                         bounded staleness (rl/schedules/asynchronous.py): weights published after
                         every update and swapped into the running engine between decode steps;
                         the sampler runs up to s versions ahead. fcfs admits in arrival order, which
                         here is logical order (as frontier); shuffled is FCFS over requests that
                         arrive in a random order (asynchronous clients), where frontier differs.
                         These run their rounds back to back after the interleaved modes.
  async+{fcfs,shuffled}+s2+per-sample
                         the same with per-sample admission (DriverConfig.group_atomic=False: the
                         G samples of a prompt start one by one as slots free, one prefill each,
                         as slime/SGLang do), the baseline of group-atomic frontier dispatch.
  async+frontier+s2+recompute
                         recompute_kv=True (AReaL interruptible generation): at each weight swap the
                         running samples are re-prefilled (prompt + tokens so far) with the new
                         weights instead of continuing with the old KV cache.
Modes run one at a time (each mode's compiled programs hold thousands of memory maps; all modes
alive at once pass vm.max_map_count and LLVM aborts): build the runtime (the learner and the
engine compile every program a run calls at build: rl/compiles.py), then --repeats runs of the
epoch, each a fresh Driver from the same initial learner state, its round 0 not timed (repeat 0's compiles), the rest of the epoch timed (--rounds rounds for the plain modes;
as many as the tail modes' planner makes); then close the mode and release what it held. Any XLA
compile inside a timed round makes the program exit non-zero after its table (compiles timed: 0).
The table gives per-mode medians over the repeats of the round means of rl.metrics.round_metrics
(rollout_to_train_end_s, first_dispatch_s, trainer_wait_ratio, rollout_s, slot_occupancy) with the
min-max of rollout_to_train_end_s over the repeats, and ratios of medians against sync; a second
table compares time per trained group (the timed rounds' summed rollout_to_train_end_s / the groups
they trained): tail_speedup_vs_sync = sync's / the mode's, and the longest trained response of short
rounds. Modes ran minutes apart, so a slow spell of a shared machine falls on some modes only: read
a difference between modes as signal when their min-max ranges do not overlap.
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

from launch import bench_env  # before jax: two CPU devices

# isort: split

import functools  # noqa: E402
import hashlib  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

from launch import bench_util, pipeline_report  # noqa: E402
from rl.driver import Driver, DriverConfig, RoundResult  # noqa: E402
from rl.round_planner import TailConfig  # noqa: E402
from rl.runtime.compose import Setup
from rl.runtime.threads import ThreadsRuntime  # noqa: E402
from rl.schedules import mode_fields  # noqa: E402
from rl.types import Completion, Prompt, Request, SamplingParams  # noqa: E402

MODES = (
    "sync",
    "cgp+fcfs+fifo",
    "cgp+fcfs+ordered",
    "cgp+frontier+fifo",
    "cgp+frontier+ordered",
    "sync+tail",
    "cgp+frontier+tail",
    "async+frontier+s1",
    "async+frontier+s2",
    "async+fcfs+s2",
    "async+shuffled+s2",
    "async+fcfs+s2+per-sample",
    "async+shuffled+s2+per-sample",
    "async+frontier+s2+recompute",
)
# An async mode's optional suffix and the DriverConfig field it sets.
SUFFIXES = {"+per-sample": ("group_atomic", False), "+recompute": ("recompute_kv", True)}
METRICS = (
    "rollout_to_train_end_s",
    "first_dispatch_s",
    "trainer_wait_ratio",
    "rollout_s",
    "slot_occupancy",
    "trainer_compute_s",
    "sampler_tokens_per_s",
    "learner_tokens_per_s",
    "lag_mean",
    "lag_max",
    "ess",
    "logprob_diff_abs",
)

_JSON = flags.DEFINE_string("json", "", "Write the results here as JSON; empty: don't.")
_MODES = flags.DEFINE_list("modes", list(MODES), f"Modes to run, from {MODES}; sync is required.")
_ROUNDS = flags.DEFINE_integer(
    "rounds", 6, "Timed rounds of the plain modes (after one warm-up round); epoch = R*(rounds+1)."
)
_REPEATS = flags.DEFINE_integer(
    "repeats", 3, "Runs of each mode's epoch (fresh Driver, same initial weights); medians count."
)
_ETA = flags.DEFINE_float("eta", 1.25, "Tail modes: short rounds launch ceil(eta * R) prompts.")
_GROUPS = flags.DEFINE_integer("groups", 16, "Groups (prompts) per round (R).")
_GROUP_SIZE = flags.DEFINE_integer("group_size", 8, "Samples per group (G).")
_PER_UPDATE = flags.DEFINE_integer("groups_per_update", 2, "Groups per optimizer update (U).")
_SLOTS = flags.DEFINE_integer(
    "slots",
    160,
    "Engine slots (max concurrent sequences); 160 holds a whole short round (ceil(1.25*16)*8), as "
    "a GPU engine would; fewer make rounds slot-bound (see the README).",
)
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
_CACHE = flags.DEFINE_string("compilation_cache", bench_env.DEFAULT_CACHE, bench_env.CACHE_HELP)
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
    _ETA,
    _REPEATS,
)


@functools.cache
def response_length(uid: int) -> int:
    """The response length of prompt `uid`: the cap with probability --long_fraction, else short."""
    rng = np.random.default_rng([_SEED.value, 1, uid])
    if rng.random() < _LONG_FRACTION.value:
        return _MAX_NEW.value
    return int(rng.integers(_SHORT_MIN.value, _SHORT_MAX.value + 1))


def epoch_size() -> int:
    return _GROUPS.value * (_ROUNDS.value + 1)


def prompts(seed: int) -> Iterator[Prompt]:
    rng = np.random.default_rng(seed)
    for uid in itertools.count():
        n = int(rng.integers(_PROMPT_MIN.value, _PROMPT_MAX.value + 1))
        tokens = tuple(int(t) for t in rng.integers(0, 256, n))
        # each prompt's drawn response length caps its requests (rl.round_planner.RoundPlan.requests)
        yield Prompt(uid=uid, tokens=tokens, max_new_tokens=response_length(uid))


def parity_reward(request: Request, completion: Completion) -> float:
    return float(completion.tokens[0] % 2)


def driver_config(mode: str) -> DriverConfig:
    """DriverConfig of a mode name (rl.schedules.mode_fields: "sync", "cgp+<admission>+<batching>",
    "sync+tail", "cgp+<admission>+tail", "async+<admission>+s<max_staleness>"), an async one
    optionally with one suffix of SUFFIXES ("+per-sample": group_atomic=False, "+recompute":
    recompute_kv=True)."""
    suffix = next((x for x in SUFFIXES if mode.startswith("async+") and mode.endswith(x)), "")
    try:
        fields = mode_fields(mode.removesuffix(suffix) if suffix else mode)
    except ValueError as e:
        raise app.UsageError(str(e)) from None
    tail = fields.pop("tail_enabled")
    cfg = DriverConfig(
        **fields,
        groups_per_round=_GROUPS.value,
        groups_per_update=_PER_UPDATE.value,
        group_size=_GROUP_SIZE.value,
        sampling=SamplingParams(temperature=1.0, max_new_tokens=_MAX_NEW.value),
        tail=TailConfig(enabled=tail, eta=_ETA.value),
        epoch_size=epoch_size(),
        **dict([SUFFIXES[suffix]] if suffix else []),
    )
    if cfg.name + suffix != mode:
        raise app.UsageError(f"Mode {mode!r} builds a driver named {cfg.name!r}.")
    return cfg


def build(max_length: int, max_prefill: int, cfg: DriverConfig) -> ThreadsRuntime:
    """A fresh runtime (rl.runtime.compose: model, learner, engine, weight sync) for this
    workload and mode, every program compiled (re-prefills with cfg.recompute_kv); the same seeds
    for every mode. Close its drivers, then it."""
    config = bench_env.tiny_config(
        seed=_SEED.value,
        lr=_LR.value,
        micro_batch_rows=_PER_UPDATE.value * _GROUP_SIZE.value,
        slots=_SLOTS.value,
        max_length=max_length,
        max_prefill=max_prefill,
        steps_per_call=_STEPS.value,
    )
    config.driver.recompute_kv = cfg.recompute_kv
    return ThreadsRuntime(config, Setup.from_config(config), total_updates=0)


def compile_counts(runtime: ThreadsRuntime) -> dict[str, int]:
    """Programs compiled so far by the engine's and the learner's jitted entry points."""
    counts = {f"engine.{k}": v for k, v in runtime.engine.compile_counts().items()}
    counts.update({f"learner.{k}": v for k, v in runtime.learner.compile_counts().items()})
    return counts


def check_round(result: RoundResult, tail: bool) -> str:
    """Checks each group has its prompt's drawn length (plain rounds: every index once); returns
    a digest of the tokens."""
    n = len(result.groups)
    if not tail and sorted(g.request.index for g in result.groups) != list(range(_GROUPS.value)):
        raise RuntimeError(
            f"Round {result.round} trained indices {[g.request.index for g in result.groups]}; "
            f"expected each of 0..{_GROUPS.value - 1} once."
        )
    if n != _GROUPS.value and result.kind != "flush":
        raise RuntimeError(f"Round {result.round} ({result.kind}) trained {n} groups.")
    digest = hashlib.sha256()
    for g in sorted(result.groups, key=lambda g: g.request.index):
        want = response_length(g.request.uid)
        got = {len(c.tokens) for c in g.completions}
        if got != {want}:
            raise RuntimeError(
                f"Round {result.round} uid {g.request.uid}: response lengths {sorted(got)}; "
                f"expected {want} (no stop tokens)."
            )
        for c in g.completions:
            digest.update(np.asarray(c.tokens, np.int64).tobytes())
    return digest.hexdigest()[:16]


def run_epoch(driver: Driver, tail: bool, watch: bench_util.CompileWatch) -> dict[str, Any]:
    """Round 0 (not timed), then the rest of the epoch timed; the timed rounds' figures."""
    check_round(driver.run_round(0), tail)
    results, wall = [], []
    with watch.timed():
        for r in itertools.count(1):
            if (driver.planner.epoch_complete if tail else r > _ROUNDS.value) or r > 4 * (
                _ROUNDS.value + 1
            ):
                break
            start = time.perf_counter()
            results.append(driver.run_round(r))
            wall.append(time.perf_counter() - start)
    if tail and not driver.planner.epoch_complete:
        raise RuntimeError(f"The epoch did not end within {len(results)} timed rounds.")
    per_round = {k: [r.metrics[k] for r in results] for k in METRICS}
    groups = sum(len(r.groups) for r in results)
    short = [r.metrics["response_len_max"] for r in results if r.kind in ("short", "plain")]
    return dict(
        **{k: float(np.mean(v)) for k, v in per_round.items()},
        per_round=per_round,
        kinds=[r.kind for r in results],
        groups_trained=groups,
        time_per_group_s=float(np.sum(per_round["rollout_to_train_end_s"])) / groups,
        groups_per_s=groups / float(np.sum(wall)),  # throughput over its timed rounds
        short_round_response_len_max=float(np.mean(short)) if short else math.nan,
        aborted_prompts=int(sum(r.metrics["aborted_prompts"] for r in results)),
        digests=[check_round(r, tail) for r in results],
        reward_mean=float(np.mean([r.metrics["reward_mean"] for r in results])),
        loss=float(np.mean([r.metrics["loss"] for r in results])),
        first_batch_indices=[
            sorted(g.request.index for g in r.groups[: _PER_UPDATE.value]) for r in results
        ],
    )


def run_mode(mode: str, max_length: int, max_prefill: int, watch: bench_util.CompileWatch):
    """One mode: build, warm up, --repeats epochs, close; medians over the repeats."""
    start, timed_before = time.perf_counter(), watch.compiles_timed
    cfg, tail = driver_config(mode), mode.endswith("+tail")
    runtime = build(max_length, max_prefill, cfg)
    repeats, counts = [], {}
    try:
        copy = lambda s: jax.tree.map(lambda x: jax.device_put(x, x.sharding, may_alias=False), s)
        initial = copy(runtime.learner.state)  # each repeat starts from the same weights
        build_s = time.perf_counter() - start
        for k in range(_REPEATS.value):
            runtime.learner.state = copy(initial)
            driver = runtime.driver(
                cfg,
                prompts=prompts(_SEED.value),
                reward_fn=parity_reward,
                rounds=_ROUNDS.value + 1,  # async plans nothing past the epoch
            )
            try:
                before = compile_counts(runtime)
                repeats.append(run_epoch(driver, tail, watch))
                counts.update(bench_util.counts_diff(compile_counts(runtime), before))
            finally:
                driver.close()
            if k == 0 and _GANTT_DIR.value:
                os.makedirs(_GANTT_DIR.value, exist_ok=True)
                stem = os.path.join(_GANTT_DIR.value, mode.replace("+", "_"))
                driver.timeline.write_chrome_trace(stem + ".json")
                driver.timeline.write_gantt_png(stem + ".png", title=f"{mode}: round 0 + timed")
            del driver
        compiles = compile_counts(runtime)
    finally:
        runtime.close()
    held = bench_util.memory_maps()
    del runtime, initial
    first, numeric = repeats[0], [k for k, v in repeats[0].items() if isinstance(v, float)]
    out = dict(first, **{k: float(np.median([r[k] for r in repeats])) for k in numeric})
    out.update(
        spread={k: bench_util.spread(r[k] for r in repeats) for k in SPREAD},
        repeats=repeats,
        same_tokens_each_repeat=all(r["digests"] == first["digests"] for r in repeats),
        build_s=build_s,
        seconds=time.perf_counter() - start,
        compile_counts=compiles,
        compiles_timed=watch.compiles_timed - timed_before,
        library_compiles_in_epochs=counts,  # round 0 of repeat 0 compiles nothing new either
        memory_maps=dict(held=held, after_release=bench_util.release()),
    )
    print(
        f"{mode}: {out['seconds']:.0f} s (build + warm-up {build_s:.0f} s), memory maps "
        f"{held} held -> {out['memory_maps']['after_release']} released, compiles timed "
        f"{out['compiles_timed']}",
        flush=True,
    )
    return out


SPREAD = ("rollout_to_train_end_s", "first_dispatch_s", "time_per_group_s", "groups_per_s")


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
    bench_env.use_compilation_cache(_CACHE.value)
    max_prefill = max(16, _PROMPT_MAX.value)
    max_length = max_prefill + _MAX_NEW.value

    total_start = time.perf_counter()
    out = {}
    with bench_util.CompileWatch() as watch:
        for m in modes:
            out[m] = run_mode(m, max_length, max_prefill, watch)
    total_s = time.perf_counter() - total_start

    base = out["sync"]
    for m, r in out.items():
        r["rollout_to_train_end_reduction"] = 1.0 - (
            r["rollout_to_train_end_s"] / base["rollout_to_train_end_s"]
        )
        r["speedup_vs_sync"] = base["rollout_to_train_end_s"] / r["rollout_to_train_end_s"]
        r["first_dispatch_ratio"] = r["first_dispatch_s"] / base["first_dispatch_s"]
        plain = ("+tail" not in m and not m.startswith("async+")) or m.endswith("+s0")
        r["same_tokens_as_sync"] = r["digests"] == base["digests"] if plain else None
        r["throughput_vs_sync"] = r["groups_per_s"] / base["groups_per_s"]
        r["tail_speedup_vs_sync"] = base["time_per_group_s"] / r["time_per_group_s"]
    lengths = np.asarray([response_length(u) for u in range(epoch_size())])
    result = dict(
        modes=out,
        compiles_timed=watch.compiles_timed,
        compiles=watch.report(),
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
            load_average=os.getloadavg(),
            lengths=[int(x) for x in lengths],
            total_s=total_s,
        ),
    )
    pipeline_report.print_tables(result)
    if _JSON.value:
        with open(_JSON.value, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {_JSON.value}")
    bench_util.fail_if_compiled("launch.bench_pipeline", watch.compiles_timed, watch.timed_names())


if __name__ == "__main__":
    app.run(main)
