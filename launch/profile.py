"""Profile the real engine, learner and weight transfer here; fit the simulator's stage-time models.

    python -m launch.profile --json /tmp/profile.json [--slots 32 --steps_per_call 4 ...]

The defaults are launch.bench_pipeline's: the "tiny" preset (init_std 0.3, float32), a learner
mesh and a sampler mesh of one CPU device each, 160 slots, 4 decode steps per call, G = 8, U = 2,
prompts of 4-12 tokens, responses up to 96. Measured, after a compile pass of each:
  decode     every generate call of a SamplerLoop (host bookkeeping, rewards and emit included)
             over groups of staggered lengths, so the active slots and the context vary; at
             steps_per_call k and at 1, which separates the per-call cost from the per-step one;
  prefill    engine.prefill + bulk_insert of one prompt, prompt lengths across the range;
  learner    Learner.add_groups of U groups (one micro-batch, its compute awaited) and
             Learner.update, for responses in each length bucket;
  publish    cross-mesh jax.device_put of arrays of 0.4-16 MB (the per-byte cost), and
             DevicePutSync of the model (the fixed cost: its per-leaf dispatch);
  contention the decode calls again while a learner thread trains, and learner updates while a
             sampler thread decodes: each side's slowdown, averaged (the two share the cores).
Fits every StageModel term by least squares (rl/sim/calibrate.py) and writes {"model": ...,
"fit": ..., "config": ...}: `launch.simulate --profile PATH` loads it. Takes 2-3 minutes on 2 shared
cores. The compile pass compiles every program the measurements call (the engines' by
Engine.precompile); a compile while measuring makes the program exit non-zero after
its report (fit.compiles_timed: 0). The update and the model's publish are given min / median / max.
"""

from __future__ import annotations

import os

from launch import bench_env  # before jax: two CPU devices

# isort: split

import json  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from types import SimpleNamespace  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402
from flax import nnx  # noqa: E402

from launch import bench_util  # noqa: E402
from learner.learner import Learner  # noqa: E402
from rl.admission import FCFS  # noqa: E402
from rl.runtime.compose import Setup, build_engine
from rl.runtime.threads import ThreadsRuntime  # noqa: E402
from rl.sim.calibrate import Measurements, fit_stage_model  # noqa: E402
from rl.types import Completion, Group, Request, SamplingParams  # noqa: E402
from sampler.engine import Engine  # noqa: E402
from sampler.loop import SamplerLoop  # noqa: E402

_JSON = flags.DEFINE_string("json", "", "Write the fitted model and the fit report here.")
_SLOTS = flags.DEFINE_integer("slots", 160, "Engine slots (launch.bench_pipeline's default).")
_STEPS = flags.DEFINE_integer("steps_per_call", 4, "Decode steps fused into one generate call.")
_GROUP_SIZE = flags.DEFINE_integer("group_size", 8, "Samples per group (G).")
_PER_UPDATE = flags.DEFINE_integer("groups_per_update", 2, "Groups per update (U).")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 96, "Longest response.")
_PROMPT_MAX = flags.DEFINE_integer("prompt_max", 12, "Longest prompt.")
_REPEATS = flags.DEFINE_integer("repeats", 2, "Timed passes over each measurement.")
_SEED = flags.DEFINE_integer("seed", 0, "Seeds the model and the workload.")
_CACHE = flags.DEFINE_string("compilation_cache", bench_env.DEFAULT_CACHE, bench_env.CACHE_HELP)


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - start


def prompt(rng: np.random.Generator, n: int) -> tuple[int, ...]:
    return tuple(int(t) for t in rng.integers(0, 256, n))


