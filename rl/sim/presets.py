"""GPU presets: stage-time models of a model on a GPU, from parameter bytes, bandwidth and MFU.

Nothing here is measured: every number is a datasheet figure or a stated assumption (the
`Assumptions` fields, each with its reason), so a preset is a transparent roofline estimate to be
replaced by a `launch.profile` fit on the real hardware. Formulas (N params, P = 2 bytes bf16):

    decode step   a = step_overhead + N P / (tp BW eff_bw)            weights read once per step
                  b = 2 N / (tp peak decode_mfu)                      each sequence's matmuls
                  c = kv_bytes_per_token / (tp BW eff_bw)             its KV cache read
    prefill       per token 2 N / (tp peak prefill_mfu), plus a fixed launch cost
    learner       per token learner_flops_per_param N / (D peak learner_mfu), micro-batches packed
    update        AdamW over fp32 master + 2 moments (16 B/param read + written, sharded over D)
                  + a gradient reduce-scatter over NVLink + a fixed cost
    publish       N P bytes at sync_bw + a fixed pause/resume cost
    migrate       a request's KV (kv_bytes_per_token per token) over NVLink (replicas on one node)
                  + a fixed cost
    KV memory     free = HBM (1 - mem_reserve) - weights, per replica; two layouts (`kv_layout`):
      "paged"     slots = max_slots; a pool of free / (kv_bytes_per_token page_size) pages that
                  sequences take as they grow, a group's prompt pages once (rl/sim/paging.py);
                  a preempted sequence's pages go to the host and back at host_bw
      "dense"     slots = min(max_slots, free / (kv_bytes_per_token max_length)): every slot
                  reserves max_length = the workload's prompt + response cap
The decode step's KV term (c) is the same in both: attention reads the live positions only (paged
kernels read a sequence's pages, dense GPU engines stop at its length), so the layouts differ in
how many sequences run at once, not in what one step reads.
"""

from __future__ import annotations

import dataclasses

from rl.elastic.stage import StageModel
from rl.models.config import PRESETS, ModelConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class GpuSpec:
    name: str
    bf16_flops: float  # dense, no sparsity (datasheet)
    hbm_bw: float  # bytes/s (datasheet)
    hbm_bytes: float  # memory (datasheet)
    nvlink_bw: float  # bytes/s, one direction (datasheet: 900 GB/s bidirectional)


