"""Stage-time models: how long each piece of work takes, as pure functions of the work.

    decode call   h + k * (a + b * slots + c * context)      k fused steps over `slots` active
                  sequences holding `context` KV tokens in all (memory-bound: weights + KV reads)
    prefill       p0 + p1 * prompt_tokens                    one prompt, shared by its G slots
    micro step    l0 + l1 * tokens                           one learner micro-batch
    update        u0                                         the optimizer apply
    publish       s0 + s1 * bytes                            weights learner -> sampler
    migrate       m0 + m1 * kv_bytes_per_token * tokens      one request's running sequences
                  (their KV: prompt + tokens so far each) replica -> replica (JigsawRL)
    reward        r0 per completion
    swap          w1 * kv_bytes_per_token * page_size * pages   a preempted sequence's KV pages,
                  device -> host, and back when it resumes (a paged cache, rl/sim/paging.py)

A paged replica's KV pool is `kv_pages` pages of `page_size` positions (a size, like
kv_bytes_per_token, that the sampler's time depends on: it caps the sequences in flight); 0 means
no pool, slots alone limit the replica (a dense cache reserves max_length per slot, or a profile).

`contention` models sides that share hardware (2 CPU cores): while the sampler and the learner are
both busy, each runs `1 + contention` times slower. Coefficients come from `launch.profile` (fitted
by least squares on the current machine, `fit_linear`) or from GPU presets (rl/sim/presets.py).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True, kw_only=True)
class StageModel:
    """Coefficients of one sampler replica and one learner group (seconds, tokens, bytes)."""

    decode_a: float  # per decode step, fixed (weights read once per step)
    decode_b: float = 0.0  # per decode step and active slot
    decode_c: float = 0.0  # per decode step and KV token held by the active slots
    call_overhead: float = 0.0  # per generate call (dispatch, device_get, host bookkeeping)
    steps_per_call: int = 1  # k: decode steps fused into one call (GPU engines: 1)
    prefill_fixed: float = 0.0  # per prefill (one prompt, inserted into its G slots)
    prefill_per_token: float = 0.0
    learner_fixed: float = 0.0  # per micro-batch
    learner_per_token: float = 0.0  # per micro-batch token (padded, see `batch_tokens`)
    update_s: float = 0.0  # per optimizer update
    micro_batch_rows: int = 0  # sequences per micro-batch; 0: the whole update in one
    pad_rows: bool = False  # learner.batching: rows padded to micro_batch_rows, lengths to 2^n
    min_length_bucket: int = 32  # the smallest length bucket when padding
    publish_fixed: float = 0.0
    publish_per_byte: float = 0.0
    param_bytes: int = 0  # what one publish moves
    migrate_fixed: float = 0.0  # per migrated request (export, import, bookkeeping)
    migrate_per_byte: float = 0.0  # 1 / the replica -> replica bandwidth (s/byte)
    kv_bytes_per_token: int = 0  # KV cache bytes of one token of one sequence
    kv_pages: int = 0  # a paged replica's KV pool, in pages; 0: not paged (slots alone limit)
    page_size: int = 16  # positions per KV page (vLLM's default block size)
    swap_per_byte: float = 0.0  # 1 / the device <-> host bandwidth (s/byte): preemption swaps
    reward_s: float = 0.0  # per completion
    contention: float = 0.0  # slowdown of each side while both are busy (shared cores)
    source: str = ""  # where the numbers come from (a profile path, a preset name)

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, float | int) and not isinstance(v, bool):
                if not math.isfinite(v) or v < 0:
                    raise ValueError(f"StageModel.{f.name} must be finite and >= 0; received {v}.")
        if self.steps_per_call < 1 or self.min_length_bucket < 1 or self.page_size < 1:
            raise ValueError(
                "StageModel.steps_per_call, min_length_bucket and page_size must be >= 1; "
                f"received {self.steps_per_call}, {self.min_length_bucket}, {self.page_size}."
            )
        if self.decode_a + self.decode_b + self.call_overhead <= 0:
            raise ValueError("StageModel: a decode call must take time; all of a, b, h are 0.")

    # ------------------------------------------------------------------------------ the sampler

    def decode_call_s(self, slots: int, context: float) -> float:
        """One generate call of k steps over `slots` active sequences holding `context` tokens."""
        k = self.steps_per_call
        steps = k * (self.decode_a + self.decode_b * slots + self.decode_c * context)
        return self.call_overhead + steps + self.decode_c * slots * k * (k - 1) / 2

    def decode_calls_s(self, calls: int, slots: int, context: float) -> float:
        """`calls` consecutive generate calls; the context grows by `slots` tokens per step.

        Closed form of the sum of `decode_call_s` over the calls (the active set is fixed).
        """
        if calls <= 0:
            return 0.0
        k = self.steps_per_call
        ctx_sum = calls * context + k * slots * calls * (calls - 1) / 2  # at each call's start
        return calls * (
            self.call_overhead + k * (self.decode_a + self.decode_b * slots)
        ) + self.decode_c * (k * ctx_sum + calls * slots * k * (k - 1) / 2)

    def prefill_s(self, prompt_tokens: int) -> float:
        return self.prefill_fixed + self.prefill_per_token * prompt_tokens

    # ------------------------------------------------------------------------------ the learner

    def batch_tokens(self, seqs: Sequence[tuple[int, int]]) -> int:
        """Tokens of one learner micro-batch of (prompt, response) length pairs.

        As learner.batching when `pad_rows`: rows padded up to a multiple of micro_batch_rows, the
        length to a power-of-two bucket (from min_length_bucket) of the longest prompt + response
        - 1; else packed: the real tokens.
        """
        if not self.pad_rows:
            return sum(p + r for p, r in seqs)
        rows = max(self.micro_batch_rows, 1)
        longest = max(p + r - 1 for p, r in seqs)
        bucket = self.min_length_bucket
        while bucket < longest:
            bucket *= 2
        return -(-len(seqs) // rows) * rows * bucket

    def update_total_s(self, groups: Sequence[Sequence[tuple[int, int]]]) -> float:
        """One optimizer update over groups added one at a time, as learner.Learner runs it.

        add_groups accumulates all pending rows once they reach micro_batch_rows; update folds in
        the remainder and applies.
        """
        total, pending = self.update_s, []
        for g in groups:
            pending += list(g)
            if len(pending) >= max(self.micro_batch_rows, 1):
                total += self.micro_step_s(self.batch_tokens(pending))
                pending = []
        if pending:
            total += self.micro_step_s(self.batch_tokens(pending))
        return total

    def micro_step_s(self, tokens: int) -> float:
        return self.learner_fixed + self.learner_per_token * tokens

    def publish_s(self, nbytes: int | None = None) -> float:
        return self.publish_fixed + self.publish_per_byte * (
            self.param_bytes if nbytes is None else nbytes
        )

    # ---------------------------------------------------------------------------------- files

    def migrate_s(self, kv_tokens: int) -> float:
        """Moving one request whose running sequences hold `kv_tokens` KV tokens in all."""
        return self.migrate_fixed + self.migrate_per_byte * self.kv_bytes_per_token * kv_tokens

    def swap_s(self, pages: int) -> float:
        """Copying `pages` KV pages between the device and the host (one direction)."""
        return self.swap_per_byte * self.kv_bytes_per_token * self.page_size * pages

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> StageModel:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(
                f"Unknown StageModel fields {sorted(unknown)}; expected some of {sorted(known)}."
            )
        return cls(**dict(d))

    @classmethod
    def load(cls, path: str | os.PathLike) -> StageModel:
        """From a JSON file: a StageModel dict, or `launch.profile` output (its "model" key)."""
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
        return cls.from_dict(d.get("model", d) if isinstance(d, dict) else d)

    def replace(self, **changes: Any) -> StageModel:
        return dataclasses.replace(self, **changes)


def fit_linear(
    x: np.ndarray, y: np.ndarray, names: Sequence[str], *, nonnegative: bool = True
) -> tuple[dict[str, float], float]:
    """Least squares y ~ x @ coef (x: N x K features, one column per name).

    Args:
      x: features, one row per measurement.
      y: measured seconds.
      names: a name per column.
      nonnegative: constrain every coefficient to >= 0 (scipy.optimize.nnls); a negative time per
        unit has no meaning, and noise on a near-zero term would otherwise make one.

    Returns:
      (name -> coefficient, relative RMS error of the fit over mean(y)).
    """
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    if x.ndim != 2 or x.shape[1] != len(names) or y.shape != (x.shape[0],):
        raise ValueError(
            f"fit_linear: x {x.shape} must be (N, {len(names)}) and y (N,); received y {y.shape}."
        )
    if x.shape[0] < len(names):
        raise ValueError(f"fit_linear: {x.shape[0]} measurements for {len(names)} unknowns.")
    scale = np.maximum(np.abs(x).max(axis=0), 1e-30)  # columns to unit scale: a better-posed fit
    if nonnegative:
        from scipy.optimize import nnls

        coef, _ = nnls(x / scale, y)
    else:
        coef = np.linalg.lstsq(x / scale, y, rcond=None)[0]
    coef = coef / scale
    rel = float(np.sqrt(np.mean((x @ coef - y) ** 2)) / max(np.mean(y), 1e-30))
    return {n: float(c) for n, c in zip(names, coef, strict=True)}, rel