def decode_trials(
    engine: Engine, params: Any, rng: np.random.Generator, limit: int | None = None
) -> list[list[tuple]]:
    """Timed generate calls (k, active, context, seconds) of staggered-length groups, per trial."""
    g, k, cap = _GROUP_SIZE.value, engine.config.steps_per_call, _MAX_NEW.value
    per_round = engine.max_concurrent_decodes // g
    staggered = [max(1, cap * (i + 1) // per_round) for i in range(per_round)]
    trials = [[cap], [cap, cap // 2], staggered, [cap] * per_round]
    out = []
    for lengths in trials[:limit]:
        requests = [
            Request(
                uid=i,
                prompt=prompt(rng, int(rng.integers(4, _PROMPT_MAX.value + 1))),
                group_size=g,
                params=SamplingParams(max_new_tokens=n),
            )
            for i, n in enumerate(lengths)
        ]
        loop = SamplerLoop(
            engine,
            params,
            admission=FCFS(),
            reward_fn=lambda r, c: float(c.tokens[0] % 2),
            emit=lambda group: None,
        )
        loop.submit(requests)
        loop.step()  # admission (prefills) + the first call: not a pure decode call
        calls, j = [], 1
        while True:
            active = [(len(r.prompt), r.params.max_new_tokens) for r in requests for _ in range(g)]
            active = [(p, n) for p, n in active if n > k * j]
            if not active:
                break
            context = sum(p + k * j for p, _ in active)
            start = time.perf_counter()
            loop.step()
            calls.append((k, len(active), float(context), time.perf_counter() - start))
            j += 1
        if loop.step():
            raise RuntimeError("The sampler still had work after every response's length.")
        out.append(calls)
    return out


def make_groups(rng: np.random.Generator, lengths: list[int]) -> list[Group]:
    groups = []
    for uid, n in enumerate(lengths):
        request = Request(
            uid=uid,
            prompt=prompt(rng, _PROMPT_MAX.value),
            group_size=_GROUP_SIZE.value,
            params=SamplingParams(max_new_tokens=_MAX_NEW.value),
        )
        completions = tuple(
            Completion(
                uid=uid,
                round=0,
                sample=s,
                prompt=request.prompt,
                tokens=prompt(rng, n),
                logprobs=(-5.5,) * n,
                versions=(0,) * n,
                finish_reason="length",
                reward=float(rng.integers(0, 2)),
            )
            for s in range(_GROUP_SIZE.value)
        )
        groups.append(Group(request=request, completions=completions))
    return groups


def learner_trial(learner: Learner, batch: list[Group]) -> tuple[int, float, float]:
    """(model positions of the micro-batch, add_groups seconds with its compute awaited, update
    seconds). Positions: rows x length of the batch the learner builds (packed by default)."""
    learner.begin_round(updates=1)
    micro = timed(lambda: (learner.add_groups(batch), learner.block_until_ready()))
    metrics: dict[str, float] = {}
    update = timed(lambda: metrics.update(learner.update()))
    return int(metrics["positions"]), micro, update


def in_background(work: Callable[[], Any]) -> tuple[threading.Event, threading.Thread]:
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            work()

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    return stop, thread


def measure(watch: bench_util.CompileWatch) -> SimpleNamespace:
    """Everything measured (after a compile pass; the rest booked as timed in `watch`)."""
    rng = np.random.default_rng(_SEED.value)
    max_prefill = max(16, _PROMPT_MAX.value)
    rows = _PER_UPDATE.value * _GROUP_SIZE.value

    def config(steps_per_call: int) -> Any:
        return bench_env.tiny_config(
            seed=_SEED.value,
            lr=1e-3,
            micro_batch_rows=rows,
            slots=_SLOTS.value,
            max_length=max_prefill + _MAX_NEW.value,
            max_prefill=max_prefill,
            steps_per_call=steps_per_call,
        )

    # The learner, the engine at --steps_per_call and the weight sync from the composition root;
    # a second engine at 1 step per call on the same sampler mesh.
    setup = Setup.from_config(config(_STEPS.value))
    runtime = ThreadsRuntime(config(_STEPS.value), setup, total_updates=0)
    learner, sync = runtime.learner, runtime.weight_sync
    learner_mesh, sampler_mesh = learner.mesh, runtime.engine.mesh
    engines = {_STEPS.value: runtime.engine}
    if _STEPS.value != 1:
        model = nnx.merge(learner.graphdef, learner.params)  # its structure; weights are published
        engines[1] = build_engine(config(1), setup, sampler_mesh, model)
    engines = dict(sorted(engines.items()))
    params = sync.publish(learner.params, 0).params
    u = _PER_UPDATE.value
    lengths = [[8] * u, [16] * u, [40] * u, [_MAX_NEW.value] * u, [_MAX_NEW.value] + [12] * (u - 1)]
    batches = [make_groups(rng, ls) for ls in lengths]
    sizes = [100_000, 1_000_000, 4_000_000]  # float32 elements: 0.4, 4, 16 MB
    arrays = [jax.device_put(np.ones(n, np.float32), learner_mesh.devices.flat[0]) for n in sizes]
    target = sampler_mesh.devices.flat[0]

    start = time.perf_counter()
    for engine in engines.values():  # compile pass
        engine.precompile(params)  # the runtime's engine did at build: no-op there
        decode_trials(engine, params, rng, limit=1)
    for n in range(1, max_prefill + 1):  # the prefill measurement's calls
        r = Request(
            uid=0,
            prompt=prompt(rng, n),
            group_size=_GROUP_SIZE.value,
            params=SamplingParams(max_new_tokens=_MAX_NEW.value),
        )
        state = engines[_STEPS.value].init_decode_state()
        prefix = engines[_STEPS.value].prefill(params, r.prompt)
        engines[_STEPS.value].bulk_insert(prefix, state, list(range(_GROUP_SIZE.value)), r)
    for b in batches:
        learner_trial(learner, b)
    for a in arrays:
        timed(lambda a=a: jax.device_put(a, target, may_alias=False))
    sync.publish(learner.params, 1)
    compile_s = time.perf_counter() - start
    watch.label = bench_util.TIMED  # everything below is measured (measure's caller ends it)

    decode, prefill, micro, update, publish = [], [], [], [], []
    for _ in range(_REPEATS.value):
        for engine in engines.values():
            decode += [c for trial in decode_trials(engine, params, rng) for c in trial]
        engine = engines[_STEPS.value]
        for n in range(1, max_prefill + 1):
            state = engine.init_decode_state()
            r = Request(
                uid=0,
                prompt=prompt(rng, n),
                group_size=_GROUP_SIZE.value,
                params=SamplingParams(max_new_tokens=_MAX_NEW.value),
            )
            slots = list(range(_GROUP_SIZE.value))
            insert = lambda r=r, s=state, e=engine, slots=slots: e.bulk_insert(  # noqa: E731
                e.prefill(params, r.prompt), s, slots, r
            )
            prefill.append((n, timed(insert)))
        for b in batches:
            tokens, m, up = learner_trial(learner, b)
            micro.append((tokens, m))
            update.append(up)
        for n, a in zip(sizes, arrays, strict=True):
            publish.append((4 * n, timed(lambda a=a: jax.device_put(a, target, may_alias=False))))
    param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(learner.params))
    model_publish = [sync.publish(learner.params, 1).seconds for _ in range(5)]

    # Contention: each side timed again while the other runs in a thread.
    engine = engines[_STEPS.value]
    alone = [c[3] for trial in decode_trials(engine, params, rng) for c in trial]
    stop, thread = in_background(lambda: learner_trial(learner, batches[3]))
    shared = [c[3] for trial in decode_trials(engine, params, rng) for c in trial]
    stop.set()
    thread.join()
    learner_alone = [sum(learner_trial(learner, batches[3])[1:]) for _ in range(6)]
    stop, thread = in_background(lambda: decode_trials(engine, params, rng))
    learner_shared = [sum(learner_trial(learner, batches[3])[1:]) for _ in range(6)]
    stop.set()
    thread.join()
    runtime.close()  # its reward runners (this program scores nothing with them)
    slow_sampler = float(np.median(shared) / np.median(alone))
    slow_learner = float(np.median(learner_shared) / np.median(learner_alone))
    return SimpleNamespace(
        decode=decode,
        prefill=prefill,
        micro=micro,
        update=update,
        publish=publish,
        slow_sampler=slow_sampler,
        slow_learner=slow_learner,
        rows=rows,
        learner_cfg=learner.cfg,
        param_bytes=param_bytes,
        model_publish=model_publish,
        compile_s=compile_s,
    )


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    if _SLOTS.value < _GROUP_SIZE.value:
        raise app.UsageError(f"--slots ({_SLOTS.value}) must be >= --group_size.")
    bench_env.use_compilation_cache(_CACHE.value)
    with bench_util.CompileWatch() as watch:
        m = measure(watch)
    meas = Measurements(
        decode=m.decode,
        prefill=m.prefill,
        micro=m.micro,
        update=m.update,
        publish=m.publish,
        contention=(m.slow_sampler + m.slow_learner) / 2 - 1,
    )
    fitted, report = fit_stage_model(
        meas,
        steps_per_call=_STEPS.value,
        micro_batch_rows=m.rows,
        pad_rows=not m.learner_cfg.packing,  # packed: the simulator counts real tokens
        min_length_bucket=m.learner_cfg.min_length_bucket,
        param_bytes=m.param_bytes,
        source=f"launch.profile on {jax.default_backend()}, {os.cpu_count()} cores",
    )
    # The per-byte cost comes from single arrays; the model's publish moves a tree of many leaves,
    # whose per-leaf dispatch is the fixed cost: taken from the model's own measured publish.
    fitted = fitted.replace(
        publish_fixed=max(
            0.0, float(np.median(m.model_publish)) - fitted.publish_per_byte * m.param_bytes
        )
    )
    report.update(
        slowdown_sampler=m.slow_sampler,
        slowdown_learner=m.slow_learner,
        model_publish_s=float(np.median(m.model_publish)),
        model_publish_predicted_s=fitted.publish_s(),
        compile_s=m.compile_s,
        update_s_spread=bench_util.spread(m.update),
        model_publish_s_spread=bench_util.spread(m.model_publish),
        compiles_timed=watch.compiles_timed,
        compiles=watch.report(),
        memory_maps=bench_util.memory_maps(),
    )
    print(f"compile pass {m.compile_s:.1f} s; fitted stage model ({fitted.source}):")
    for stage in ("decode", "prefill", "micro_step", "publish"):
        r = report[stage]
        coef = ", ".join(f"{k} {v:.3g}" for k, v in r["coef"].items())
        print(f"  {stage:<10} {coef}  ({r['n']} points, rel. RMS error {r['rel_rms']:.1%})")
    print(
        f"  update     {fitted.update_s * 1e3:.2f} ms (min / median / max of {len(m.update)}: "
        f"{bench_util.spread_text({k: 1e3 * v for k, v in report['update_s_spread'].items()})})"
    )
    print(
        f"  contention sampler x{m.slow_sampler:.2f}, learner x{m.slow_learner:.2f} while both run "
        f"-> contention {fitted.contention:.2f}"
    )
    print(
        f"  publish of the model ({m.param_bytes} B): {report['model_publish_s'] * 1e3:.2f} ms "
        f"measured (median of {len(m.model_publish)}), {fitted.publish_s() * 1e3:.2f} ms predicted"
    )
    print(f"compiles timed: {watch.compiles_timed}; memory maps {report['memory_maps']}")
    if _JSON.value:
        config = {
            f: flags.FLAGS[f].value
            for f in (
                "slots",
                "steps_per_call",
                "group_size",
                "groups_per_update",
                "max_new_tokens",
                "prompt_max",
                "repeats",
                "seed",
            )
        }
        with open(_JSON.value, "w") as f:
            json.dump(dict(model=fitted.to_dict(), fit=report, config=config), f, indent=2)
        print(f"wrote {_JSON.value}")
    bench_util.fail_if_compiled("launch.profile", watch.compiles_timed, watch.timed_names())


if __name__ == "__main__":
    app.run(main)
