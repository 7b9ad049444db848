"""The pure train step, split in two so micro-batches can be folded in as groups arrive.

    acc = zero_accum(params)
    acc = accumulate(acc, params, batch_1, ...)   # as many micro-batches as you like
    state, metrics = apply(state, acc)            # one optimizer update
    state, metrics = train_step(state, batch)     # the same for one batch, one jitted call

`accumulate` sums the gradient of the aggregation's numerator, the numerator and the denominator
(rl/aggregation.py), and metric sums, all unnormalised; `apply` divides once. Accumulating any split
of a batch therefore equals the whole batch.

`apply` keeps the old state when the loss, the gradient norm, or any updated parameter or optimizer
state value is NaN/inf (an optimizer step can overflow on finite gradients); the metric
`nonfinite_leaf` is then the index into `float_leaf_names(state)` of the first bad leaf (-1: none).

Old log-probs (the PPO ratio's denominator): `behavior_params` if given (a snapshot of the round's
published params, for later updates of a round), else the batch's sampler log-probs if
`old_logprobs == "sampler"`, else the current params with stop_gradient (exact for a round's first
update, where current params are the behaviour policy).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from learner.batching import Batch, unpack
from learner.config import LearnerConfig
from learner.state import TrainState
from rl.aggregation import get_aggregation
from rl.losses import get_policy_loss, kl_penalty

_COUNTS = ("tokens", "sequences", "ess_w", "ess_w2")  # sums apply() does not average per token
_ALWAYS = ("clip_frac", "entropy", "kl", "ratio", "logprob_diff_abs", "logprob_kl")
SUM_KEYS = (*_ALWAYS, *_COUNTS)  # what Accum.sums holds at least
MAX_KEYS = ("ratio_max", "ratio_min_neg")  # Accum.maxes: max ratio, max of -ratio


def sum_keys(cfg: LearnerConfig) -> tuple[str, ...]:
    """Accum.sums' keys for `cfg`: SUM_KEYS and every per-token metric its policy loss returns."""
    loss = get_policy_loss(cfg.policy_loss)
    x, a = jax.ShapeDtypeStruct((1, 2), jnp.float32), jax.ShapeDtypeStruct((1,), jnp.float32)
    opts = cfg.loss.options(cfg.policy_loss)
    _, m = jax.eval_shape(lambda lp, o, adv, mk: loss(lp, o, adv, mk, opts), x, x, a, x)
    return tuple(dict.fromkeys((*SUM_KEYS, *sorted(m))))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Accum:
    grads: Any  # gradient of the summed numerator, params-shaped
    numerator: jax.Array
    denominator: jax.Array
    sums: dict[str, jax.Array]  # token-summed metrics and counts
    # running maxima over the update's tokens: the importance ratio's max and (negated) min
    maxes: dict[str, jax.Array] = dataclasses.field(default_factory=dict)


def zero_accum(params: Any, keys: tuple[str, ...] = SUM_KEYS) -> Accum:
    """An empty accumulator; `keys` (sum_keys(cfg)) fixes its structure for a jit's shardings."""
    zeros = jnp.zeros((), jnp.float32)
    return Accum(
        grads=jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params),
        numerator=zeros,
        denominator=zeros,
        sums=dict.fromkeys(keys, zeros),
        maxes=dict.fromkeys(MAX_KEYS, jnp.full((), -jnp.inf, jnp.float32)),
    )


