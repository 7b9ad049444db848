"""Per-token policy losses by name, each with its registered options dataclass. Pure JAX.

The KL estimators live in rl/kl.py, the options and LossConfig in rl/loss_config.py, the
aggregations in rl/aggregation.py; their public names are importable from here too.

A policy loss maps per-token log-probs of the current policy (`logp_BxT`), of the policy that
sampled (`old_logp_BxT`) and per-sequence advantages (`adv_B`) to a per-token loss `loss_BxT`,
zero where `mask_BxT` is 0, and per-token metrics (BxT arrays, to be averaged with `masked_mean`).
An aggregation reduces `loss_BxT` to a (numerator, denominator) pair that is additive over
micro-batches, so gradient accumulation over any split of the batch equals the whole batch:

    num, den = sum over micro-batches of agg(loss_BxT, mask_BxT, norm_constant=...)
    loss = num / den  # gradient: sum of the numerators' gradients / den

A KL penalty to a reference policy is added by the caller per token, before aggregation:
`loss_BxT + cfg.kl_coef * kl_penalty(logp_BxT, ref_logp_BxT, cfg.kl_estimator, mask_BxT=...)`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

import jax
import jax.numpy as jnp

from rl.aggregation import masked_mean
from rl.kl import KL_ESTIMATORS, checked_mask, kl_penalty
from rl.loss_config import (
    LOSS_OPTIONS,
    DecoupledPpoOptions,
    GspoOptions,
    LossConfig,
    NoOptions,
    PpoClipOptions,
    TisOptions,
    loss_config_from,
)
from rl.registry import Registry

__all__ = [  # the KL and config names stay importable from here
    "KL_ESTIMATORS",
    "LOSS_OPTIONS",
    "POLICY_LOSSES",
    "DecoupledPpoOptions",
    "GspoOptions",
    "LossConfig",
    "NoOptions",
    "PpoClipOptions",
    "TisOptions",
    "get_policy_loss",
    "kl_penalty",
    "loss_config_from",
    "register_policy_loss",
]

Metrics = dict[str, jax.Array]
# ---------------------------------------------------------------------------------------------
# Policy losses.


class PolicyLoss(Protocol):
    def __call__(
        self,
        logp_BxT: jax.Array,
        old_logp_BxT: jax.Array,
        adv_B: jax.Array,
        mask_BxT: jax.Array,
        opts: Any,
    ) -> tuple[jax.Array, Metrics]:
        """Returns the per-token loss (0 where mask is 0) and per-token metrics; `opts` is the
        loss's registered options dataclass."""


POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss")
get_policy_loss = POLICY_LOSSES.get


def register_policy_loss(
    name: str, *, options: type = NoOptions
) -> Callable[[PolicyLoss], PolicyLoss]:
    """Decorator: registers a policy loss under a new `name`, with its options dataclass.

    The loss is called as `fn(logp_BxT, old_logp_BxT, adv_B, mask_BxT, opts)`, `opts` an instance
    of `options` (a frozen dataclass; a run sets its fields as config.learner.loss.<name>.<field>).
    """
    if not (isinstance(options, type) and dataclasses.is_dataclass(options)):
        raise ValueError(
            f"register_policy_loss({name!r}): options must be a dataclass type; received "
            f"{options!r}."
        )

    def decorator(fn: PolicyLoss) -> PolicyLoss:
        POLICY_LOSSES.register(name)(fn)
        LOSS_OPTIONS[name] = options
        return fn

    return decorator


