"""Learner throughput: Learner.add_groups + update vs a minimal hand-written jitted train step.

    python -m launch.bench_learner [--json /tmp/bench_learner.json] [--breakdown] [--steps 3 ...]

One process, one model (the "tiny" preset widened to d_model 128, float32), one synthetic batch of
complete Groups (seeded random prompts, responses, sampler log-probs near a uniform policy's, 0/1
rewards) trained with PPO-clip and a token-mean loss, old log-probs from the sampler; every update
sees the same batch. Tokens/s counts loss tokens (response tokens). Measured ways, interleaved:
  minimal       the baseline: one hand-written @jax.jit step (value_and_grad of the same loss on
                model.token_logprobs, optax clip_by_global_norm + adamw, apply_updates; params and
                optimizer state donated) on device arrays built once by learner.batching.make_batch;
                `--steps` steps dispatched back to back, one block_until_ready at the end.
  minimal+sync  the same, with the loss fetched to the host after every step, as update() does.
  learner       Learner.add_groups(groups) + Learner.update(), what a user pays per update: GRPO
                advantages, make_batch, device_put, the zero_accum/accumulate/apply jits and the
                metrics fetch that ends every update. Packed rows (learner.packing, the default).
  learner-unpacked  the same with learner.packing=False: one completion per row, padded to the
                longest's power-of-two bucket, as the minimal step's batch (the overhead ratio
                compares these two).
With --breakdown (two more train-step compiles and 2/3 more timed updates):
  train_step    learner.step.train_step in one jit on the device batch, metrics fetched per step:
                the learner's math (metric sums, float32 accumulator, non-finite guard) fused.
  3 jits        zero_accum, accumulate, apply as three jits, as Learner runs them; device batch.
Pieces of an update are also timed alone (median ms): the host work in add_groups (advantages,
make_batch, device_put), zero_accum, apply against the bare optax update, the metrics fetch; and
the learner's add_groups and update calls during its timed runs.
Both sides run on the same single device by default (--devices). Everything is compiled by a
warm-up before timing (the pieces by a first untimed call each); a compile inside a timed run,
piece or update makes the program exit non-zero after its table (compiles timed: 0). Each way's
median run counts, with its best and worst run; as the machine may be shared (others' load comes
and goes within seconds), learner / minimal seconds within one repeat are given too, min / median /
max over the repeats (overhead_ratio_paired: the median).
The first update's loss and gradient norm of the two sides are printed: same initial params and
batch, so they must agree.

Sequence packing: `--lengths longtail` draws response lengths from a lognormal (median
--tail_median, sigma --tail_sigma, clipped to [--min_response, --max_response], one at the max),
the long-tailed shape of RL responses; the table then reports the padded-token fraction of the
packed and unpacked batches and learner / learner-unpacked tokens/s (target: padding <= 10%,
>= 1.5x). For example:

    python -m launch.bench_learner --lengths longtail --max_response 448 --repeats 7
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags
from flax import nnx

from launch import bench_util
from launch.packing_workload import print_table, run_workload
from learner.batching import Batch, make_batch
from learner.config import LearnerConfig, OptimizerConfig
from learner.learner import Learner
from learner.mesh import MeshConfig, make_meshes
from learner.state import create_train_state, make_lr_schedule, make_optimizer
from learner.step import accumulate, apply, train_step, zero_accum
from rl.advantages import get_advantage_estimator
from rl.losses import PpoClipOptions
from rl.models import create_model, get_preset, logical_to_spec
from rl.types import Completion, Group, Request, SamplingParams

_JSON = flags.DEFINE_string("json", "", "Write the results here as JSON; empty: don't.")
_PRESET = flags.DEFINE_string("preset", "tiny", "Model preset (rl.models.PRESETS).")
_D_MODEL = flags.DEFINE_integer("d_model", 128, "Preset override: hidden size.")
_LAYERS = flags.DEFINE_integer("n_layers", 2, "Preset override: decoder layers.")
_HEADS = flags.DEFINE_integer("n_heads", 4, "Preset override: query heads.")
_KV_HEADS = flags.DEFINE_integer("n_kv_heads", 2, "Preset override: key/value heads.")
_HEAD_DIM = flags.DEFINE_integer("head_dim", 32, "Preset override: head dimension.")
_MLP = flags.DEFINE_integer("mlp_dim", 384, "Preset override: MLP hidden size.")
_GROUPS = flags.DEFINE_integer("groups", 4, "Groups (prompts) per update.")
_GROUP_SIZE = flags.DEFINE_integer("group_size", 8, "Completions per group (G).")
_PROMPT = flags.DEFINE_integer("prompt_tokens", 32, "Prompt length (every prompt).")
_MIN_RESPONSE = flags.DEFINE_integer("min_response", 32, "Shortest response.")
_MAX_RESPONSE = flags.DEFINE_integer("max_response", 96, "Longest response (one row has it).")
_LENGTHS = flags.DEFINE_enum(
    "lengths", "uniform", ["uniform", "longtail"], "Response lengths: uniform or lognormal."
)
_TAIL_MEDIAN = flags.DEFINE_float("tail_median", 24.0, "longtail: median response length.")
_TAIL_SIGMA = flags.DEFINE_float("tail_sigma", 1.0, "longtail: sigma of log(length).")
_STEPS = flags.DEFINE_integer("steps", 3, "Updates per timed run.")
_WARMUP = flags.DEFINE_integer("warmup", 1, "Untimed updates per way first (compiles).")
_REPEATS = flags.DEFINE_integer(
    "repeats", 5, "Interleaved timed runs of each way; the median counts."
)
_PIECE_REPEATS = flags.DEFINE_integer("piece_repeats", 20, "Repeats of each piece's timing.")
_BREAKDOWN = flags.DEFINE_bool("breakdown", False, "Also time the train_step and 3 jits ways.")
_DEVICES = flags.DEFINE_integer("devices", 1, "Learner mesh devices; 0: all local devices.")
_LR = flags.DEFINE_float("lr", 1e-4, "AdamW learning rate (both sides).")
_SEED = flags.DEFINE_integer("seed", 0, "Seeds the workload and the model init.")
_FIXED = flags.DEFINE_bool("fixed", True, "Time the ways above on one fixed batch.")
_RUN_UPDATES = flags.DEFINE_integer(
    "run_updates", 200, "Packed vs unpacked over a run of this many updates; 0: skip."
)
_RUN_GROUPS = flags.DEFINE_integer("run_groups", 16, "The run: groups per update (G = 8).")
_RUN_ROWS = flags.DEFINE_integer(
    "run_rows", 2, "The run: learner.micro_batch_rows (rows of 512: 1024 tokens per micro-batch)."
)
_ALL_FLAGS = (
    _PRESET,
    _D_MODEL,
    _LAYERS,
    _HEADS,
    _KV_HEADS,
    _HEAD_DIM,
    _MLP,
    _GROUPS,
    _GROUP_SIZE,
    _PROMPT,
    _MIN_RESPONSE,
    _MAX_RESPONSE,
    _LENGTHS,
    _TAIL_MEDIAN,
    _TAIL_SIGMA,
    _STEPS,
    _WARMUP,
    _REPEATS,
    _PIECE_REPEATS,
    _BREAKDOWN,
    _DEVICES,
    _LR,
    _SEED,
    _FIXED,
    _RUN_UPDATES,
    _RUN_GROUPS,
    _RUN_ROWS,
)


def make_groups(rng: np.random.Generator, vocab: int) -> list[Group]:
    """Random complete groups; sampler log-probs near a uniform policy's, so ratios stay near 1."""
    g = _GROUP_SIZE.value
    n = _GROUPS.value * g
    if _LENGTHS.value == "longtail":
        drawn = rng.lognormal(math.log(_TAIL_MEDIAN.value), _TAIL_SIGMA.value, n)
        lengths = np.clip(np.round(drawn), _MIN_RESPONSE.value, _MAX_RESPONSE.value).astype(int)
    else:
        lengths = rng.integers(_MIN_RESPONSE.value, _MAX_RESPONSE.value + 1, n)
    lengths[0] = _MAX_RESPONSE.value  # fixes the length bucket
    groups = []
    for uid in range(_GROUPS.value):
        request = Request(
            uid=uid,
            prompt=tuple(int(t) for t in rng.integers(0, vocab, _PROMPT.value)),
            group_size=g,
            params=SamplingParams(max_new_tokens=_MAX_RESPONSE.value),
        )
        completions = []
        for sample in range(g):
            n = int(lengths[uid * g + sample])
            logprobs = -math.log(vocab) + 0.1 * rng.standard_normal(n)
            completions.append(
                Completion(
                    uid=uid,
                    round=0,
                    sample=sample,
                    prompt=request.prompt,
                    tokens=tuple(int(t) for t in rng.integers(0, vocab, n)),
                    logprobs=tuple(float(x) for x in logprobs),
                    versions=(0,) * n,
                    finish_reason="length" if n == _MAX_RESPONSE.value else "stop",
                    reward=float(rng.integers(0, 2)),
                )
            )
        groups.append(Group(request=request, completions=tuple(completions)))
    return groups


