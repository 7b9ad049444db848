"""KL to a reference policy: per-token estimators by name (k1, k2, k3) and the masked penalty."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from rl.registry import Registry


def checked_mask(mask_BxT: ArrayLike, shape: tuple[int, ...], where: str) -> jax.Array:
    """Returns the mask as bool after checking its shape."""
    mask_BxT = jnp.asarray(mask_BxT)
    if mask_BxT.shape != shape:
        raise ValueError(f"{where}: mask_BxT must have shape {shape}; received {mask_BxT.shape}.")
    return mask_BxT != 0


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
    valid_BxT = checked_mask(mask_BxT, logp_BxT.shape, "kl_penalty")
    d_BxT = jnp.where(valid_BxT, logp_BxT - ref_logp_BxT, 0.0)
    return jnp.where(valid_BxT, fn(d_BxT), 0.0)
