"""The learner's programs on one mesh: its jitted step functions, built and compiled ahead.

    programs = build_programs(mesh, shardings, frozen_shardings, graphdef=..., cfg=cfg, tx=tx, ...)
    precompile(programs, state=state, frozen=frozen, with_ref=False, micro_batches=mb, ...)

`build_programs` jits learner/step.py's pure functions for one mesh (zero the accumulator,
accumulate a micro-batch, apply the optimizer update, copy parameters, gather a tree), their outputs
placed by the TrainState's shardings there, each counted and timed by the run's CompileCounter
(rl/compiles.py: the compile budget). `precompile` compiles, ahead, every program a run calls on
that mesh: the accumulator, one micro-step per micro-batch shape (and per old-log-prob source), the
optimizer update. A Learner (learner/learner.py) holds the programs of its own mesh and, while it
borrows devices, those of the extended mesh (learner/borrow.py).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from learner.batching import Batch
from learner.config import LearnerConfig
from learner.micro_batches import MicroBatches
from learner.step import MAX_KEYS, Accum, accumulate, apply, sum_keys, zero_accum
from rl.compiles import CompileCounter
from rl.models.sharding import Rules, axis_rules, logical_to_spec


def check_rows(cfg: LearnerConfig, mesh: Mesh) -> int:
    """The mesh's batch shards (fsdp x data), which must divide a micro-batch's rows."""
    shards = math.prod(mesh.shape[a] for a in ("fsdp", "data") if a in mesh.axis_names)
    if cfg.micro_batch_rows % shards:
        raise ValueError(
            f"learner.micro_batch_rows ({cfg.micro_batch_rows}) must be divisible by the learner "
            f"mesh's batch shards ({shards}: fsdp)."
        )
    return shards


@dataclasses.dataclass
class Programs:
    """The step functions of one mesh: the learner's own, or extended over borrowed devices."""

    mesh: Mesh
    shards: int  # the mesh's batch shards (fsdp x data): they divide every micro-batch's rows
    shardings: Any  # TrainState of NamedShardings
    frozen_shardings: Any  # the untrained parameters' (the LoRA base; empty without LoRA)
    acc_shardings: Accum
    zero: Any
    accumulate: Any
    apply: Any
    apply_keep_params: Any
    copy: Any
    gather: Any  # any pytree, replicated on every device of the mesh (a collective)


def build_programs(
    mesh: Mesh,
    shardings: Any,
    frozen_shardings: Any,
    *,
    graphdef: Any,
    cfg: LearnerConfig,
    tx: Any,
    lr_schedule: Any,
    compiles: CompileCounter,
    tag: str = "",
) -> Programs:
    """The jitted step functions of one mesh (their outputs placed by `shardings`), named with
    `tag` in `compiles`."""
    rep = NamedSharding(mesh, PartitionSpec())
    keys = sum_keys(cfg)  # every metric the policy loss returns reaches update()'s metrics
    acc_shardings = Accum(
        grads=shardings.params,
        numerator=rep,
        denominator=rep,
        sums=dict.fromkeys(keys, rep),
        maxes=dict.fromkeys(MAX_KEYS, rep),
    )
    kw = dict(graphdef=graphdef, cfg=cfg)
    jit = compiles.jit
    return Programs(
        mesh=mesh,
        shards=check_rows(cfg, mesh),
        shardings=shardings,
        frozen_shardings=frozen_shardings,
        acc_shardings=acc_shardings,
        zero=jit(
            "zero" + tag, functools.partial(zero_accum, keys=keys), out_shardings=acc_shardings
        ),
        accumulate=jit(
            "accumulate" + tag,
            functools.partial(accumulate, **kw),
            donate_argnums=(0,),
            out_shardings=acc_shardings,
        ),
        apply=jit(
            "apply" + tag,
            functools.partial(apply, tx=tx, schedule=lr_schedule),
            donate_argnums=(0,),
            out_shardings=(shardings, rep),
        ),
        # The same update, donating everything but the parameters: used once after
        # `share_params` handed the current parameter buffers to a colocated sampler that
        # still reads them.
        apply_keep_params=jit(
            "apply_keep_params" + tag,
            lambda params, rest, acc: apply(
                dataclasses.replace(rest, params=params),
                acc,
                tx=tx,
                schedule=lr_schedule,
            ),
            donate_argnums=(1,),
            out_shardings=(shardings, rep),
        ),
        copy=jit("copy" + tag, lambda p: jax.tree.map(jnp.copy, p), out_shardings=shardings.params),
        gather=jit("gather" + tag, lambda tree: tree, out_shardings=rep),
    )


def batch_shardings(batch: Batch, mesh: Mesh, rules: Rules) -> Batch:
    """A micro-batch's shardings on `mesh`: its rows over the batch axes, the rest whole."""

    def one(x: Any) -> NamedSharding:
        names = ("batch",) + (None,) * (len(x.shape) - 1)
        return NamedSharding(mesh, logical_to_spec(names, mesh, rules, shape=x.shape))

    return jax.tree.map(one, batch)


def precompile(
    programs: Programs,
    *,
    state: Any,
    frozen: Any,
    with_ref: bool,
    micro_batches: MicroBatches,
    rules: Rules,
    snapshot: bool,
    shared_params: bool,
) -> None:
    """Compiles, now, every program a run calls on `programs`' mesh for a TrainState shaped like
    `state` and untrained parameters like `frozen`: the accumulator, one micro-step per
    micro-batch shape (`with_ref`: reading the KL reference; `snapshot`: also reading a behaviour
    snapshot), the optimizer update (`shared_params`: also the one keeping the parameters)."""

    def abstract(tree: Any, shardings: Any) -> Any:
        return jax.tree.map(
            lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), tree, shardings
        )

    with jax.set_mesh(programs.mesh), axis_rules(rules):
        state = abstract(state, programs.shardings)
        frozen = abstract(frozen, programs.frozen_shardings)
        params = state.params
        acc = abstract(programs.zero.eval_shape(params), programs.acc_shardings)
        ref = params if with_ref else None
        programs.zero.precompile(params)
        programs.copy.precompile(params)  # a round's behaviour snapshot, set_params
        for shape in micro_batches.shapes(programs.shards):
            shapes = micro_batches.abstract(shape)
            batch = abstract(shapes, batch_shardings(shapes, programs.mesh, rules))
            for behavior in (None, params) if snapshot else (None,):
                programs.accumulate.precompile(
                    acc, params, batch, frozen=frozen, behavior_params=behavior, ref_params=ref
                )
        programs.apply.precompile(state, acc)
        if shared_params:
            rest = dataclasses.replace(state, params=None)
            programs.apply_keep_params.precompile(params, rest, acc)
