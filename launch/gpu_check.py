"""One-shot hardware check: decode, learner, publish and a pipelined round on this machine's device.

    python -m launch.gpu_check                    # Qwen3-0.6B and -1.7B shapes, random init, bf16
    python -m launch.gpu_check --preset tiny      # the same program on CPU in seconds (a test runs it)
    python -m launch.gpu_check --attention_kernel=pallas_tpu   # on a TPU: JAX's paged kernel

Per model (random init, bfloat16 compute, float32 master weights and full remat on the learner, as
the GPU recipes), on one device (learner and sampler colocated), with the preset's shapes (Shapes):
  publish   learner -> sampler weights (learner.publish.DevicePutSync, cast to bf16): GB/s of the
            sampler's copy, median of --publish_repeats.
  decode    the engine (sampler/engine.py) with `slots` slots all decoding, timed over
            `decode_calls` generate calls after a warm-up call: tokens/s and the decode's fraction
            of its memory roofline: a step must read the weights once and the KV of every live
            position (slots x mean live length x KV bytes per token), so the roofline step time is
            (weight bytes + live KV bytes) / the device's peak (PEAK_HBM_BYTES_S), and
            hbm_fraction = roofline step / measured step (= achieved bytes/s / peak). The KV term
            counts only the positions a step must read, as rl/sim/presets.py's decode_c does, so
            the fraction is what the math needs, not what an engine reading its whole cache moves.
  learner   Learner.add_groups + update on `rows` sequences of `seq_len` tokens: tokens/s and
            MFU = model FLOPs / time / peak bf16 FLOP/s (PEAK_BF16_FLOPS), model FLOPs per token
            6 N (N: matmul parameters; an untied embedding lookup is not a matmul) + 6 L H d_h T
            (causal attention over a row of T positions); remat's recompute is not counted.
  round     one round of `groups` groups x `group_size` samples: sync (rollout all, then train)
            vs cgp+frontier+ordered (every complete group trained as it arrives), each after a
            warm-up round: rollout-to-train-end seconds and their ratio.
Devices not in the peak tables print "unknown" for the fractions (a CPU always does).
Prints one table and writes --json. With the default preset the whole check is meant to end within
8 minutes on one H100/H200-class GPU; the total wall time is printed.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import math
import os
import statistics
import time
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
from absl import app, flags

from configs import base
from rl.driver import DriverConfig
from rl.models import get_preset
from rl.models.build import model_config_from
from rl.models.config import ModelConfig
from rl.runtime.compose import Setup
from rl.runtime.threads import ThreadsRuntime
from rl.schedules import mode_fields
from rl.types import Completion, Group, Prompt, Request, SamplingParams

# Datasheet peaks, matched against jax's device_kind (lower-cased) in order: first match wins.
PEAK_HBM_BYTES_S: tuple[tuple[str, float], ...] = (
    ("h200", 4.8e12),
    ("h100 pcie", 2.0e12),
    ("h100", 3.35e12),  # SXM5
    ("a100-sxm4-80gb", 2.039e12),
    ("a100 80gb pcie", 1.935e12),
    ("a100", 1.555e12),  # 40GB
    ("l4", 300e9),
    ("tpu v5 lite", 819e9),  # v5e
    ("tpu v5e", 819e9),
    ("tpu v5p", 2.765e12),
    ("tpu v5", 2.765e12),
    ("tpu v6 lite", 1.64e12),  # v6e (Trillium)
    ("tpu v4", 1.2e12),
)
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (  # dense, no sparsity
    ("h200", 989e12),
    ("h100 pcie", 756e12),
    ("h100", 989e12),
    ("a100", 312e12),
    ("l4", 121e12),
    ("tpu v5 lite", 197e12),
    ("tpu v5e", 197e12),
    ("tpu v5p", 459e12),
    ("tpu v5", 459e12),
    ("tpu v6 lite", 918e12),
    ("tpu v4", 275e12),
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Shapes:
    models: tuple[str, ...]
    slots: int  # decoding sequences
    prompt_len: int
    decode_calls: int  # timed generate calls
    steps_per_call: int
    rows: int  # learner sequences per update
    seq_len: int  # learner tokens per sequence (prompt + response)
    groups: int  # round: groups of group_size samples
    group_size: int
    max_new_tokens: int  # round: response cap


PRESETS = {
    "gpu": Shapes(
        models=("qwen3-0.6b", "qwen3-1.7b"),
        slots=128,
        prompt_len=256,
        decode_calls=32,
        steps_per_call=8,
        rows=16,
        seq_len=1024,
        groups=16,
        group_size=8,
        max_new_tokens=256,
    ),
    "tiny": Shapes(
        models=("tiny",),
        slots=8,
        prompt_len=8,
        decode_calls=4,
        steps_per_call=4,
        rows=4,
        seq_len=32,
        groups=4,
        group_size=2,
        max_new_tokens=8,
    ),
}

_PRESET = flags.DEFINE_enum("preset", "gpu", sorted(PRESETS), "Shapes: gpu (Qwen3) or tiny (CPU).")
_JSON = flags.DEFINE_string("json", "runs/gpu_check.json", "Write the results here as JSON.")
_PUBLISH_REPEATS = flags.DEFINE_integer("publish_repeats", 3, "Timed publishes per model.")
_SEED = flags.DEFINE_integer("seed", 0, "Seeds the model init and the synthetic data.")
_KERNEL = flags.DEFINE_enum(
    "attention_kernel",
    "xla",
    ["xla", "pallas", "pallas_tpu"],
    "The engine's decode attention (config.engine.attention_kernel, rl/models/paged_attention.py): "
    "xla (the default, everywhere) | pallas (ours, written for GPUs) | pallas_tpu (JAX's TPU "
    "kernel); none of the Pallas ones has run on its hardware yet.",
)


def peak(table: tuple[tuple[str, float], ...], kind: str) -> float | None:
    """The table's figure for a jax device_kind, or None when the device is not in it."""
    k = kind.lower()
    return next((v for key, v in table if key in k), None)