def _float_leaves(tree: Any) -> list[tuple[Any, jax.Array]]:
    """(path, leaf) of every floating-point leaf, in tree order."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return [(p, x) for p, x in leaves if jnp.issubdtype(x.dtype, jnp.inexact)]


def float_leaf_names(state: TrainState) -> list[str]:
    """Names ("params/layers/0/mlp/up/value", "opt_state/...") of the leaves `apply` checks."""

    def name(path: tuple[Any, ...]) -> str:
        return "/".join(
            str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path
        )

    return [f"params/{name(p)}" for p, _ in _float_leaves(state.params)] + [
        f"opt_state/{name(p)}" for p, _ in _float_leaves(state.opt_state)
    ]


def _first_nonfinite(trees: tuple[Any, ...]) -> jax.Array:
    """Index of the first float leaf of `trees` holding a NaN/inf (float_leaf_names order), or -1."""
    ok = jnp.stack([jnp.all(jnp.isfinite(x)) for t in trees for _, x in _float_leaves(t)])
    return jnp.where(jnp.all(ok), -1, jnp.argmin(ok)).astype(jnp.float32)


def _logprobs(
    graphdef: nnx.GraphDef,
    params: Any,
    frozen: Any,
    batch: Batch,
    cfg: LearnerConfig,
    entropy: bool,
) -> tuple[jax.Array, jax.Array | None]:
    model = nnx.merge(graphdef, params, frozen)
    out = model.token_logprobs(
        batch.inputs,
        batch.positions,
        batch.segments,
        batch.targets,
        temperature=cfg.temperature,
        with_entropy=entropy,
    )
    logp, ent = out if entropy else (out, None)
    if batch.token_index is not None:  # packed rows -> one row per sequence, as the loss arrays
        logp = unpack(logp, batch.token_index)
        ent = None if ent is None else unpack(ent, batch.token_index)
    return logp, ent


def accumulate(
    acc: Accum,
    params: Any,
    batch: Batch,
    *,
    graphdef: nnx.GraphDef,
    cfg: LearnerConfig,
    frozen: Any = None,
    behavior_params: Any = None,
    ref_params: Any = None,
) -> Accum:
    """Adds one micro-batch's gradient, loss terms and metric sums to `acc`.

    `params` are the trained parameters (every one, or only the LoRA adapters), `frozen` the
    model's other parameters (the LoRA base; None or empty: none); gradients are `params`'."""
    mask = batch.loss_mask
    frozen = nnx.State({}) if frozen is None else frozen
    if behavior_params is not None:
        old = _logprobs(graphdef, behavior_params, frozen, batch, cfg, False)[0]
        old = jax.lax.stop_gradient(old)
    elif cfg.old_logprobs == "sampler":
        old = batch.behavior_logp
    else:
        old = None
    ref = None
    if cfg.loss.kl_coef > 0:
        ref = jax.lax.stop_gradient(_logprobs(graphdef, ref_params, frozen, batch, cfg, False)[0])

    def loss_fn(p: Any) -> tuple[jax.Array, dict[str, jax.Array]]:
        logp, ent = _logprobs(graphdef, p, frozen, batch, cfg, cfg.entropy_metric)
        old_logp = jax.lax.stop_gradient(logp) if old is None else old
        opts = cfg.loss.options(cfg.policy_loss)  # the loss's own registered options
        loss, m = get_policy_loss(cfg.policy_loss)(logp, old_logp, batch.advantages, mask, opts)
        kl = jnp.zeros_like(logp)
        if ref is not None:
            kl = kl_penalty(logp, ref, cfg.loss.kl_estimator, mask_BxT=mask)
            loss = loss + cfg.loss.kl_coef * kl
        num, den = get_aggregation(cfg.aggregation)(
            loss, mask, norm_constant=cfg.norm_constant or None
        )
        # Every per-token metric the loss returns, and the sampler/learner mismatch: delta =
        # learner - sampler log-prob of each token (the learner's params are the same for all
        # micro-batches of an update); w = exp(delta) gives the ESS, (w - 1) - delta >= 0 is the
        # k3 estimate of KL(sampler || learner). On-policy, delta is only numerics (sampler dtype).
        # (w is computed from delta clamped at 20 so that w^2 stays finite in float32.)
        delta = jax.lax.stop_gradient(logp) - batch.behavior_logp
        w = jnp.exp(jnp.where(mask > 0, jnp.minimum(delta, 20.0), 0.0))
        per_token = {
            **m,
            "clip_frac": m.get("clip_frac", jnp.zeros_like(logp)),
            "kl": kl,
            "ratio": m.get("ratio", jnp.ones_like(logp)),
            "entropy": jnp.zeros_like(logp) if ent is None else ent,
            "logprob_diff_abs": jnp.abs(delta),
            "logprob_kl": w - 1.0 - jnp.minimum(delta, 20.0),
            "ess_w": w,
            "ess_w2": w * w,
        }
        sums = {k: jnp.sum(jnp.where(mask > 0, v, 0.0)) for k, v in per_token.items()}
        sums["tokens"] = jnp.sum(mask)
        sums["sequences"] = jnp.sum(jnp.any(mask > 0, axis=1)).astype(jnp.float32)
        ratio = per_token["ratio"]
        maxes = {
            "ratio_max": jnp.max(jnp.where(mask > 0, ratio, -jnp.inf)),
            "ratio_min_neg": jnp.max(jnp.where(mask > 0, -ratio, -jnp.inf)),
        }
        return num, (den, sums, maxes)

    (num, (den, sums, maxes)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    return Accum(
        grads=jax.tree.map(lambda a, g: a + g.astype(jnp.float32), acc.grads, grads),
        numerator=acc.numerator + num,
        denominator=acc.denominator + den,
        sums={k: acc.sums.get(k, 0.0) + v for k, v in sums.items()},
        maxes={k: jnp.maximum(acc.maxes.get(k, -jnp.inf), v) for k, v in maxes.items()},
    )


def apply(
    state: TrainState, acc: Accum, *, tx: optax.GradientTransformation, schedule: optax.Schedule
) -> tuple[TrainState, dict[str, jax.Array]]:
    """One optimizer update from an accumulator: gradients and loss divided once by the denominator."""
    den = jnp.maximum(acc.denominator, 1e-9)
    grads = jax.tree.map(lambda g, p: (g / den).astype(p.dtype), acc.grads, state.params)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    tokens = jnp.maximum(acc.sums["tokens"], 1.0)
    metrics = {
        "loss": acc.numerator / den,
        "grad_norm": optax.tree.norm(grads),
        "lr": schedule(state.step),
        "tokens": acc.sums["tokens"],
        "sequences": acc.sums["sequences"],
        # ESS = (sum w)^2 / (N sum w^2) over the update's tokens (PipelineRL), in (0, 1]
        "ess": acc.sums["ess_w"] ** 2 / (tokens * jnp.maximum(acc.sums["ess_w2"], 1e-30)),
        **{k: v / tokens for k, v in acc.sums.items() if k not in _COUNTS},
        # the importance ratio's extremes over the update's tokens (its mean is "ratio")
        "ratio_max": acc.maxes["ratio_max"],
        "ratio_min": -acc.maxes["ratio_min_neg"],
    }
    new = TrainState(params=params, opt_state=opt_state, step=state.step + 1)
    # A non-finite loss, gradient, parameter or optimizer state leaves the state as it was; the
    # caller reports and stops (learner.Learner.update names the step and the leaf).
    metrics["nonfinite_leaf"] = _first_nonfinite((params, opt_state))
    ok = (
        jnp.isfinite(metrics["loss"])
        & jnp.isfinite(metrics["grad_norm"])
        & (metrics["nonfinite_leaf"] < 0)
    )
    return jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, state), metrics


def train_step(
    state: TrainState,
    batch: Batch,
    *,
    graphdef: nnx.GraphDef,
    cfg: LearnerConfig,
    tx: optax.GradientTransformation,
    schedule: optax.Schedule,
    frozen: Any = None,
    behavior_params: Any = None,
    ref_params: Any = None,
) -> tuple[TrainState, dict[str, jax.Array]]:
    """`apply(state, accumulate(zero, state.params, batch))`: one batch, one update."""
    acc = accumulate(
        zero_accum(state.params),
        state.params,
        batch,
        graphdef=graphdef,
        cfg=cfg,
        frozen=frozen,
        behavior_params=behavior_params,
        ref_params=ref_params,
    )
    return apply(state, acc, tx=tx, schedule=schedule)