def _check_inputs(
    logp_BxT: jax.Array, old_logp_BxT: jax.Array, adv_B: jax.Array, mask_BxT: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Checks shapes (static, so this works under jit); returns arrays and the bool mask."""
    logp_BxT, old_logp_BxT, adv_B = map(jnp.asarray, (logp_BxT, old_logp_BxT, adv_B))
    if (
        logp_BxT.ndim != 2
        or old_logp_BxT.shape != logp_BxT.shape
        or adv_B.shape != (logp_BxT.shape[0],)
    ):
        raise ValueError(
            f"Policy loss expects logp_BxT and old_logp_BxT of one shape (B, T) and adv_B of "
            f"shape (B,); received logp_BxT {logp_BxT.shape}, old_logp_BxT "
            f"{old_logp_BxT.shape}, adv_B {adv_B.shape}."
        )
    return logp_BxT, old_logp_BxT, adv_B, checked_mask(mask_BxT, logp_BxT.shape, "Policy loss")


def _clipped_objective(
    ratio_BxT: jax.Array, adv_BxT: jax.Array, low: float, high: float
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Returns -min(r A, clip(r, 1-low, 1+high) A) and where the clip is active, low and high."""
    unclipped_BxT = ratio_BxT * adv_BxT
    clipped_BxT = jnp.clip(ratio_BxT, 1.0 - low, 1.0 + high) * adv_BxT
    loss_BxT = -jnp.minimum(unclipped_BxT, clipped_BxT)
    active_BxT = clipped_BxT < unclipped_BxT  # the clipped branch is strictly the min
    return loss_BxT, active_BxT & (adv_BxT < 0), active_BxT & (adv_BxT > 0)


def _clipped_outputs(
    loss_BxT: jax.Array,
    ratio_BxT: jax.Array,
    low_BxT: jax.Array,
    high_BxT: jax.Array,
    valid_BxT: jax.Array,
) -> tuple[jax.Array, Metrics]:
    """Masked loss and the clip metrics shared by the clipped-ratio losses (0 where masked)."""
    zero = jnp.zeros_like(loss_BxT)
    metrics = {
        "ratio": jnp.where(valid_BxT, ratio_BxT, zero),
        "clip_frac": jnp.where(valid_BxT & (low_BxT | high_BxT), 1.0, zero),
        "clip_frac_low": jnp.where(valid_BxT & low_BxT, 1.0, zero),
        "clip_frac_high": jnp.where(valid_BxT & high_BxT, 1.0, zero),
    }
    return jnp.where(valid_BxT, loss_BxT, zero), metrics


@register_policy_loss("ppo_clip", options=PpoClipOptions)
def ppo_clip_loss(
    logp_BxT: jax.Array,
    old_logp_BxT: jax.Array,
    adv_B: jax.Array,
    mask_BxT: jax.Array,
    cfg: Any,
) -> tuple[jax.Array, Metrics]:
    """PPO clipped surrogate per token, with separate low/high clips (DAPO clip-higher).

    `loss = -min(r A, clip(r, 1 - clip_low, 1 + clip_high) A)`, `r = exp(logp - old_logp)`.

    Args:
        logp_BxT: Log-probs of the sampled tokens under the policy being trained.
        old_logp_BxT: Log-probs of the same tokens under the policy that sampled them.
        adv_B: One advantage per sequence.
        mask_BxT: 1 (or True) at response tokens, 0 at prompt and padding.
        cfg: PpoClipOptions: `clip_low` and `clip_high`.

    Returns:
        loss_BxT (0 where masked) and per-token metrics, 0 where masked: "ratio"; "clip_frac"
        (1 where the clipped branch is strictly the min, so the token has no gradient) and its
        parts "clip_frac_low" (A < 0, r < 1 - clip_low) and "clip_frac_high" (A > 0,
        r > 1 + clip_high).
    """
    logp_BxT, old_logp_BxT, adv_B, valid_BxT = _check_inputs(
        logp_BxT, old_logp_BxT, adv_B, mask_BxT
    )
    ratio_BxT = jnp.exp(jnp.where(valid_BxT, logp_BxT - old_logp_BxT, 0.0))
    adv_BxT = jnp.broadcast_to(adv_B[:, None], ratio_BxT.shape)
    loss_BxT, low_BxT, high_BxT = _clipped_objective(
        ratio_BxT, adv_BxT, cfg.clip_low, cfg.clip_high
    )
    return _clipped_outputs(loss_BxT, ratio_BxT, low_BxT, high_BxT, valid_BxT)


@register_policy_loss("gspo", options=GspoOptions)
def gspo_loss(
    logp_BxT: jax.Array,
    old_logp_BxT: jax.Array,
    adv_B: jax.Array,
    mask_BxT: jax.Array,
    cfg: Any,
) -> tuple[jax.Array, Metrics]:
    """GSPO (GSPO-token form): the PPO clip on the sequence ratio, broadcast over its tokens.

    `s_i = exp(mean_t(logp - old_logp))` over the sequence's unmasked tokens; each token carries
    `s_it = sg(s_i) * exp(logp_t - sg(logp_t))`, equal to `s_i` in value with `d s_it / d logp_t =
    s_i`. With "seq_mean_token_mean" aggregation the gradient equals that of the paper's sequence
    objective `-mean_i min(s_i A_i, clip(s_i, 1 - clip_low, 1 + clip_high) A_i)`.

    Args:
        logp_BxT: Log-probs of the sampled tokens under the policy being trained.
        old_logp_BxT: Log-probs of the same tokens under the policy that sampled them.
        adv_B: One advantage per sequence.
        mask_BxT: 1 (or True) at response tokens, 0 at prompt and padding.
        cfg: GspoOptions: `clip_low` and `clip_high` (of the sequence ratio).

    Returns:
        loss_BxT (0 where masked) and per-token metrics, 0 where masked: "ratio" (the sequence
        ratio s_i at each of its tokens), "clip_frac", "clip_frac_low", "clip_frac_high" (the
        sequence's clip state at each of its tokens).
    """
    logp_BxT, old_logp_BxT, adv_B, valid_BxT = _check_inputs(
        logp_BxT, old_logp_BxT, adv_B, mask_BxT
    )
    logp_BxT = jnp.where(valid_BxT, logp_BxT, 0.0)
    log_ratio_BxT = jnp.where(valid_BxT, logp_BxT - old_logp_BxT, 0.0)
    seq_ratio_B = jnp.exp(masked_mean(log_ratio_BxT, valid_BxT, axis=1))
    token_ratio_BxT = jax.lax.stop_gradient(seq_ratio_B)[:, None] * jnp.exp(
        logp_BxT - jax.lax.stop_gradient(logp_BxT)
    )
    adv_BxT = jnp.broadcast_to(adv_B[:, None], token_ratio_BxT.shape)
    loss_BxT, low_BxT, high_BxT = _clipped_objective(
        token_ratio_BxT, adv_BxT, cfg.clip_low, cfg.clip_high
    )
    ratio_BxT = jax.lax.stop_gradient(token_ratio_BxT)
    return _clipped_outputs(loss_BxT, ratio_BxT, low_BxT, high_BxT, valid_BxT)


@register_policy_loss("tis_reinforce", options=TisOptions)
def tis_reinforce_loss(
    logp_BxT: jax.Array,
    old_logp_BxT: jax.Array,
    adv_B: jax.Array,
    mask_BxT: jax.Array,
    cfg: Any,
) -> tuple[jax.Array, Metrics]:
    """REINFORCE with truncated importance sampling (PipelineRL): `-w A logp` per token.

    `w = sg(min(exp(logp - old_logp), clip))`, in [0, clip], carries no gradient, so
    `d loss / d logp = -w A`. The loss value is a surrogate; only its gradient is meaningful.

    Args:
        logp_BxT: Log-probs of the sampled tokens under the policy being trained.
        old_logp_BxT: Log-probs of the same tokens under the policy that sampled them.
        adv_B: One advantage per sequence.
        mask_BxT: 1 (or True) at response tokens, 0 at prompt and padding.
        cfg: TisOptions: `clip`, the cap c.

    Returns:
        loss_BxT (0 where masked) and per-token metrics, 0 where masked: "is_weight" (w),
        "ratio" (the untruncated ratio), "clip_frac" (1 where the ratio exceeds the cap).
    """
    logp_BxT, old_logp_BxT, adv_B, valid_BxT = _check_inputs(
        logp_BxT, old_logp_BxT, adv_B, mask_BxT
    )
    logp_BxT = jnp.where(valid_BxT, logp_BxT, 0.0)
    ratio_BxT = jax.lax.stop_gradient(jnp.exp(jnp.where(valid_BxT, logp_BxT - old_logp_BxT, 0.0)))
    w_BxT = jnp.minimum(ratio_BxT, cfg.clip)
    loss_BxT = -w_BxT * adv_B[:, None] * logp_BxT
    zero = jnp.zeros_like(loss_BxT)
    metrics = {
        "is_weight": jnp.where(valid_BxT, w_BxT, zero),
        "ratio": jnp.where(valid_BxT, ratio_BxT, zero),
        "clip_frac": jnp.where(valid_BxT & (ratio_BxT > cfg.clip), 1.0, zero),
    }
    return jnp.where(valid_BxT, loss_BxT, zero), metrics


@register_policy_loss("decoupled_ppo", options=DecoupledPpoOptions)
def decoupled_ppo_loss(
    logp_BxT: jax.Array,
    old_logp_BxT: jax.Array,
    adv_B: jax.Array,
    mask_BxT: jax.Array,
    cfg: Any,
) -> tuple[jax.Array, Metrics]:
    """Decoupled PPO (AReaL) for stale data: the behaviour policy (the sampler's, `old_logp_BxT`;
    use learner.old_logprobs="sampler") only weights, the proximal policy anchors the clip.

    `loss = -w min(r A, clip(r, 1 - clip_low, 1 + clip_high) A)`, `r = exp(logp - logp_prox)`,
    `w = sg(min(exp(logp_prox - old_logp), behav_clip))`. The proximal policy is the policy at the
    start of the update: the learner takes one optimizer step per batch, so `logp_prox =
    sg(logp)` (r = 1 in value, its gradient that of logp) and the gradient is `-w A d logp`.

    Args:
        logp_BxT: Log-probs of the sampled tokens under the policy being trained.
        old_logp_BxT: The behaviour (sampler) log-probs of the same tokens.
        adv_B: One advantage per sequence.
        mask_BxT: 1 (or True) at response tokens, 0 at prompt and padding.
        cfg: DecoupledPpoOptions: `clip_low`, `clip_high` and `behav_clip` (the behaviour
            weight's cap).

    Returns:
        loss_BxT (0 where masked) and per-token metrics, 0 where masked: "behav_weight" (w),
        "behav_clip_frac" (1 where the behaviour ratio exceeds behav_clip), "ratio" (r) and the
        PPO clip fractions "clip_frac", "clip_frac_low", "clip_frac_high".
    """
    logp_BxT, old_logp_BxT, adv_B, valid_BxT = _check_inputs(
        logp_BxT, old_logp_BxT, adv_B, mask_BxT
    )
    logp_BxT = jnp.where(valid_BxT, logp_BxT, 0.0)
    prox_BxT = jax.lax.stop_gradient(logp_BxT)
    behav_BxT = jnp.exp(jnp.where(valid_BxT, prox_BxT - old_logp_BxT, 0.0))
    w_BxT = jnp.minimum(behav_BxT, cfg.behav_clip)
    ratio_BxT = jnp.exp(logp_BxT - prox_BxT)
    adv_BxT = jnp.broadcast_to(adv_B[:, None], ratio_BxT.shape)
    loss_BxT, low_BxT, high_BxT = _clipped_objective(
        ratio_BxT, adv_BxT, cfg.clip_low, cfg.clip_high
    )
    loss_BxT, metrics = _clipped_outputs(
        w_BxT * loss_BxT, jax.lax.stop_gradient(ratio_BxT), low_BxT, high_BxT, valid_BxT
    )
    zero = jnp.zeros_like(loss_BxT)
    metrics["behav_weight"] = jnp.where(valid_BxT, w_BxT, zero)
    metrics["behav_clip_frac"] = jnp.where(valid_BxT & (behav_BxT > cfg.behav_clip), 1.0, zero)
    return loss_BxT, metrics
