"""Per-token policy losses, KL estimators and loss aggregations, by name. Pure JAX.

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
import math
import numbers
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from rl.aggregation import masked_mean
from rl.registry import Registry

Metrics = dict[str, jax.Array]
# ---------------------------------------------------------------------------------------------
# KL to a reference policy.


def _k3(d: jax.Array) -> jax.Array:
    """exp(x) - x - 1 with x = -d = ref - logp, accurate in float32 also for tiny |x|."""
    x = -d
    # Below |x| = 0.1 the direct form cancels (relative error ~1e-7 / |x|); the Taylor series to
    # x^6 is exact there to ~1e-8. The series sees x only where it is used, so it cannot overflow.
    small = jnp.abs(x) < 0.1
    xs = jnp.where(small, x, 0.0)
    series = jnp.square(xs) * (1 / 2 + xs * (1 / 6 + xs * (1 / 24 + xs * (1 / 120 + xs / 720))))
    return jnp.where(small, series, jnp.expm1(x) - x)


KL_ESTIMATORS: Registry[Callable[[jax.Array], jax.Array]] = Registry("KL estimator")
KL_ESTIMATORS.update(
    {
        # d = logp - ref_logp at tokens sampled from the current policy (Schulman, "Approximating KL
        # divergence"): all three estimate KL(current || ref); k1 is unbiased but noisy, k3 unbiased
        # and >= 0, k2 biased with low variance.
        "k1": lambda d: d,
        "k2": lambda d: 0.5 * jnp.square(d),
        "k3": _k3,  # exp(ref - logp) - (ref - logp) - 1
    }
)


def kl_penalty(
    logp_BxT: ArrayLike,
    ref_logp_BxT: ArrayLike,
    estimator: str,
    *,
    mask_BxT: ArrayLike | None = None,
) -> jax.Array:
    """Per-token estimate of KL(current || reference) from tokens sampled by the current policy.

    Used as a loss term (sampling not differentiated), "k2" has the gradient of KL(current ||
    ref), "k3" that of KL(ref || current), and "k1" none in expectation.

    Args:
        logp_BxT: Log-probs of the sampled tokens under the current policy.
        ref_logp_BxT: Log-probs of the same tokens under the reference policy.
        estimator: "k1" (logp - ref), "k2" (0.5 (logp - ref)^2) or "k3"
            (exp(ref - logp) - (ref - logp) - 1).
        mask_BxT: Optional; where 0 the result is 0 (and its gradient too, even if the padding
            holds -inf or NaN log-probs).

    Returns:
        kl_BxT, the per-token estimate.

    Raises:
        ValueError: If `estimator` is unknown or the shapes differ.
    """
    fn = KL_ESTIMATORS.get(estimator)
    logp_BxT, ref_logp_BxT = jnp.asarray(logp_BxT), jnp.asarray(ref_logp_BxT)
    if logp_BxT.shape != ref_logp_BxT.shape:
        raise ValueError(
            f"kl_penalty: logp_BxT and ref_logp_BxT must have one shape; received "
            f"{logp_BxT.shape} and {ref_logp_BxT.shape}."
        )
    if mask_BxT is None:
        return fn(logp_BxT - ref_logp_BxT)
    valid_BxT = _valid(mask_BxT, logp_BxT.shape, "kl_penalty")
    d_BxT = jnp.where(valid_BxT, logp_BxT - ref_logp_BxT, 0.0)
    return jnp.where(valid_BxT, fn(d_BxT), 0.0)


# ---------------------------------------------------------------------------------------------
# Config.


def _is_real(v: object) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _check_fields(cfg: object, where: str, *, below_one=(), nonneg=(), positive=()) -> None:
    """Range checks of float fields; errors name `where.field`, the value and the range."""
    for name in below_one:
        v = getattr(cfg, name)
        if not (_is_real(v) and 0.0 <= v < 1.0):
            raise ValueError(f"{where}.{name} must be in [0, 1); received {v!r}.")
    for name in nonneg:
        v = getattr(cfg, name)
        if not (_is_real(v) and math.isfinite(v) and v >= 0.0):
            raise ValueError(f"{where}.{name} must be finite and >= 0; received {v!r}.")
    for name in positive:
        v = getattr(cfg, name)
        if not (_is_real(v) and math.isfinite(v) and v > 0.0):
            raise ValueError(f"{where}.{name} must be finite and > 0; received {v!r}.")


# Each policy loss declares its hyperparameters in its own frozen dataclass, registered with it
# (`register_policy_loss(name, options=...)`) and set from the command line as
# --config.learner.loss.<name>.<field>=...; the loss function receives that dataclass.


@dataclasses.dataclass(frozen=True, kw_only=True)
class NoOptions:
    """The options of a loss that declares none."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class PpoClipOptions:
    clip_low: float = 0.2  # ratio clipped below at 1 - clip_low
    clip_high: float = 0.28  # ratio clipped above at 1 + clip_high (DAPO clip-higher; PPO: 0.2)

    def __post_init__(self) -> None:
        _check_fields(self, "learner.loss.ppo_clip", below_one=("clip_low",), nonneg=("clip_high",))


