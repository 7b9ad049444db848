"""Sampler throughput: the decode path, and continuous vs static batching vs no cache.

    python -m launch.bench_sampler [--json /tmp/bench.json] [--groups 48 --slots 32 ...]
    python -m launch.bench_sampler --modes=decode [--profile=/tmp/trace]   # decode tokens/s

`decode`: for each --decode_shapes B x layers x d_model (a tiny random Qwen3: 4 heads of
d_model / 4, 2 kv heads, mlp 2 x d_model), B prompts of --prompt_min..--prompt_max tokens each
decode --decode_new_tokens tokens (temperature 1, behaviour log-probs) through a SamplerLoop on one
device; decode tokens/s = B x new tokens / wall time (admission and prefill included), the median
of --repeats runs after a warm-up. (Issue 19's comparison with the decode path before it is in the
README; that path is gone.) --profile writes a jax.profiler trace (open it in Perfetto) of one run
of the first shape.

`loop`: one process, one tiny model (float32, CPU by default), one long-tailed workload measured
three ways:
  continuous  SamplerLoop: a group is admitted as soon as G slots are free.
  static      StaticBatchingLoop (below): refill only when every slot is free (the baseline).
  nocache     sampler/reference.greedy_nocache in batches of `slots` rows: full recompute per token,
              on the first --nocache_groups groups only (it is slow).
Response lengths are drawn per group (SamplingParams.max_new_tokens, no stop tokens), so every
mode produces exactly the same number of tokens per sample. Everything is compiled by a warm-up
pass over the same workload (continuous and static) before anything is timed; the warm-up time is
reported separately, and a compile inside a timed run makes the program exit non-zero after its
table (compiles timed: 0). Tokens/s are given min / median / max over the --repeats runs too.
Expect, on the default workload, one prefill per group and continuous about 2x static (2.1x fewer
generate calls; the seconds are noisier than the call counts on a shared CPU).

With --verifier_sleep_ms=5, two more continuous rows score every sample with a verifier that
sleeps 5 ms per call, through a RewardRunner: "inline" calls it on the decode thread (the loop
waits for each reward, as before rewards moved off it), "offloaded" hands it to the runner's
--reward_workers workers (`RewardRunner.submit`) and keeps decoding; the last line prints
offloaded / inline tokens/s. Both emit the same groups with the same tokens (checked).
"""

from __future__ import annotations

import functools
import json
import time
from typing import Any

import jax
import numpy as np
from absl import app, flags

from launch import bench_paged, bench_util
from rl.admission import FCFS
from rl.models import create_model, get_preset
from rl.rewards import RewardRunner
from rl.types import Group, Request, SamplingParams
from sampler.engine import Engine, EngineConfig
from sampler.loop import SamplerLoop
from sampler.reference import greedy_nocache

