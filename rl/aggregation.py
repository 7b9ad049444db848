"""Loss aggregations: per-token losses -> a (numerator, denominator) pair, additive over micro-batches.

Gradient accumulation over any split of a batch equals the whole batch:

    num, den = sum over micro-batches of agg(loss_BxT, mask_BxT, norm_constant=...)
    loss = num / den  # gradient: sum of the numerators' gradients / den
"""

from __future__ import annotations

import numbers
from typing import Protocol

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from rl.registry import Registry

# ---------------------------------------------------------------------------------------------
# Aggregation.


def masked_mean(x_BxT: ArrayLike, mask_BxT: ArrayLike, *, axis: int | None = None) -> jax.Array:
    """Mean of `x` over the entries where `mask` is nonzero (weighted by `mask`); 0 if none.

    Args:
        x_BxT: Values, e.g. a per-token metric.
        mask_BxT: Weights of the same shape, usually 0/1.
        axis: Axis to reduce; None reduces all.

    Returns:
        The masked mean: a scalar, or an array without `axis`.
    """
    x_BxT = jnp.asarray(x_BxT)
    mask_BxT = jnp.asarray(mask_BxT)
    if mask_BxT.shape != x_BxT.shape:
        raise ValueError(
            f"masked_mean: mask_BxT must have the shape of x_BxT {x_BxT.shape}; received "
            f"{mask_BxT.shape}."
        )
    m_BxT = mask_BxT.astype(x_BxT.dtype)
    total = jnp.sum(jnp.where(mask_BxT != 0, x_BxT * m_BxT, 0.0), axis=axis)
    count = jnp.sum(m_BxT, axis=axis)
    return jnp.where(count != 0, total / jnp.where(count != 0, count, 1.0), 0.0)


class Aggregation(Protocol):
    def __call__(
        self, loss_BxT: jax.Array, mask_BxT: jax.Array, *, norm_constant: float | None = None
    ) -> tuple[jax.Array, jax.Array]:
        """Returns (numerator, denominator), each additive over micro-batches."""


AGGREGATIONS: Registry[Aggregation] = Registry("aggregation")
register_aggregation = AGGREGATIONS.register
get_aggregation = AGGREGATIONS.get


def _masked_loss(
    loss_BxT: ArrayLike, mask_BxT: ArrayLike, where: str
) -> tuple[jax.Array, jax.Array]:
    """Returns loss * mask (0 where masked) and the mask in the loss dtype, after shape checks."""
    loss_BxT = jnp.asarray(loss_BxT)
    mask_BxT = jnp.asarray(mask_BxT)
    if loss_BxT.ndim != 2 or mask_BxT.shape != loss_BxT.shape:
        raise ValueError(
            f"{where}: expected loss_BxT and mask_BxT of one shape (B, T); received "
            f"{loss_BxT.shape} and {mask_BxT.shape}."
        )
    m_BxT = mask_BxT.astype(loss_BxT.dtype)
    return jnp.where(mask_BxT != 0, loss_BxT * m_BxT, 0.0), m_BxT


@register_aggregation("token_mean")
def token_mean(
    loss_BxT: jax.Array, mask_BxT: jax.Array, *, norm_constant: float | None = None
) -> tuple[jax.Array, jax.Array]:
    """Mean over all unmasked tokens of the batch (DAPO token-level loss).

    Args:
        loss_BxT: Per-token loss.
        mask_BxT: 1 at tokens that count, 0 elsewhere.
        norm_constant: Unused.

    Returns:
        (sum of masked loss, number of unmasked tokens).
    """
    del norm_constant
    loss_BxT, m_BxT = _masked_loss(loss_BxT, mask_BxT, "token_mean")
    return jnp.sum(loss_BxT), jnp.sum(m_BxT)


@register_aggregation("seq_mean_token_mean")
def seq_mean_token_mean(
    loss_BxT: jax.Array, mask_BxT: jax.Array, *, norm_constant: float | None = None
) -> tuple[jax.Array, jax.Array]:
    """Mean over sequences of each sequence's token mean (GRPO, GSPO).

    Rows with no unmasked token (batch padding) add to neither part.

    Args:
        loss_BxT: Per-token loss.
        mask_BxT: 1 at tokens that count, 0 elsewhere.
        norm_constant: Unused.

    Returns:
        (sum over sequences of their token-mean loss, number of sequences with a token).
    """
    del norm_constant
    loss_BxT, m_BxT = _masked_loss(loss_BxT, mask_BxT, "seq_mean_token_mean")
    n_B = jnp.sum(m_BxT, axis=1)
    seq_B = jnp.sum(loss_BxT, axis=1) / jnp.where(n_B > 0, n_B, 1.0)
    return jnp.sum(seq_B), jnp.sum((n_B > 0).astype(loss_BxT.dtype))


@register_aggregation("seq_mean_token_sum")
def seq_mean_token_sum(
    loss_BxT: jax.Array, mask_BxT: jax.Array, *, norm_constant: float | None = None
) -> tuple[jax.Array, jax.Array]:
    """Mean over sequences of each sequence's token sum (veRL "seq-mean-token-sum").

    Longer responses weigh more, per token as in token_mean, but the divisor is the number of
    sequences, not tokens. Rows with no unmasked token (batch padding) add to neither part.

    Args:
        loss_BxT: Per-token loss.
        mask_BxT: 1 at tokens that count, 0 elsewhere.
        norm_constant: Unused.

    Returns:
        (sum over sequences of their token-sum loss, number of sequences with a token).
    """
    del norm_constant
    loss_BxT, m_BxT = _masked_loss(loss_BxT, mask_BxT, "seq_mean_token_sum")
    n_B = jnp.sum(m_BxT, axis=1)
    return jnp.sum(loss_BxT), jnp.sum((n_B > 0).astype(loss_BxT.dtype))


@register_aggregation("seq_mean_token_sum_norm")
def seq_mean_token_sum_norm(
    loss_BxT: jax.Array, mask_BxT: jax.Array, *, norm_constant: float | None = None
) -> tuple[jax.Array, jax.Array]:
    """Dr. GRPO: each sequence's token sum divided by a constant, averaged over sequences.

    Rows with no unmasked token (batch padding) add to neither part.

    Args:
        loss_BxT: Per-token loss.
        mask_BxT: 1 at tokens that count, 0 elsewhere.
        norm_constant: The constant divisor, the configured maximum response length; required.

    Returns:
        (sum over sequences of token-sum loss / norm_constant, number of sequences with a token).
    """
    if norm_constant is None or (
        isinstance(norm_constant, numbers.Real)
        and not isinstance(norm_constant, bool)
        and not norm_constant > 0
    ):
        raise ValueError(
            f"seq_mean_token_sum_norm needs norm_constant > 0 (the maximum response length); "
            f"received {norm_constant!r}."
        )
    loss_BxT, m_BxT = _masked_loss(loss_BxT, mask_BxT, "seq_mean_token_sum_norm")
    n_B = jnp.sum(m_BxT, axis=1)
    return jnp.sum(loss_BxT) / norm_constant, jnp.sum((n_B > 0).astype(loss_BxT.dtype))