@dataclasses.dataclass(frozen=True, kw_only=True)
class GspoOptions:
    clip_low: float = 3e-4  # sequence ratio clipped below at 1 - clip_low (GSPO paper)
    clip_high: float = 4e-4  # sequence ratio clipped above at 1 + clip_high

    def __post_init__(self) -> None:
        _check_fields(self, "learner.loss.gspo", below_one=("clip_low",), nonneg=("clip_high",))


@dataclasses.dataclass(frozen=True, kw_only=True)
class TisOptions:
    clip: float = 5.0  # importance weights truncated at this cap c (PipelineRL)

    def __post_init__(self) -> None:
        _check_fields(self, "learner.loss.tis_reinforce", positive=("clip",))


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecoupledPpoOptions:
    clip_low: float = 0.2  # proximal ratio clipped below at 1 - clip_low
    clip_high: float = 0.28  # proximal ratio clipped above at 1 + clip_high
    behav_clip: float = 5.0  # behaviour importance weight cap

    def __post_init__(self) -> None:
        _check_fields(
            self,
            "learner.loss.decoupled_ppo",
            below_one=("clip_low",),
            nonneg=("clip_high",),
            positive=("behav_clip",),
        )


LOSS_OPTIONS: dict[str, type] = {}  # policy loss name -> its options dataclass
_BUILTIN = {
    "ppo_clip": PpoClipOptions,
    "gspo": GspoOptions,
    "tis_reinforce": TisOptions,
    "decoupled_ppo": DecoupledPpoOptions,
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class LossConfig:
    """The KL penalty, and each policy loss's own options (`options(name)`)."""

    kl_coef: float = 0.0  # weight of the per-token KL penalty to the reference; 0: off
    kl_estimator: str = "k3"  # one of KL_ESTIMATORS
    ppo_clip: PpoClipOptions = PpoClipOptions()
    gspo: GspoOptions = GspoOptions()
    tis_reinforce: TisOptions = TisOptions()
    decoupled_ppo: DecoupledPpoOptions = DecoupledPpoOptions()
    # Options of losses registered outside this module: (name, options instance) pairs.
    custom: tuple[tuple[str, object], ...] = ()

    def __post_init__(self) -> None:
        _check_fields(self, "learner.loss", nonneg=("kl_coef",))
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(
                f"learner.loss.kl_estimator must be one of {sorted(KL_ESTIMATORS)}; received "
                f"{self.kl_estimator!r}."
            )
        for name, cls in _BUILTIN.items():
            if not isinstance(getattr(self, name), cls):
                raise ValueError(
                    f"learner.loss.{name} must be a {cls.__name__}; received "
                    f"{getattr(self, name)!r}."
                )
        for name, opts in self.custom:
            expected = LOSS_OPTIONS.get(name)
            if expected is None or name in _BUILTIN or not isinstance(opts, expected):
                raise ValueError(
                    f"learner.loss.custom entry {name!r}: expected a policy loss registered "
                    f"outside rl.losses with its options dataclass ({expected}); received "
                    f"{type(opts).__name__}."
                )

    def options(self, name: str) -> object:
        """The options of policy loss `name`: its field here, its `custom` entry, or defaults."""
        if name in _BUILTIN:
            return getattr(self, name)
        custom = dict(self.custom)
        if name in custom:
            return custom[name]
        if name not in LOSS_OPTIONS:
            raise ValueError(
                f"Unknown policy loss {name!r}; expected one of {sorted(LOSS_OPTIONS)}."
            )
        return LOSS_OPTIONS[name]()


def loss_config_from(section: Mapping[str, Any]) -> LossConfig:
    """LossConfig from a `config.learner.loss` section: kl_coef, kl_estimator, and one sub-section
    per policy loss (`gspo: {clip_low: ...}`), each built into that loss's options dataclass."""
    fields: dict[str, Any] = {}
    custom = []
    for key, value in dict(section).items():
        if key in ("kl_coef", "kl_estimator"):
            fields[key] = value
        elif key in LOSS_OPTIONS:
            cls = LOSS_OPTIONS[key]
            if not hasattr(value, "keys"):
                raise ValueError(
                    f"learner.loss.{key} must be a section of {cls.__name__} fields; received "
                    f"{value!r}."
                )
            known = {f.name for f in dataclasses.fields(cls)}
            unknown = sorted(set(value.keys()) - known)
            if unknown:
                raise ValueError(
                    f"learner.loss.{key} has no field(s) {unknown}; expected some of "
                    f"{sorted(known)}."
                )
            opts = cls(**dict(value))
            if key in _BUILTIN:
                fields[key] = opts
            else:
                custom.append((key, opts))
        else:
            raise ValueError(
                f"learner.loss has no field {key!r}; expected kl_coef, kl_estimator or a policy "
                f"loss's options section, one of {sorted(LOSS_OPTIONS)}."
            )
    return LossConfig(**fields, custom=tuple(custom))


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


def _valid(mask_BxT: ArrayLike, shape: tuple[int, ...], where: str) -> jax.Array:
    """Returns the mask as bool after checking its shape."""
    mask_BxT = jnp.asarray(mask_BxT)
    if mask_BxT.shape != shape:
        raise ValueError(f"{where}: mask_BxT must have shape {shape}; received {mask_BxT.shape}.")
    return mask_BxT != 0


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
    return logp_BxT, old_logp_BxT, adv_B, _valid(mask_BxT, logp_BxT.shape, "Policy loss")


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