def minimal_step_fn(
    graphdef: nnx.GraphDef, tx: optax.GradientTransformation, clip: PpoClipOptions
) -> Callable[..., Any]:
    """The baseline: PPO-clip, token mean, old log-probs from the sampler; nothing else."""

    def loss_fn(params: Any, batch: Batch) -> jax.Array:
        model = nnx.merge(graphdef, params)
        logp = model.token_logprobs(batch.inputs, batch.positions, batch.segments, batch.targets)
        mask = batch.loss_mask > 0
        ratio = jnp.exp(jnp.where(mask, logp - batch.behavior_logp, 0.0))
        adv = batch.advantages[:, None]
        clipped = jnp.clip(ratio, 1.0 - clip.clip_low, 1.0 + clip.clip_high)
        loss = -jnp.minimum(ratio * adv, clipped * adv)
        return jnp.sum(jnp.where(mask, loss, 0.0)) / jnp.maximum(jnp.sum(batch.loss_mask), 1.0)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params: Any, opt_state: Any, batch: Batch) -> tuple[Any, Any, jax.Array, jax.Array]:
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, optax.tree.norm(grads)

    return step


def wall_ms(fn: Callable[[], Any], repeats: int) -> float:
    """Median milliseconds of one call of `fn`."""
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        out.append(1e3 * (time.perf_counter() - start))
    return statistics.median(out)


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    with bench_util.CompileWatch() as watch:
        result = fixed_batch(watch) if _FIXED.value else {}
        maps = bench_util.release()  # the fixed batch's learners and programs
        if _RUN_UPDATES.value:
            run = run_workload(
                updates=_RUN_UPDATES.value,
                groups=_RUN_GROUPS.value,
                rows=_RUN_ROWS.value,
                seed=_SEED.value,
                watch=watch,
            )
    if _RUN_UPDATES.value:
        print("\nsequence packing over a run (launch/packing_workload.py):")
        print_table(run)
        # the run's figures are the headline: fresh lengths every update, compiles counted
        result.update(
            packing_speedup=run["packing_speedup"],
            packing_speedup_with_compiles=run["packing_speedup_with_compiles"],
            compiles_after_start=run["compiles_after_start"],
            run=run,
        )
    result.update(
        compiles_timed=watch.compiles_timed,
        compiles=watch.report(),
        memory_maps=dict(after_fixed_batch=maps, end=bench_util.memory_maps()),
    )
    print(
        f"compiles timed: {watch.compiles_timed} (every timed run, piece and update of both parts); "
        f"memory maps {maps} after the fixed batch was released, {bench_util.memory_maps()} at the end"
    )
    if _JSON.value:
        with open(_JSON.value, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {_JSON.value}")
    bench_util.fail_if_compiled("launch.bench_learner", watch.compiles_timed, watch.timed_names())


def fixed_batch(watch: bench_util.CompileWatch) -> dict[str, Any]:
    """The ways above on one fixed batch: their table, and its figures (timed parts booked as
    timed in `watch`)."""
    if not 1 <= _MIN_RESPONSE.value <= _MAX_RESPONSE.value:
        raise app.UsageError("Need 1 <= --min_response <= --max_response.")
    if min(_WARMUP.value, _STEPS.value, _REPEATS.value, _PIECE_REPEATS.value) < 1:
        raise app.UsageError("--warmup, --steps, --repeats and --piece_repeats must be >= 1.")
    overall = time.perf_counter()
    model_cfg = get_preset(
        _PRESET.value,
        d_model=_D_MODEL.value,
        n_layers=_LAYERS.value,
        n_heads=_HEADS.value,
        n_kv_heads=_KV_HEADS.value,
        head_dim=_HEAD_DIM.value,
        mlp_dim=_MLP.value,
    )
    model = create_model(model_cfg, seed=_SEED.value)
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    groups = make_groups(np.random.default_rng(_SEED.value), model_cfg.vocab_size)
    rows = _GROUPS.value * _GROUP_SIZE.value
    n_devices = _DEVICES.value or jax.device_count()
    mesh, _ = make_meshes(MeshConfig(learner_devices=n_devices, colocated=True))
    opt_cfg = OptimizerConfig(lr=_LR.value)
    cfg = LearnerConfig(
        optimizer=opt_cfg,
        policy_loss="ppo_clip",
        aggregation="token_mean",
        advantage="grpo",
        old_logprobs="sampler",
        micro_batch_rows=rows,  # the whole update in one micro-batch
        max_length=_PROMPT.value + _MAX_RESPONSE.value,
        entropy_metric=False,
    )

    # The batch the learner builds: GRPO advantages group by group (as add_groups), make_batch.
    estimator = get_advantage_estimator(cfg.advantage)

    def advantages() -> list[tuple[float, ...]]:
        return [
            tuple(float(a) for a in np.asarray(estimator(np.asarray([g.rewards], np.float32)))[0])
            for g in groups
        ]

    advs = advantages()
    build = lambda: make_batch(groups, advs, rows=rows, min_length_bucket=cfg.min_length_bucket)
    host_batch = build()
    tokens = host_batch.num_tokens
    seq_len = host_batch.inputs.shape[1]
    batch_shardings = jax.tree.map(  # as Learner places a batch: rows over the batch axes
        lambda x: jax.NamedSharding(
            mesh, logical_to_spec(("batch",) + (None,) * (x.ndim - 1), mesh, shape=x.shape)
        ),
        host_batch,
    )
    mesh_batch = jax.device_put(host_batch, batch_shardings)

    # --- learner: the whole public path, add_groups and update timed apart too.
    learner = Learner(model, cfg, mesh=mesh)
    learner.begin_round(updates=1 << 30)  # old log-probs from the sampler: no snapshot is taken
    unpacked_cfg = dataclasses.replace(cfg, packing=False)
    unpacked = Learner(model, unpacked_cfg, mesh=mesh)
    unpacked.begin_round(updates=1 << 30)
    first: dict[str, dict[str, float]] = {}
    learner_parts: dict[str, list[float]] = {"add_groups": [], "update": []}
    # the padded share of the model positions: the learner's micro-batches (its update's metric),
    # the minimal step's one unpacked batch
    padded = dict(unpacked=host_batch.padded_fraction)
    packed_positions = 0

    def learner_update() -> None:
        t0 = time.perf_counter()
        learner.add_groups(groups)
        t1 = time.perf_counter()
        m = learner.update()
        learner_parts["add_groups"].append(1e3 * (t1 - t0))
        learner_parts["update"].append(1e3 * (time.perf_counter() - t1))
        first.setdefault("learner", dict(loss=m["loss"], grad_norm=m["grad_norm"]))
        nonlocal packed_positions
        padded["packed"], packed_positions = m["padded_fraction"], int(m["positions"])

    def unpacked_update() -> None:
        unpacked.add_groups(groups)
        m = unpacked.update()
        first.setdefault("learner-unpacked", dict(loss=m["loss"], grad_norm=m["grad_norm"]))

    # --- minimal, on the mesh's first device (the same device with --devices 1).
    device = mesh.devices.flat[0]
    graphdef, params0 = nnx.split(model)
    tx = optax.chain(
        optax.clip_by_global_norm(opt_cfg.grad_clip_norm),
        optax.adamw(
            opt_cfg.lr,
            b1=opt_cfg.b1,
            b2=opt_cfg.b2,
            eps=opt_cfg.eps,
            weight_decay=opt_cfg.weight_decay,
        ),
    )
    step = minimal_step_fn(graphdef, tx, cfg.loss.ppo_clip)
    dev_batch = jax.device_put(host_batch, device)
    params = jax.device_put(jax.tree.map(jnp.copy, params0), device)  # the model's stay undonated
    mini: dict[str, Any] = dict(params=params, opt_state=jax.jit(tx.init)(params), loss=None)

    def minimal_step() -> None:
        mini["params"], mini["opt_state"], mini["loss"], gnorm = step(
            mini["params"], mini["opt_state"], dev_batch
        )
        if "minimal" not in first:
            first["minimal"] = dict(loss=float(mini["loss"]), grad_norm=float(gnorm))

    def minimal_sync_step() -> None:
        minimal_step()
        float(mini["loss"])

    # --- the learner's own step functions, jitted here, on the mesh batch: breakdown and pieces.
    ltx, schedule = make_optimizer(opt_cfg), make_lr_schedule(opt_cfg)
    with jax.set_mesh(mesh):
        state, _ = create_train_state(jax.tree.map(jnp.copy, params0), ltx, mesh=mesh)
    own: dict[str, Any] = dict(state=state)
    kw = dict(graphdef=graphdef, cfg=cfg)
    zero_fn = jax.jit(zero_accum)
    apply_fn = jax.jit(functools.partial(apply, tx=ltx, schedule=schedule), donate_argnums=(0,))

    ways: dict[str, Callable[[], None]] = {
        "minimal": minimal_step,
        "minimal+sync": minimal_sync_step,
    }
    if _BREAKDOWN.value:
        fused_fn = jax.jit(
            functools.partial(train_step, tx=ltx, schedule=schedule, **kw), donate_argnums=(0,)
        )
        acc_fn = jax.jit(functools.partial(accumulate, **kw), donate_argnums=(0,))

        def fused_step() -> None:
            with jax.set_mesh(mesh):
                own["state"], metrics = fused_fn(own["state"], mesh_batch)
            jax.device_get(metrics)

        def three_jits_step() -> None:
            with jax.set_mesh(mesh):
                acc = acc_fn(zero_fn(own["state"].params), own["state"].params, mesh_batch)
                own["state"], metrics = apply_fn(own["state"], acc)
            jax.device_get(metrics)

        ways.update({"train_step": fused_step, "3 jits": three_jits_step})
    ways["learner"] = learner_update
    ways["learner-unpacked"] = unpacked_update
    settle = lambda: jax.block_until_ready(
        (mini["params"], own["state"], learner.state, unpacked.state)
    )

    # Warm-up: compiles every program (the first calls give the agreement check).
    start = time.perf_counter()
    for fn in ways.values():
        for _ in range(_WARMUP.value):
            fn()
    settle()
    warmup_seconds = time.perf_counter() - start
    for v in learner_parts.values():
        v.clear()

    load_before = os.getloadavg()[0]
    runs: dict[str, list[float]] = {name: [] for name in ways}
    names = list(ways)
    for r in range(_REPEATS.value):
        for name in names[r % len(names) :] + names[: r % len(names)]:  # rotated: no fixed order
            fn = ways[name]
            settle()
            with watch.timed():
                t0 = time.perf_counter()
                for _ in range(_STEPS.value):
                    fn()
                settle()
                runs[name].append(time.perf_counter() - t0)
    load_after = os.getloadavg()[0]
    best_ms = {name: 1e3 * min(r) / _STEPS.value for name, r in runs.items()}
    worst_ms = {name: 1e3 * max(r) / _STEPS.value for name, r in runs.items()}
    # The same repeat's runs ran seconds apart, under much the same outside load.
    paired_spread = bench_util.spread(
        a / b for a, b in zip(runs["learner-unpacked"], runs["minimal"], strict=True)
    )
    pack_spread = bench_util.spread(
        a / b for a, b in zip(runs["learner-unpacked"], runs["learner"], strict=True)
    )
    paired, pack_paired = paired_spread["median"], pack_spread["median"]
    ms = {name: 1e3 * statistics.median(r) / _STEPS.value for name, r in runs.items()}
    rate = {name: 1e3 * tokens / v for name, v in ms.items()}

    # Pieces of one update, each alone with the device otherwise idle (median ms).
    @functools.partial(jax.jit, donate_argnums=(1, 2))
    def opt_only(grads: Any, params: Any, opt_state: Any) -> tuple[Any, Any]:
        """The minimal step's optimizer part alone: what apply does at the least."""
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    grads = jax.tree.map(lambda p: jnp.full(p.shape, 1e-3, p.dtype), mini["params"])

    def opt_only_ms() -> float:
        jax.block_until_ready((mini["params"], mini["opt_state"]))
        t0 = time.perf_counter()
        mini["params"], mini["opt_state"] = opt_only(grads, mini["params"], mini["opt_state"])
        jax.block_until_ready(mini["params"])
        return 1e3 * (time.perf_counter() - t0)

    def apply_ms(fetch: bool) -> float:
        acc = jax.block_until_ready(zero_fn(own["state"].params))
        acc.denominator = jnp.ones((), jnp.float32)
        t0 = time.perf_counter()
        with jax.set_mesh(mesh):
            own["state"], metrics = apply_fn(own["state"], acc)
        jax.block_until_ready((own["state"], metrics))
        t1 = time.perf_counter()
        jax.device_get(metrics)  # fresh arrays: nothing cached on the host yet
        return 1e3 * ((time.perf_counter() - t1) if fetch else (t1 - t0))

    n = _PIECE_REPEATS.value
    opt_only_ms(), apply_ms(False)  # their first calls compile: not timed
    with watch.timed():
        pieces = dict(
            advantages=wall_ms(advantages, n),
            make_batch=wall_ms(build, n),
            device_put=wall_ms(
                lambda: jax.block_until_ready(jax.device_put(host_batch, batch_shardings)), n
            ),
            zero_accum=wall_ms(lambda: jax.block_until_ready(zero_fn(own["state"].params)), n),
            apply=statistics.median(apply_ms(False) for _ in range(n)),
            optax_update=statistics.median(opt_only_ms() for _ in range(n)),
            metrics_fetch=statistics.median(apply_ms(True) for _ in range(n)),
        )
    calls = {k: statistics.median(v) for k, v in learner_parts.items()}
    # The learner's serial extra per update by the pieces: host work before accumulate is
    # dispatched (the device is idle: the previous update ended in a fetch), the zero_accum jit,
    # apply beyond the bare optax update, the fetch. Not in it: accumulate's extra math (metric
    # sums, the float32 add into the accumulator; --breakdown measures it) and dispatch.
    extra_ms = sum(
        pieces[k] for k in ("advantages", "make_batch", "device_put", "zero_accum", "metrics_fetch")
    ) + max(0.0, pieces["apply"] - pieces["optax_update"])
    total_seconds = time.perf_counter() - overall

    base = rate["minimal"]
    overhead = base / rate["learner-unpacked"]
    pack_speedup = rate["learner"] / rate["learner-unpacked"]
    print(
        f"model: {_PRESET.value} with d_model {_D_MODEL.value}, {_LAYERS.value} layers, mlp "
        f"{_MLP.value}, vocab {model_cfg.vocab_size}: {n_params / 1e6:.2f}M params, "
        f"{model_cfg.dtype}; {jax.default_backend()}, learner mesh {dict(mesh.shape)}"
    )
    print(
        f"batch: {_GROUPS.value} groups x {_GROUP_SIZE.value} = {rows} rows x {seq_len} positions, "
        f"{tokens} loss tokens ({tokens / (rows * seq_len):.0%} of the padded batch); "
        f"median of {_REPEATS.value} runs of {_STEPS.value} updates; {_LENGTHS.value} lengths"
    )
    print(
        f"packed: {packed_positions} positions; padded-token fraction packed "
        f"{padded['packed']:.1%}, unpacked {padded['unpacked']:.1%}"
    )
    print(
        f"{'way':<14}{'ms/update':>10}{'best':>8}{'worst':>8}{'tokens/s':>10}{'vs minimal':>11}"
        f"{'+ms':>8}"
    )
    prev = None
    for name in ways:
        delta = "" if prev is None else f"{ms[name] - ms[prev]:+.1f}"
        print(
            f"{name:<14}{ms[name]:>10.1f}{best_ms[name]:>8.1f}{worst_ms[name]:>8.1f}"
            f"{rate[name]:>10.0f}"
            f"{rate[name] / base:>11.3f}{delta:>8}"
        )
        prev = name
    print(
        f"(ms/update, tokens/s: the median of {_REPEATS.value} runs; best / worst: the fastest / "
        "slowest run; +ms: vs the row above)"
    )
    print("pieces of an update, each alone, median ms:")
    for k, v in pieces.items():
        print(f"  {k:<16}{v:>8.2f}")
    print(
        f"learner calls in its timed runs, median ms: add_groups {calls['add_groups']:.2f} "
        f"(host work + dispatch, the device idle), update {calls['update']:.1f}"
    )
    print(
        f"by the pieces: the learner adds ~{extra_ms:.1f} ms/update to minimal's "
        f"{ms['minimal']:.1f}, an expected ratio of {1 + extra_ms / ms['minimal']:.3f}"
    )
    print(
        f"overhead_ratio (minimal / learner-unpacked tokens/s): {overhead:.3f} (target <= 1.10: "
        f"{'met' if overhead <= 1.10 else 'NOT met'})"
    )
    print(
        "overhead_ratio_paired (over repeats, learner-unpacked / minimal s of the same repeat): "
        f"min / median / max {bench_util.spread_text(paired_spread)}"
    )
    # The packing target is a long tail's (issue 26); on uniform lengths there is no tail to pack.
    met = padded["packed"] <= 0.10 and pack_speedup >= 1.5
    target = (
        f"target <= 10% and >= 1.5x: {'met' if met else 'NOT met'}"
        if _LENGTHS.value == "longtail"
        else "uniform lengths, one micro-batch: nothing for packing to save; the run part below "
        "is its measure"
    )
    print(
        f"packing: learner / learner-unpacked tokens/s {pack_speedup:.2f}x (paired min / median / "
        f"max {bench_util.spread_text(pack_spread, '.2f')}), padded {padded['packed']:.1%} vs "
        f"{padded['unpacked']:.1%} ({target})"
    )
    cores = os.cpu_count() or 1
    print(
        f"load average {load_before:.1f} before timing, {load_after:.1f} after, {cores} cores"
        + (
            ""
            if max(load_before, load_after) < cores
            else ": a shared, busy machine; noisy figures"
        )
    )
    lf, uf, mf = first["learner"], first["learner-unpacked"], first["minimal"]
    print(
        f"first update, learner / learner-unpacked / minimal: loss {lf['loss']:.6f} / "
        f"{uf['loss']:.6f} / {mf['loss']:.6f}, grad_norm {lf['grad_norm']:.6f} / "
        f"{uf['grad_norm']:.6f} / {mf['grad_norm']:.6f}"
    )
    print(f"warm-up (compiles): {warmup_seconds:.1f} s; total {total_seconds:.1f} s")

    return dict(
        learner_tokens_per_s=rate["learner"],
        minimal_tokens_per_s=base,
        overhead_ratio=overhead,
        overhead_ratio_paired=paired,
        packing_speedup_fixed_batch=pack_speedup,
        packing_speedup_fixed_batch_paired=pack_paired,
        padded_fraction=padded,
        packed_positions=packed_positions,
        load_average=dict(before=load_before, after=load_after, cores=os.cpu_count()),
        tokens_per_s=rate,
        ms_per_update=ms,
        best_ms_per_update=best_ms,
        worst_ms_per_update=worst_ms,
        overhead_ratio_paired_spread=paired_spread,
        packing_speedup_fixed_batch_paired_spread=pack_spread,
        seconds=dict(runs=runs, warmup=warmup_seconds, total=total_seconds),
        pieces_ms=pieces,
        learner_calls_ms=calls,
        pieces_extra_ms=extra_ms,
        pieces_expected_ratio=1 + extra_ms / ms["minimal"],
        first_update=first,
        loss_tokens_per_update=tokens,
        padded_tokens_per_update=rows * seq_len,
        config=dict(
            {f.name: f.value for f in _ALL_FLAGS},
            rows=rows,
            seq_len=seq_len,
            params=n_params,
            vocab_size=model_cfg.vocab_size,
            dtype=model_cfg.dtype,
            policy_loss=cfg.policy_loss,
            aggregation=cfg.aggregation,
            advantage=cfg.advantage,
            old_logprobs=cfg.old_logprobs,
            micro_batch_rows=cfg.micro_batch_rows,
            entropy_metric=cfg.entropy_metric,
            backend=jax.default_backend(),
            mesh=dict(mesh.shape),
        ),
    )


if __name__ == "__main__":
    app.run(main)