_JSON = flags.DEFINE_string("json", "", "Write the results here as JSON; empty: don't.")
_GROUPS = flags.DEFINE_integer("groups", 48, "Requests (prompts) in the workload.")
_GROUP_SIZE = flags.DEFINE_integer("group_size", 8, "Samples per request (G).")
_SLOTS = flags.DEFINE_integer("slots", 32, "Engine slots (max concurrent sequences).")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 192, "Length cap: the long tail's length.")
_LONG_FRACTION = flags.DEFINE_float("long_fraction", 0.1, "Fraction of groups that hit the cap.")
_SHORT = flags.DEFINE_integer("short_tokens", 16, "Median length of the other groups.")
_SIGMA = flags.DEFINE_float("length_sigma", 1.0, "Log-normal spread of the other groups' lengths.")
_PROMPT_MIN = flags.DEFINE_integer("prompt_min", 8, "Shortest prompt (random byte tokens).")
_PROMPT_MAX = flags.DEFINE_integer("prompt_max", 40, "Longest prompt.")
_STEPS = flags.DEFINE_integer("steps_per_call", 4, "Decode steps fused into one generate call.")
_NOCACHE_GROUPS = flags.DEFINE_integer(
    "nocache_groups", 0, "Groups decoded without a cache; 0: one batch (slots // group_size)."
)
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed runs of each mode; the median counts.")
_SEED = flags.DEFINE_integer("seed", 0, "Seeds the workload, the model init and the sampler.")
_VERIFIER_MS = flags.DEFINE_float(
    "verifier_sleep_ms", 0.0, "> 0: add rows with a verifier sleeping this long per call."
)
_REWARD_WORKERS = flags.DEFINE_integer("reward_workers", 4, "RewardRunner workers (offloaded).")
_MODES = flags.DEFINE_list(
    "modes", ["loop", "decode", "paged"], "Benchmarks to run: loop, decode, paged."
)
_DECODE_SHAPES = flags.DEFINE_list(
    "decode_shapes", ["64x2x64", "64x4x256", "256x4x256"], "decode: slots x layers x d_model."
)
_DECODE_NEW = flags.DEFINE_integer("decode_new_tokens", 128, "decode: tokens per response.")
_PROFILE = flags.DEFINE_string("profile", "", "decode: write a jax.profiler trace here; empty: no.")
_ALL_FLAGS = (
    _GROUPS,
    _GROUP_SIZE,
    _SLOTS,
    _MAX_NEW,
    _LONG_FRACTION,
    _SHORT,
    _SIGMA,
    _PROMPT_MIN,
    _PROMPT_MAX,
    _STEPS,
    _NOCACHE_GROUPS,
    _REPEATS,
    _SEED,
    _VERIFIER_MS,
    _REWARD_WORKERS,
    _DECODE_NEW,
)
WATCH = bench_util.CompileWatch()  # XLA compiles; those inside timed runs fail the program


def sleepy_verifier(request: Request, text: str, *, sleep_s: float) -> float:
    """A slow verifier: sleeps `sleep_s`, then scores 1.0 for an even-length response."""
    time.sleep(sleep_s)
    return float(len(text) % 2 == 0)


def make_workload(rng: np.random.Generator) -> list[Request]:
    """Long-tailed lengths: log-normal near --short_tokens, --long_fraction of groups at the cap."""
    n, cap = _GROUPS.value, _MAX_NEW.value
    body = np.rint(_SHORT.value * np.exp(_SIGMA.value * rng.standard_normal(n)))
    lengths = np.where(rng.random(n) < _LONG_FRACTION.value, cap, np.clip(body, 1, cap))
    prompt_lengths = rng.integers(_PROMPT_MIN.value, _PROMPT_MAX.value + 1, n)
    return [
        Request(
            uid=i,
            prompt=tuple(int(t) for t in rng.integers(0, 256, prompt_lengths[i])),
            group_size=_GROUP_SIZE.value,
            params=SamplingParams(temperature=1.0, max_new_tokens=int(lengths[i])),
        )
        for i in range(n)
    ]


class StaticBatchingLoop(SamplerLoop):
    """The baseline: a batch of requests is admitted only when every slot is free (no refill)."""

    def may_admit(self) -> bool:
        return self.busy_slots() == 0


def run_loop(
    engine: Engine, params: Any, requests: list[Request], static: bool, reward_fn: Any = None
) -> dict[str, Any]:
    """Runs the workload through a fresh SamplerLoop (static: StaticBatchingLoop); checks every
    response has its drawn length."""
    groups: list[Group] = []
    loop = (StaticBatchingLoop if static else SamplerLoop)(
        engine,
        params,
        admission=FCFS(),
        reward_fn=reward_fn or (lambda r, c: 0.0),
        emit=groups.append,
    )
    start = time.perf_counter()
    loop.submit(requests)
    loop.run_until_idle()
    seconds = time.perf_counter() - start
    if len(groups) != len(requests):
        raise RuntimeError(f"Emitted {len(groups)} groups for {len(requests)} requests.")
    for g in groups:
        got = {len(c.tokens) for c in g.completions}
        if got != {g.request.params.max_new_tokens}:
            raise RuntimeError(
                f"uid {g.request.uid}: response lengths {sorted(got)}; expected "
                f"{g.request.params.max_new_tokens} (no stop tokens)."
            )
    s = loop.stats
    return dict(
        tokens=sum(len(c.tokens) for g in groups for c in g.completions),
        seconds=seconds,
        occupancy=s.occupancy,
        prefills_per_group=s.prefills / s.groups_emitted,
        generate_calls=s.generate_calls,
        outputs={g.request.uid: tuple(c.tokens for c in g.completions) for g in groups},
        order=[g.request.uid for g in groups],
        rewards=[c.reward for g in groups for c in g.completions],
    )


