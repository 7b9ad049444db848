"""TrainState (params, opt_state, step), the optimizer, and placing both on the learner mesh."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from learner.config import OptimizerConfig
from rl.models.sharding import Rules, tree_shardings


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:
    params: Any  # nnx.State of the model's parameters
    opt_state: Any  # optax state
    step: jax.Array  # int32 scalar: optimizer updates applied


def make_lr_schedule(cfg: OptimizerConfig) -> optax.Schedule:
    """Linear warmup to cfg.lr, then constant or cosine decay to cfg.lr * cfg.end_lr_ratio."""
    if cfg.schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(
            init_value=0.0,
            peak_value=cfg.lr,
            warmup_steps=cfg.warmup_steps,
            decay_steps=cfg.total_steps,
            end_value=cfg.lr * cfg.end_lr_ratio,
        )
    if cfg.warmup_steps == 0:
        return optax.constant_schedule(cfg.lr)
    return optax.join_schedules(
        [optax.linear_schedule(0.0, cfg.lr, cfg.warmup_steps), optax.constant_schedule(cfg.lr)],
        [cfg.warmup_steps],
    )


def make_optimizer(cfg: OptimizerConfig) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW on the schedule."""
    adamw = optax.adamw(
        make_lr_schedule(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay
    )
    if cfg.grad_clip_norm == 0:
        return adamw
    return optax.chain(optax.clip_by_global_norm(cfg.grad_clip_norm), adamw)


def _path_keys(path: tuple[Any, ...]) -> tuple[Any, ...]:
    out = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                out.append(getattr(k, attr))
                break
        else:
            out.append(str(k))
    return tuple(out)


def opt_state_shardings(abstract_opt_state: Any, param_shardings: Any, mesh: Mesh) -> Any:
    """Shardings for an optax state: a leaf that mirrors a parameter (Adam's mu, nu, ...) takes the
    parameter's sharding (matched by the parameter's tree path as a suffix of the leaf's path and
    by shape); anything else (counts, scalars) is replicated. Initialising optimizer state under
    jit without this puts it on one device."""
    by_path = {}
    for path, s in jax.tree_util.tree_flatten_with_path(param_shardings)[0]:
        by_path[_path_keys(path)] = s
    replicated = NamedSharding(mesh, PartitionSpec())

    def one(path: tuple[Any, ...], leaf: Any) -> NamedSharding:
        keys = _path_keys(path)
        for i in range(len(keys)):
            s = by_path.get(keys[i:])
            if s is not None and len(s.spec) <= leaf.ndim:
                return s
        return replicated

    return jax.tree_util.tree_map_with_path(one, abstract_opt_state)


def state_shardings(
    abstract_params: Any, tx: optax.GradientTransformation, mesh: Mesh, rules: Rules | None = None
) -> TrainState:
    """TrainState of NamedShardings: params by logical axes, optimizer state mirroring them."""
    params = tree_shardings(abstract_params, mesh, rules)
    abstract_opt = jax.eval_shape(tx.init, abstract_params)
    replicated = NamedSharding(mesh, PartitionSpec())
    return TrainState(
        params=params,
        opt_state=opt_state_shardings(abstract_opt, params, mesh),
        step=replicated,
    )


def create_train_state(
    params: Any,
    tx: optax.GradientTransformation,
    *,
    mesh: Mesh,
    rules: Rules | None = None,
) -> tuple[TrainState, TrainState]:
    """A TrainState on `mesh` (a copy of `params`, resharded) and its shardings.

    Returns:
      (state, shardings): every leaf of `state` already has the sharding in `shardings`.
    """
    abstract = jax.eval_shape(lambda p: p, params)
    shardings = state_shardings(abstract, tx, mesh, rules)

    def init(p: Any) -> TrainState:
        p = jax.tree.map(jnp.copy, p)
        return TrainState(params=p, opt_state=tx.init(p), step=jnp.zeros((), jnp.int32))

    state = jax.jit(init, out_shardings=shardings)(params)
    return state, shardings
