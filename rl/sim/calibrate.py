"""Fitting a StageModel to measured timings (least squares); launch/profile.py measures them.

Pure numpy: the measurements are plain records, so a fit can be checked on synthetic data.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from rl.elastic.stage import StageModel, fit_linear


@dataclasses.dataclass(frozen=True, kw_only=True)
class Measurements:
    """Timings in seconds.

    decode: (steps_per_call k, active slots, context tokens at the call's start, seconds) per
        generate call as the sampler loop runs it (host bookkeeping and rewards included).
    prefill: (prompt tokens, seconds) per admitted group (prefill + insert into its slots).
    micro: (micro-batch tokens as the learner pads them, seconds) per add_groups call.
    update: seconds per optimizer apply (Learner.update).
    publish: (bytes, seconds) per weight transfer.
    contention: measured slowdown of each side while the other runs (0: none).
    """

    decode: Sequence[tuple[int, int, float, float]]
    prefill: Sequence[tuple[int, float]]
    micro: Sequence[tuple[int, float]]
    update: Sequence[float]
    publish: Sequence[tuple[int, float]]
    contention: float = 0.0


def fit_stage_model(
    m: Measurements,
    *,
    steps_per_call: int,
    micro_batch_rows: int,
    pad_rows: bool,
    min_length_bucket: int,
    param_bytes: int,
    source: str,
) -> tuple[StageModel, dict[str, Any]]:
    """Least-squares fit of every StageModel term; returns the model and a fit report.

    Decode: seconds = h + k * a + k * slots * b + c * (k * context + slots * k (k - 1) / 2), one
    row per call; with calls at two or more k, h and a separate (one k: a absorbs h). The other
    stages are straight lines in tokens or bytes (update: the median).

    Returns:
      (model, report): the report gives, per stage, the coefficients, the number of measurements
      and the relative RMS error of the fit.
    """
    if not (m.decode and m.prefill and m.micro and m.update and m.publish):
        raise ValueError(
            "fit_stage_model needs measurements of every stage; received "
            f"{len(m.decode)} decode, {len(m.prefill)} prefill, {len(m.micro)} micro, "
            f"{len(m.update)} update, {len(m.publish)} publish."
        )
    d = np.asarray(m.decode, np.float64)
    k, n, ctx, y = d.T
    ks = set(k.tolist())
    cols = [k, k * n, k * ctx + n * k * (k - 1) / 2]
    names = ["decode_a", "decode_b", "decode_c"]
    if len(ks) > 1:
        cols, names = [np.ones_like(k), *cols], ["call_overhead", *names]
    dec, dec_err = fit_linear(np.stack(cols, 1), y, names)
    p = np.asarray(m.prefill, np.float64)
    pre, pre_err = fit_linear(
        np.stack([np.ones(len(p)), p[:, 0]], 1), p[:, 1], ["prefill_fixed", "prefill_per_token"]
    )
    mi = np.asarray(m.micro, np.float64)
    lrn, lrn_err = fit_linear(
        np.stack([np.ones(len(mi)), mi[:, 0]], 1), mi[:, 1], ["learner_fixed", "learner_per_token"]
    )
    pu = np.asarray(m.publish, np.float64)
    pub, pub_err = fit_linear(
        np.stack([np.ones(len(pu)), pu[:, 0]], 1), pu[:, 1], ["publish_fixed", "publish_per_byte"]
    )
    model = StageModel(
        **dec,
        **pre,
        **lrn,
        **pub,
        steps_per_call=steps_per_call,
        update_s=float(np.median(m.update)),
        micro_batch_rows=micro_batch_rows,
        pad_rows=pad_rows,
        min_length_bucket=min_length_bucket,
        param_bytes=param_bytes,
        contention=max(0.0, float(m.contention)),
        source=source,
    )
    upd = np.asarray(m.update)
    report = dict(
        decode=dict(coef=dec, n=len(d), rel_rms=dec_err, steps_per_call=sorted(ks)),
        prefill=dict(coef=pre, n=len(p), rel_rms=pre_err),
        micro_step=dict(coef=lrn, n=len(mi), rel_rms=lrn_err),
        update=dict(
            median=float(np.median(upd)), n=len(upd), rel_std=float(upd.std() / upd.mean())
        ),
        publish=dict(coef=pub, n=len(pu), rel_rms=pub_err),
        contention=float(m.contention),
    )
    return model, report