def run_verifier_rows(engine: Engine, params: Any, requests: list[Request]) -> dict[str, Any]:
    """The slow-verifier rows: the same RewardRunner called inline vs submitted (median runs)."""
    fn = functools.partial(sleepy_verifier, sleep_s=_VERIFIER_MS.value / 1000)
    runner = RewardRunner(fn, decode=lambda t: "x" * len(t), workers=_REWARD_WORKERS.value)
    inline = lambda r, c: runner(r, c)  # no `submit`: the loop waits for each reward
    runs: dict[str, list[dict[str, Any]]] = {"inline": [], "offloaded": []}
    try:
        for _ in range(_REPEATS.value):
            with WATCH.timed():
                runs["inline"].append(run_loop(engine, params, requests, False, inline))
                runs["offloaded"].append(run_loop(engine, params, requests, False, runner))
    finally:
        runner.close()
    out = {k: sorted(v, key=lambda r: r["seconds"])[len(v) // 2] for k, v in runs.items()}
    a, b = out["inline"], out["offloaded"]
    if (a["outputs"], a["order"], a["rewards"]) != (b["outputs"], b["order"], b["rewards"]):
        raise RuntimeError("Offloaded rewards changed the groups, their order or their rewards.")
    out["all"] = {k: [r["seconds"] for r in v] for k, v in runs.items()}
    return out


def run_nocache(model: Any, requests: list[Request], rows: int, max_length: int) -> dict[str, Any]:
    """greedy_nocache over the requests' samples in batches of `rows` (padded: one compile)."""
    prompts = [r.prompt for r in requests for _ in range(r.group_size)]
    lengths = [r.params.max_new_tokens for r in requests for _ in range(r.group_size)]
    start, tokens = time.perf_counter(), 0
    for i in range(0, len(prompts), rows):
        p, n = prompts[i : i + rows], lengths[i : i + rows]
        pad = rows - len(p)
        out = greedy_nocache(model, p + [p[0]] * pad, n + [1] * pad, max_length)
        tokens += sum(len(o) for o in out[: len(n)])
    return dict(tokens=tokens, seconds=time.perf_counter() - start)


def parse_shape(text: str) -> tuple[int, int, int]:
    """'64x2x64' -> (slots, layers, d_model)."""
    parts = text.lower().split("x")
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise app.UsageError(
            f"--decode_shapes entry {text!r}: expected slots x layers x d_model, e.g. 64x2x64."
        )
    b, n_layers, d = map(int, parts)
    if d % 4:
        raise app.UsageError(f"--decode_shapes entry {text!r}: d_model must be a multiple of 4.")
    return b, n_layers, d


def decode_case(shape: tuple[int, int, int]) -> dict[str, Any]:
    """Decode tokens/s on one shape, the median of --repeats runs; see the module docstring."""
    b, n_layers, d = shape
    cfg = get_preset(
        "tiny", n_layers=n_layers, d_model=d, head_dim=d // 4, mlp_dim=2 * d, init_std=0.3
    )
    model = create_model(cfg, seed=_SEED.value)
    rng = np.random.default_rng(_SEED.value)
    new = _DECODE_NEW.value
    requests = [
        Request(
            uid=i,
            prompt=tuple(
                int(t)
                for t in rng.integers(
                    0, 256, rng.integers(_PROMPT_MIN.value, _PROMPT_MAX.value + 1)
                )
            ),
            params=SamplingParams(temperature=1.0, max_new_tokens=new),
        )
        for i in range(b)
    ]
    max_prefill = max(16, _PROMPT_MAX.value)
    engine = Engine(
        model,
        EngineConfig(
            max_slots=b,
            max_length=max_prefill + new,
            max_prefill_length=max_prefill,
            steps_per_call=_STEPS.value,
            seed=_SEED.value,
        ),
    )
    params = engine.load_params(model)
    run_loop(engine, params, requests, static=False)  # warm-up: compiles
    seconds = []
    for _ in range(_REPEATS.value):
        with WATCH.timed():
            seconds.append(run_loop(engine, params, requests, static=False)["seconds"])
    if _PROFILE.value and not getattr(decode_case, "profiled", False):
        decode_case.profiled = True
        with jax.profiler.trace(_PROFILE.value):
            run_loop(engine, params, requests, static=False)
    return dict(
        shape=dict(slots=b, layers=n_layers, d_model=d, head_dim=d // 4, mlp_dim=2 * d),
        tokens=b * new,
        tokens_per_s=b * new / float(np.median(seconds)),
        tokens_per_s_min_max=[b * new / max(seconds), b * new / min(seconds)],
        seconds=seconds,
        compile_counts=engine.compile_counts(),
    )


def decode_main() -> dict[str, Any]:
    shapes = [parse_shape(t) for t in _DECODE_SHAPES.value]
    rows = []
    for s in shapes:
        rows.append(decode_case(s))
        rows[-1]["memory_maps_released"] = bench_util.release()  # the shape's engines
    print(
        f"decode: {_DECODE_NEW.value} new tokens per prompt, temperature 1, log-probs, "
        f"steps_per_call {_STEPS.value}, prompts {_PROMPT_MIN.value}-{_PROMPT_MAX.value} tokens, "
        f"{_REPEATS.value} runs (median), one {jax.default_backend()} device"
    )
    print(f"{'B x L x D':<12}{'tok/s':>11}{'runs min-max':>17}")
    for r in rows:
        sh, (lo, hi) = r["shape"], r["tokens_per_s_min_max"]
        print(
            f"{sh['slots']}x{sh['layers']}x{sh['d_model']:<6}{r['tokens_per_s']:>11.0f}"
            f"{f'{lo:.0f}-{hi:.0f}':>17}"
        )
    if _PROFILE.value:
        print(f"wrote a jax.profiler trace ({_DECODE_SHAPES.value[0]}) to {_PROFILE.value}")
    return dict(decode=rows)


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    unknown = set(_MODES.value) - {"loop", "decode", "paged"}
    if unknown:
        raise app.UsageError(f"--modes {sorted(unknown)}: expected loop, decode and/or paged.")
    with WATCH:
        out = decode_main() if "decode" in _MODES.value else {}
        if "paged" in _MODES.value:
            out["paged"] = bench_paged.measure(_SEED.value, _REPEATS.value, WATCH, run_loop)
            bench_paged.report(out["paged"])
        if "loop" in _MODES.value:
            loop_main(out)
    print(f"compiles timed: {WATCH.compiles_timed}; memory maps {bench_util.memory_maps()}")
    if "loop" not in _MODES.value and _JSON.value:
        out.update(compiles_timed=WATCH.compiles_timed, compiles=WATCH.report())
        with open(_JSON.value, "w") as f:
            json.dump(out, f, indent=2)
        print(f"wrote {_JSON.value}")
    bench_util.fail_if_compiled("launch.bench_sampler", WATCH.compiles_timed, WATCH.timed_names())


def loop_main(extra: dict[str, Any]) -> None:
    if _SLOTS.value < _GROUP_SIZE.value:
        raise app.UsageError(
            f"--slots ({_SLOTS.value}) must be >= --group_size ({_GROUP_SIZE.value})."
        )
    requests = make_workload(np.random.default_rng(_SEED.value))
    lengths = np.array([r.params.max_new_tokens for r in requests])
    max_prefill = max(16, _PROMPT_MAX.value)
    max_length = max_prefill + _MAX_NEW.value
    model = create_model(get_preset("tiny", init_std=0.3), seed=_SEED.value)
    engine = Engine(
        model,
        EngineConfig(
            max_slots=_SLOTS.value,
            max_length=max_length,
            max_prefill_length=max_prefill,
            steps_per_call=_STEPS.value,
            seed=_SEED.value,
        ),
    )
    params = engine.load_params(model)
    nocache_groups = _NOCACHE_GROUPS.value or _SLOTS.value // _GROUP_SIZE.value
    nocache_requests = requests[:nocache_groups]

    # Warm-up: the same workload once, so every program (prefill buckets, insert, generate, the
    # no-cache step) is compiled before timing. Compile counts must not move after this.
    start = time.perf_counter()
    run_loop(engine, params, requests, static=False)
    run_loop(engine, params, requests, static=True)  # admits other counts at once: compiles
    greedy_nocache(model, [requests[0].prompt] * _SLOTS.value, [1] * _SLOTS.value, max_length)
    warmup_seconds = time.perf_counter() - start
    compiles_warm = engine.compile_counts()

    # Interleaved repeats, the median run kept (a shared machine's noise hits both modes alike).
    runs = {False: [], True: []}
    for _ in range(_REPEATS.value):
        for static in (False, True):
            with WATCH.timed():
                runs[static].append(run_loop(engine, params, requests, static=static))
    cont, stat = (
        sorted(runs[s], key=lambda r: r["seconds"])[len(runs[s]) // 2] for s in (False, True)
    )
    with WATCH.timed():
        noc = run_nocache(model, nocache_requests, _SLOTS.value, max_length)
    verifier = run_verifier_rows(engine, params, requests) if _VERIFIER_MS.value > 0 else None
    compiles = engine.compile_counts()
    mismatched = sum(cont["outputs"][u] != stat["outputs"][u] for u in cont["outputs"])
    # Cross-check of the baseline: static batching that fills every slot (slots // G groups a
    # batch, FCFS) runs each batch for its longest group, rounded up to whole generate calls.
    per_batch, k = _SLOTS.value // _GROUP_SIZE.value, _STEPS.value
    full_calls = sum(
        -(-lengths[i : i + per_batch].max() // k) for i in range(0, len(lengths), per_batch)
    )
    static_full_occupancy = stat["tokens"] / (full_calls * k * _SLOTS.value)

    rate = lambda r: r["tokens"] / r["seconds"]
    base = rate(stat)
    rows = [
        ("continuous", len(requests), cont, f"{cont['occupancy']:.2f}", cont["generate_calls"]),
        ("static", len(requests), stat, f"{stat['occupancy']:.2f}", stat["generate_calls"]),
        ("nocache", len(nocache_requests), noc, "-", "-"),
    ]
    if verifier is not None:
        for name in ("inline", "offloaded"):
            r = verifier[name]
            rows.append((name, len(requests), r, f"{r['occupancy']:.2f}", r["generate_calls"]))
    print(
        f"workload: {len(requests)} groups x {_GROUP_SIZE.value} samples, {_SLOTS.value} slots, "
        f"lengths median {np.median(lengths):.0f} / p75 {np.percentile(lengths, 75):.0f} / "
        f"p90 {np.percentile(lengths, 90):.0f} / max {lengths.max()}, "
        f"{np.mean(lengths == _MAX_NEW.value):.0%} of groups at the cap {_MAX_NEW.value}"
    )
    print(
        f"{'mode':<11}{'groups':>7}{'tokens':>8}{'seconds':>9}{'tokens/s':>10}{'vs static':>10}"
        f"{'occupancy':>10}{'gen calls':>10}"
    )
    for name, n, r, occ, calls in rows:
        print(
            f"{name:<11}{n:>7}{r['tokens']:>8}{r['seconds']:>9.2f}{rate(r):>10.0f}"
            f"{rate(r) / base:>10.2f}{occ:>10}{calls:>10}"
        )
    if nocache_groups < len(requests):
        print(f"(nocache ran on the first {nocache_groups} groups only; tokens/s is over those)")
    print(
        f"prefills per group: continuous {cont['prefills_per_group']:.2f}, static "
        f"{stat['prefills_per_group']:.2f}; static/continuous generate calls "
        f"{stat['generate_calls'] / cont['generate_calls']:.2f} (the noise-free speed-up)"
    )
    print(
        f"static occupancy if every batch filled all slots ({per_batch} groups): "
        f"{static_full_occupancy:.2f}; measured {stat['occupancy']:.2f}"
    )
    print(f"compiles after warm-up {compiles_warm}, after timing {compiles}")
    rates = {s: bench_util.spread(r["tokens"] / r["seconds"] for r in runs[s]) for s in runs}
    paired = bench_util.spread(
        b["seconds"] / a["seconds"] for a, b in zip(runs[False], runs[True], strict=True)
    )
    print(
        f"tokens/s over {_REPEATS.value} repeats, min / median / max: continuous "
        f"{bench_util.spread_text(rates[False], '.0f')}, static "
        f"{bench_util.spread_text(rates[True], '.0f')}; continuous vs static paired by repeat "
        f"{bench_util.spread_text(paired, '.2f')}"
    )
    print(f"warm-up (compiles + one continuous and one static pass): {warmup_seconds:.1f} s")
    print(f"continuous vs static outputs: {mismatched} of {len(requests)} groups differ")
    if verifier is not None:
        ratio = rate(verifier["offloaded"]) / rate(verifier["inline"])
        print(
            f"verifier sleeping {_VERIFIER_MS.value:g} ms per call: offloaded "
            f"({_REWARD_WORKERS.value} workers) / inline tokens/s = {ratio:.2f} (continuous "
            f"without a verifier: {rate(cont) / rate(verifier['inline']):.2f}); same groups, "
            "order and rewards"
        )

    if _JSON.value:
        result = dict(
            **extra,
            continuous_tokens_per_s=rate(cont),
            static_tokens_per_s=base,
            continuous_vs_static=rate(cont) / base,
            continuous_vs_static_calls=stat["generate_calls"] / cont["generate_calls"],
            nocache_tokens_per_s=rate(noc),
            continuous_vs_nocache=rate(cont) / rate(noc),
            prefills_per_group=cont["prefills_per_group"],
            static_prefills_per_group=stat["prefills_per_group"],
            continuous_occupancy=cont["occupancy"],
            static_occupancy=stat["occupancy"],
            static_occupancy_full_batches=static_full_occupancy,
            tokens=dict(continuous=cont["tokens"], static=stat["tokens"], nocache=noc["tokens"]),
            seconds=dict(
                continuous=cont["seconds"],
                static=stat["seconds"],
                nocache=noc["seconds"],
                warmup=warmup_seconds,
                continuous_all=[r["seconds"] for r in runs[False]],
                static_all=[r["seconds"] for r in runs[True]],
            ),
            generate_calls=dict(continuous=cont["generate_calls"], static=stat["generate_calls"]),
            nocache_groups=nocache_groups,
            compile_counts=compiles,
            new_compiles_while_timed=sum(compiles.values()) - sum(compiles_warm.values()),
            compiles_timed=WATCH.compiles_timed,
            compiles=WATCH.report(),
            tokens_per_s_spread=dict(continuous=rates[False], static=rates[True]),
            continuous_vs_static_paired=paired,
            groups_with_different_outputs=mismatched,
            verifier=None
            if verifier is None
            else dict(
                sleep_ms=_VERIFIER_MS.value,
                inline_tokens_per_s=rate(verifier["inline"]),
                offloaded_tokens_per_s=rate(verifier["offloaded"]),
                offloaded_vs_inline=rate(verifier["offloaded"]) / rate(verifier["inline"]),
                seconds=verifier["all"],
            ),
            lengths=dict(
                median=float(np.median(lengths)),
                p75=float(np.percentile(lengths, 75)),
                p90=float(np.percentile(lengths, 90)),
                mean=float(lengths.mean()),
                at_cap=float(np.mean(lengths == _MAX_NEW.value)),
            ),
            config=dict(
                {f.name: f.value for f in _ALL_FLAGS},
                model="tiny",
                init_std=0.3,
                dtype="float32",
                max_length=max_length,
                backend=jax.default_backend(),
            ),
        )
        with open(_JSON.value, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {_JSON.value}")


if __name__ == "__main__":
    app.run(main)