GPUS = {
    "h100": GpuSpec(
        name="H100 SXM5 80GB", bf16_flops=989e12, hbm_bw=3.35e12, hbm_bytes=80e9, nvlink_bw=450e9
    ),
    "h200": GpuSpec(
        name="H200 SXM 141GB", bf16_flops=989e12, hbm_bw=4.8e12, hbm_bytes=141e9, nvlink_bw=450e9
    ),
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Assumptions:
    """The non-datasheet numbers of a preset, each with the reason for its value."""

    eff_bw: float = 0.7  # decode kernels reach ~70% of HBM peak (memory-bound GEMV + paged KV)
    step_overhead_s: float = 0.004  # per decode step: scheduler, sampling, launches (CUDA graphs);
    # vLLM/SGLang single-stream inter-token latency of ~1-2B models is ~4-6 ms on H100
    decode_mfu: float = 0.5  # the per-sequence matmuls of a large decode batch
    prefill_mfu: float = 0.5  # prefill is compute-bound; ~50% of peak at a few hundred tokens
    prefill_fixed_s: float = 0.005  # per prefill call (launch, scheduling)
    learner_mfu: float = 0.35  # Megatron/FSDP on a 1-2B model with long sequences: 30-45%
    learner_flops_per_param: float = 8.0  # per token: 6 (forward + backward) + 2 (old log-probs
    # recomputed by a forward of the behaviour policy, as veRL/slime do); attention FLOPs not
    # counted (~13% more at 2k context for Qwen3-1.7B)
    micro_fixed_s: float = 0.02  # per micro-batch (launch, data movement)
    update_fixed_s: float = 0.05  # per optimizer step (clip, scheduler, bookkeeping)
    sync_bw: float = 50e9  # weight transfer learner -> sampler: 400 Gb/s IB (cross-node NCCL)
    sync_fixed_s: float = 1.0  # pause the engines, load, resume (slime/veRL: seconds)
    migrate_fixed_s: float = 0.01  # per migrated request: export, import, re-schedule (a few
    # kernel launches and host bookkeeping; no recompute, the KV moves)
    mem_reserve: float = 0.1  # fraction of HBM kept for activations, workspace, fragmentation
    page_size: int = 16  # KV positions per page (vLLM's default block size)
    host_bw: float = 25e9  # bytes/s device <-> host for swapped KV pages: PCIe Gen5 x16 is
    # 64 GB/s a direction on paper; pinned-memory copies of scattered pages reach ~25 GB/s
    max_slots: int = 256  # engine batch limit (vLLM max_num_seqs default)
    micro_batch_rows: int = 8  # learner sequences per micro-batch (one group of G = 8)


KV_LAYOUTS = ("paged", "dense")
MAX_LENGTH = 8592  # the default workload's longest sequence: a 400-token prompt + the 8k cap


@dataclasses.dataclass(frozen=True)
class Preset:
    model: StageModel  # one sampler replica of `sampler_tp` GPUs, a learner of `learner_gpus`
    slots: int  # per sampler replica
    notes: dict[str, float]  # derived quantities, for the record
    kv_layout: str = "paged"


def param_count(cfg: ModelConfig) -> int:
    """Parameters of a decoder of this config (embeddings, attention, SwiGLU MLP, norms)."""
    d, hd = cfg.d_model, cfg.head_dim
    attn = d * cfg.n_heads * hd * 2 + d * cfg.n_kv_heads * hd * 2
    attn += (cfg.n_heads + 2 * cfg.n_kv_heads) * hd * cfg.qkv_bias + d * cfg.o_bias
    layer = attn + 3 * d * cfg.mlp_dim + 2 * d + 2 * hd * cfg.qk_norm
    embed = cfg.vocab_size * d * (1 if cfg.tie_embeddings else 2)
    return embed + cfg.n_layers * layer + d


def kv_bytes_per_token(cfg: ModelConfig, itemsize: int = 2) -> int:
    return 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * itemsize


def gpu_preset(
    model: str = "qwen3-1.7b",
    gpu: str = "h100",
    *,
    sampler_tp: int = 1,
    learner_gpus: int = 4,
    assumptions: Assumptions = Assumptions(),
    kv_layout: str = "paged",
    max_length: int = MAX_LENGTH,
) -> Preset:
    """The StageModel of `model` (an rl.models preset) on `gpu` (a GPUS key).

    Args:
      model: rl.models.PRESETS name.
      gpu: "h100" or "h200".
      sampler_tp: GPUs per sampler replica (tensor parallel).
      learner_gpus: GPUs of the learner (FSDP/data parallel).
      assumptions: the non-datasheet numbers.
      kv_layout: "paged" (a pool of pages, slots = max_slots) or "dense" (max_length per slot).
      max_length: prompt + response cap of the workload: what a dense slot reserves.
    """
    if model not in PRESETS:
        raise ValueError(f"Unknown model {model!r}; expected one of {sorted(PRESETS)}.")
    if gpu not in GPUS:
        raise ValueError(f"Unknown gpu {gpu!r}; expected one of {sorted(GPUS)}.")
    if kv_layout not in KV_LAYOUTS:
        raise ValueError(f"Unknown kv_layout {kv_layout!r}; expected one of {KV_LAYOUTS}.")
    if sampler_tp < 1 or learner_gpus < 1:
        raise ValueError(
            f"sampler_tp and learner_gpus must be >= 1; received {sampler_tp}, {learner_gpus}."
        )
    cfg, g, a = PRESETS[model], GPUS[gpu], assumptions
    n = param_count(cfg)
    weights = 2 * n  # bf16
    kv = kv_bytes_per_token(cfg)
    bw = sampler_tp * g.hbm_bw * a.eff_bw
    free = sampler_tp * g.hbm_bytes * (1 - a.mem_reserve) - weights
    if free <= 0:
        raise ValueError(
            f"{model} ({weights / 1e9:.1f} GB bf16) does not fit {sampler_tp} x {gpu}."
        )
    kv_pages = int(free // (kv * a.page_size))
    slots = (
        a.max_slots if kv_layout == "paged" else int(min(a.max_slots, free // (kv * max_length)))
    )
    if slots < 1 or -(-max_length // a.page_size) > kv_pages:
        raise ValueError(
            f"{model} on {sampler_tp} x {gpu} has {free / 1e9:.1f} GB for KV, less than one "
            f"sequence of max_length {max_length} ({max_length * kv / 1e9:.2f} GB)."
        )
    # optimizer: fp32 master + m + v + grad, read and written, sharded over the learner's GPUs
    optimizer_s = 2 * 16 * n / (learner_gpus * g.hbm_bw)
    reduce_s = 2 * n * 2 * (learner_gpus - 1) / learner_gpus / g.nvlink_bw
    stage = StageModel(
        decode_a=a.step_overhead_s + weights / bw,
        decode_b=2 * n / (sampler_tp * g.bf16_flops * a.decode_mfu),
        decode_c=kv / bw,
        steps_per_call=1,
        prefill_fixed=a.prefill_fixed_s,
        prefill_per_token=2 * n / (sampler_tp * g.bf16_flops * a.prefill_mfu),
        learner_fixed=a.micro_fixed_s,
        learner_per_token=a.learner_flops_per_param
        * n
        / (learner_gpus * g.bf16_flops * a.learner_mfu),
        update_s=a.update_fixed_s + optimizer_s + reduce_s,
        micro_batch_rows=a.micro_batch_rows,
        pad_rows=False,
        publish_fixed=a.sync_fixed_s,
        publish_per_byte=1.0 / a.sync_bw,
        param_bytes=weights,
        migrate_fixed=a.migrate_fixed_s,
        migrate_per_byte=1.0 / g.nvlink_bw,
        kv_bytes_per_token=int(kv),
        kv_pages=kv_pages if kv_layout == "paged" else 0,
        page_size=a.page_size,
        swap_per_byte=1.0 / (sampler_tp * a.host_bw),
        source=f"preset {model} on {g.name}: sampler tp={sampler_tp}, learner {learner_gpus} GPUs, "
        f"{kv_layout} KV",
    )
    notes = dict(
        params=float(n),
        weight_bytes=float(weights),
        kv_bytes_per_token=float(kv),
        kv_free_bytes=float(free),
        kv_pool_tokens=float(kv_pages * a.page_size),
        optimizer_s=optimizer_s,
        reduce_s=reduce_s,
    )
    return Preset(model=stage, slots=slots, notes=notes, kv_layout=kv_layout)
