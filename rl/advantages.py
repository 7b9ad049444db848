"""Group-relative advantage estimators (GRPO family), by name. Pure functions of rewards.

Every estimator maps `rewards_NxG` (N groups of G samples of one prompt each) to `adv_NxG`; a
user adds one with `@register_advantage_estimator("name")` and names it in the config.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from rl.registry import Registry
from rl.types import Group


class AdvantageEstimator(Protocol):
    def __call__(self, rewards_NxG: ArrayLike, /, **kwargs: Any) -> jax.Array:
        """Maps N groups of G rewards to advantages of the same shape."""


ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry("advantage estimator")
register_advantage_estimator = ADVANTAGE_ESTIMATORS.register
get_advantage_estimator = ADVANTAGE_ESTIMATORS.get


def _as_rewards(rewards_NxG: ArrayLike) -> jax.Array:
    """Returns rewards as a float array of shape (N, G) with G >= 1, or raises."""
    r_NxG = jnp.asarray(rewards_NxG)
    if r_NxG.ndim != 2 or r_NxG.shape[1] < 1:
        raise ValueError(
            f"rewards_NxG must have shape (num_groups, group_size) with group_size >= 1; "
            f"received shape {r_NxG.shape}."
        )
    if not jnp.issubdtype(r_NxG.dtype, jnp.floating):
        r_NxG = r_NxG.astype(jnp.float32)
    return r_NxG


def _centered(rewards_NxG: ArrayLike) -> jax.Array:
    """Returns rewards minus their group mean, exactly 0 for a group of equal rewards.

    The rewards are shifted by each group's first reward before the mean is taken, so a group of
    equal rewards centers to exact zeros: in float32 `mean([x] * G)` need not equal x, and
    `(x - mean) / (0 + eps)` would then turn the rounding error into an advantage of order 0.1.
    """
    r_NxG = _as_rewards(rewards_NxG)
    d_NxG = r_NxG - r_NxG[:, :1]
    return d_NxG - jnp.mean(d_NxG, axis=1, keepdims=True)


@register_advantage_estimator("grpo")
def grpo_advantages(rewards_NxG: ArrayLike, *, eps: float = 1e-6) -> jax.Array:
    """GRPO: rewards standardized within each group, `(r - mean) / (std + eps)`.

    The std is unbiased (ddof=1), as `torch.std` in TRL and veRL. A group of one sample (G=1) has
    no baseline and gets zero advantages; a group of equal rewards also gets zeros.

    Args:
        rewards_NxG: Rewards of N groups of G samples.
        eps: Added to the std so that groups of (nearly) equal rewards stay finite.

    Returns:
        adv_NxG, the standardized rewards.
    """
    centered_NxG = _centered(rewards_NxG)
    g = centered_NxG.shape[1]
    if g == 1:
        return jnp.zeros_like(centered_NxG)
    std_Nx1 = jnp.sqrt(jnp.sum(jnp.square(centered_NxG), axis=1, keepdims=True) / (g - 1))
    return centered_NxG / (std_Nx1 + eps)


@register_advantage_estimator("drgrpo")
def drgrpo_advantages(rewards_NxG: ArrayLike) -> jax.Array:
    """Dr. GRPO: rewards minus their group mean, with no std normalization.

    Args:
        rewards_NxG: Rewards of N groups of G samples.

    Returns:
        adv_NxG, the centered rewards (zeros when G=1).
    """
    return _centered(rewards_NxG)


@register_advantage_estimator("rloo")
def rloo_advantages(rewards_NxG: ArrayLike) -> jax.Array:
    """RLOO: each reward minus the mean of the other G-1 rewards of its group.

    Args:
        rewards_NxG: Rewards of N groups of G samples.

    Returns:
        adv_NxG, the leave-one-out advantages (zeros when G=1: there is no other sample).
    """
    centered_NxG = _centered(rewards_NxG)
    g = centered_NxG.shape[1]
    if g == 1:
        return jnp.zeros_like(centered_NxG)
    # r_i - (sum_{j != i} r_j) / (G - 1) == G / (G - 1) * (r_i - mean).
    return centered_NxG * (g / (g - 1))


def zero_variance_groups(rewards_NxG: ArrayLike, *, atol: float = 1e-6) -> jax.Array:
    """Flags groups whose rewards are all equal (within `atol`); they carry no GRPO signal.

    DAPO's dynamic sampling drops these groups and samples more.

    Args:
        rewards_NxG: Rewards of N groups of G samples.
        atol: Groups with `max - min <= atol` count as equal.

    Returns:
        bool_N, True for each group whose rewards are all equal.
    """
    r_NxG = _as_rewards(rewards_NxG)
    return (jnp.max(r_NxG, axis=1) - jnp.min(r_NxG, axis=1)) <= atol


def group_advantages(groups: Sequence[Group], name: str, **kwargs: Any) -> list[tuple[float, ...]]:
    """Computes advantages for whole groups: stacks their rewards and applies estimator `name`.

    Args:
        groups: Rewarded groups, all of the same size G.
        name: A registered estimator name, e.g. "grpo".
        **kwargs: Passed on to the estimator (e.g. `eps` for "grpo").

    Returns:
        One tuple of G advantages per group, in the order of `groups` and of their samples.

    Raises:
        ValueError: If `name` is not registered or the groups differ in size.
    """
    estimator = get_advantage_estimator(name)
    if not groups:
        return []
    sizes = [len(g.completions) for g in groups]
    if len(set(sizes)) > 1:
        counts = dict(sorted(collections.Counter(sizes).items()))
        raise ValueError(
            f"group_advantages needs groups of one size to stack; received sizes {counts} "
            f"(group size: number of groups)."
        )
    adv_NxG = estimator(jnp.asarray([g.rewards for g in groups], jnp.float32), **kwargs)
    return [tuple(float(a) for a in row) for row in jax.device_get(adv_NxG).tolist()]