def tree_bytes(tree: Any) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def matmul_params(cfg: ModelConfig, n_params: int) -> int:
    """Parameters that take part in a matmul per token (an untied embedding table does not)."""
    return n_params - (0 if cfg.tie_embeddings else cfg.vocab_size * cfg.d_model)


def random_groups(rng: np.random.Generator, shapes: Shapes, vocab: int) -> list[Group]:
    """rows sequences of seq_len tokens (a quarter prompt), as groups of group_size."""
    g = shapes.group_size
    prompt_len = shapes.seq_len // 4
    n = shapes.seq_len - prompt_len + 1  # inputs = (prompt + response)[:-1]: seq_len positions
    groups = []
    for uid in range(-(-shapes.rows // g)):
        prompt = tuple(int(t) for t in rng.integers(0, vocab, prompt_len))
        comps = tuple(
            Completion(
                uid=uid,
                round=0,
                sample=s,
                prompt=prompt,
                tokens=tuple(int(t) for t in rng.integers(0, vocab, n)),
                logprobs=tuple(float(x) for x in -math.log(vocab) + 0.1 * rng.standard_normal(n)),
                versions=(0,) * n,
                finish_reason="length",
                reward=float(s % 2),
            )
            for s in range(g)
        )
        groups.append(
            Group(request=Request(uid=uid, prompt=prompt, group_size=g), completions=comps)
        )
    return groups


def runtime_config(name: str, shapes: Shapes, max_length: int) -> Any:
    """The check's run as a config for the composition root: the preset with bfloat16 compute,
    its own parameter dtype (float32 master weights) and full remat on the learner, as the GPU
    recipes train; learner and sampler colocated on one device; weights published as bf16."""
    preset = get_preset(name)
    config = base.get_config()
    config.seed = _SEED.value
    config.tokenizer = "byte"  # the check feeds random token ids; nothing is decoded
    config.model.preset = name
    config.model.param_dtype = preset.param_dtype
    config.model.dtype, config.model.remat = "bfloat16", "full"
    config.model.logits_chunk = preset.logits_chunk
    config.mesh.learner_devices = config.mesh.sampler_devices = 1
    config.mesh.colocated = True
    config.sampler_dtype = "bfloat16"
    config.learner.optimizer.lr = 1e-6
    config.learner.micro_batch_rows = shapes.rows
    config.learner.old_logprobs = "sampler"
    config.learner.entropy_metric = False
    config.learner.min_length_bucket = shapes.seq_len
    config.engine.max_slots = shapes.slots
    config.engine.max_length = max_length
    config.engine.max_prefill_length = shapes.prompt_len
    config.engine.min_prefill_bucket = shapes.prompt_len
    config.engine.steps_per_call = shapes.steps_per_call
    config.engine.attention_kernel = _KERNEL.value
    return config


def check_model(name: str, shapes: Shapes, kind: str) -> dict[str, Any]:
    """Publish, decode, learner and round figures of one model (see the module docstring)."""
    seed = _SEED.value
    k, calls = shapes.steps_per_call, shapes.decode_calls
    # One engine for the decode figures and the rounds (one set of compiles); the engine strips
    # the learner's remat (sampler/engine.py).
    max_length = shapes.prompt_len + max((calls + 1) * k, shapes.max_new_tokens) + 1
    config = runtime_config(name, shapes, max_length)
    cfg = model_config_from(config.model)
    runtime = ThreadsRuntime(config, Setup.from_config(config), total_updates=0)
    try:
        return _check(runtime, name, cfg, shapes, kind, seed, max_length)
    finally:
        runtime.close()


def _check(
    runtime: ThreadsRuntime,
    name: str,
    cfg: ModelConfig,
    shapes: Shapes,
    kind: str,
    seed: int,
    max_length: int,
) -> dict[str, Any]:
    """check_model's measurements on the runtime's learner, weight sync and engine."""
    learner, sync, engine = runtime.learner, runtime.weight_sync, runtime.engine
    n_params = sum(x.size for x in jax.tree.leaves(learner.params))
    out: dict[str, Any] = dict(model=name, params=n_params)
    rng = np.random.default_rng(seed)

    # --- learner
    groups = random_groups(rng, shapes, cfg.vocab_size)

    def update() -> None:
        learner.begin_round(updates=1)
        learner.add_groups(groups)
        learner.update()

    update()  # compiles
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        update()
        times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    tokens = len(groups) * shapes.group_size * shapes.seq_len
    flops = tokens * (
        6 * matmul_params(cfg, n_params)
        + 6 * cfg.n_layers * cfg.n_heads * cfg.head_dim * shapes.seq_len
    )
    peak_flops = peak(PEAK_BF16_FLOPS, kind)
    out["learner"] = dict(
        tokens_per_update=tokens,
        update_s=step_s,
        tokens_per_s=tokens / step_s,
        model_flops_per_update=flops,
        mfu=None if peak_flops is None else flops / step_s / peak_flops,
    )

    # --- publish (learner float32 master -> sampler bf16 copy)
    published = sync.publish(learner.params, 0)  # compiles the cast
    seconds = [sync.publish(learner.params, i + 1).seconds for i in range(_PUBLISH_REPEATS.value)]
    weight_bytes = tree_bytes(published.params)
    out["publish"] = dict(
        bytes=weight_bytes,
        seconds=statistics.median(seconds),
        gb_per_s=weight_bytes / statistics.median(seconds) / 1e9,
    )

    # --- decode: every slot decoding, from one shared prompt's prefill
    k, calls = shapes.steps_per_call, shapes.decode_calls
    params = published.params
    request = Request(
        uid=0,
        prompt=tuple(int(t) for t in rng.integers(0, cfg.vocab_size, shapes.prompt_len)),
        group_size=shapes.slots,
        params=SamplingParams(temperature=1.0, max_new_tokens=max_length - shapes.prompt_len),
    )
    state = engine.init_decode_state()
    state = engine.bulk_insert(
        engine.prefill(params, request.prompt), state, list(range(shapes.slots)), request
    )
    state, result = engine.generate(params, state)  # compiles
    jax.block_until_ready(result)
    t0 = time.perf_counter()
    for _ in range(calls):
        state, result = engine.generate(params, state)
    jax.block_until_ready(result)
    decode_s = time.perf_counter() - t0
    if not bool(np.asarray(result.valid).all()):
        raise RuntimeError("gpu_check: a slot stopped decoding during the timed calls.")
    steps = calls * k
    kv_per_token = engine.cache_bytes_per_slot // engine.layout.length  # exact: all layers, K + V
    live = shapes.prompt_len + k + (steps + 1) / 2  # mean positions read per step and slot
    kv_bytes_per_step = shapes.slots * live * kv_per_token
    bytes_per_step = weight_bytes + kv_bytes_per_step
    step_time = decode_s / steps
    peak_bw = peak(PEAK_HBM_BYTES_S, kind)
    roofline_s = None if peak_bw is None else bytes_per_step / peak_bw
    out["decode"] = dict(
        slots=shapes.slots,
        steps=steps,
        step_s=step_time,
        tokens_per_s=shapes.slots * steps / decode_s,
        kv_bytes_per_token=kv_per_token,
        kv_bytes_per_step=kv_bytes_per_step,
        bytes_per_step=bytes_per_step,  # weights + live KV: what the roofline counts
        achieved_bytes_per_s=bytes_per_step / step_time,
        roofline_step_s=roofline_s,
        hbm_fraction=None if roofline_s is None else roofline_s / step_time,
    )
    del state, result

    # --- a round: sync vs cgp+frontier+ordered, same engine, learner and prompts
    out["round"] = {}
    for mode in ("sync", "cgp+frontier+ordered"):
        fields = mode_fields(mode)
        fields.pop("tail_enabled")
        dcfg = DriverConfig(
            **fields,
            groups_per_round=shapes.groups,
            groups_per_update=max(1, shapes.groups // 4),
            group_size=shapes.group_size,
            sampling=SamplingParams(temperature=1.0, max_new_tokens=shapes.max_new_tokens),
        )

        def prompts(seed: int = seed) -> Iterator[Prompt]:
            r = np.random.default_rng([seed, 1])
            uid = 0
            while True:
                n = shapes.prompt_len
                yield Prompt(
                    uid=uid, tokens=tuple(int(t) for t in r.integers(0, cfg.vocab_size, n))
                )
                uid += 1

        driver = runtime.driver(
            dcfg, prompts=prompts(), reward_fn=lambda req, c: float(c.tokens[0] % 2)
        )
        try:
            driver.run_round(0)  # compiles
            m = driver.run_round(1).metrics
        finally:
            driver.close()
        out["round"][mode] = dict(
            rollout_to_train_end_s=float(m["rollout_to_train_end_s"]),
            trainer_wait_ratio=float(m["trainer_wait_ratio"]),
        )
    r = out["round"]
    r["cgp_vs_sync"] = (
        r["cgp+frontier+ordered"]["rollout_to_train_end_s"] / r["sync"]["rollout_to_train_end_s"]
    )
    return out


def fmt(x: float | None, spec: str) -> str:
    return "unknown" if x is None else format(x, spec)


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    if _PUBLISH_REPEATS.value < 1:
        raise app.UsageError(f"--publish_repeats must be >= 1; received {_PUBLISH_REPEATS.value}.")
    start = time.perf_counter()
    shapes = PRESETS[_PRESET.value]
    device = jax.devices()[0]
    kind = device.device_kind
    results = []
    for name in shapes.models:
        results.append(check_model(name, shapes, kind))
        gc.collect()  # the previous model's learner and engine go before the next is built
    total = time.perf_counter() - start
    hbm, flops = peak(PEAK_HBM_BYTES_S, kind), peak(PEAK_BF16_FLOPS, kind)
    print(
        f"device: {device.platform} {kind!r} (peak HBM {fmt(hbm and hbm / 1e9, '.0f')} GB/s, "
        f"bf16 {fmt(flops and flops / 1e12, '.0f')} TFLOP/s"
        + ("" if hbm and flops else "; not in the peak tables: fractions unknown")
        + f"); preset {_PRESET.value}; decode attention {_KERNEL.value}"
    )
    print(
        f"{'model':<12}{'params':>8}{'decode tok/s':>13}{'HBM frac':>9}{'learner tok/s':>14}"
        f"{'MFU':>7}{'publish GB/s':>13}{'sync r2t s':>11}{'cgp r2t s':>10}{'cgp/sync':>9}"
    )
    for r in results:
        d, lr, p, rd = r["decode"], r["learner"], r["publish"], r["round"]
        print(
            f"{r['model']:<12}{r['params'] / 1e6:>7.1f}M{d['tokens_per_s']:>13.0f}"
            f"{fmt(d['hbm_fraction'], '.1%'):>9}{lr['tokens_per_s']:>14.0f}"
            f"{fmt(lr['mfu'], '.1%'):>7}{p['gb_per_s']:>13.2f}"
            f"{rd['sync']['rollout_to_train_end_s']:>11.2f}"
            f"{rd['cgp+frontier+ordered']['rollout_to_train_end_s']:>10.2f}"
            f"{rd['cgp_vs_sync']:>9.2f}"
        )
    print(
        f"decode: {shapes.slots} slots, {shapes.decode_calls} x {shapes.steps_per_call} steps, "
        "HBM frac = (weights + live KV bytes) per step at peak HBM / the measured step; "
        f"learner: {shapes.rows} x {shapes.seq_len} tokens; round: {shapes.groups} groups x "
        f"{shapes.group_size}, <= {shapes.max_new_tokens} new tokens; total {total:.0f} s"
        + (" (over the 8-minute budget)" if total > 480 else "")
    )
    if _JSON.value:
        os.makedirs(os.path.dirname(_JSON.value) or ".", exist_ok=True)
        with open(_JSON.value, "w", encoding="utf-8") as f:
            json.dump(
                dict(
                    device=dict(
                        platform=device.platform,
                        kind=kind,
                        peak_hbm_bytes_s=hbm,
                        peak_bf16_flops=flops,
                    ),
                    preset=_PRESET.value,
                    attention_kernel=_KERNEL.value,
                    shapes=dataclasses.asdict(shapes),
                    models=results,
                    total_s=total,
                ),
                f,
                indent=2,
            )
        print(f"wrote {_JSON.value}")


if __name__ == "__main__":
    app.run(main)
