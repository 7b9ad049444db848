"""The learner: complete groups in, optimizer updates out, on its own mesh.

    learner = Learner(model, cfg, mesh=learner_mesh)
    learner.begin_round(updates=S)          # S optimizer updates this round
    learner.add_groups([group, ...])        # as groups arrive: advantages, micro-batches, gradients
    metrics = learner.update()              # after U groups: one optimizer update
    params = learner.params                 # publish to the sampler (learner/publish.py)

Groups are turned into micro-batches (learner/micro_batches.py: `cfg.micro_batch_rows` rows of a few
fixed lengths) as soon as enough sequences have arrived to fill one, and their gradients are
accumulated at once; `update` folds in the remainder and applies. `precompile` compiles every
program a run will call (each micro-batch shape, the optimizer update) ahead, at start
(learner/programs.py). `borrow` moves the learner onto a mesh extended over another side's devices
until `give_back` (learner/borrow.py).

The mesh may span several processes (learner/distributed.py: one jax.distributed job, one process
per host): every process then makes the same calls with the same groups, and each copies only its
own rows of a micro-batch to its devices.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from learner.batching import Batch, Seq, sequences_of
from learner.borrow import Arrays, BorrowSnapshot, extended_mesh, from_host, gather_home, move
from learner.config import LearnerConfig
from learner.distributed import put_global
from learner.micro_batches import MicroBatches
from learner.programs import Programs, batch_shardings, build_programs, check_rows, precompile
from learner.state import create_train_state, make_lr_schedule, make_optimizer, state_shardings
from learner.step import Accum, float_leaf_names
from rl.advantages import get_advantage_estimator
from rl.compiles import CompileCounter
from rl.models.lora import split_trainable
from rl.models.sharding import Rules, axis_rules, current_rules, tree_shardings
from rl.types import Group


class Learner:
    """Owns the TrainState on the learner mesh; see the module docstring."""

    def __init__(
        self,
        model: nnx.Module,
        cfg: LearnerConfig,
        *,
        mesh: Mesh,
        rules: Rules | None = None,
    ):
        if cfg.policy_loss == "decoupled_ppo" and cfg.old_logprobs != "sampler":
            raise ValueError(
                f"learner.policy_loss='decoupled_ppo' with learner.old_logprobs="
                f"{cfg.old_logprobs!r}; expected 'sampler' (its behaviour weights need the "
                "sampler's log-probs; the proximal policy is the learner's own)."
            )
        self.cfg = cfg
        self.rules = current_rules() if rules is None else rules
        shards = check_rows(cfg, mesh)
        self.graphdef, params = nnx.split(model)
        # LoRA (rl/models/lora.py): the TrainState holds the adapters, `frozen` the base
        trainable, frozen = split_trainable(params)
        self.tx = make_optimizer(cfg.optimizer)
        self.lr_schedule = make_lr_schedule(cfg.optimizer)
        with jax.set_mesh(mesh), axis_rules(self.rules):
            self.state, shardings = create_train_state(
                trainable, self.tx, mesh=mesh, rules=self.rules
            )
            self.frozen = jax.device_put(frozen, tree_shardings(frozen, mesh, self.rules))
        self.ref_params = None
        if cfg.loss.kl_coef > 0:  # frozen reference: the initial policy, never donated
            self.ref_params = jax.jit(
                lambda p: jax.tree.map(jnp.copy, p), out_shardings=shardings.params
            )(self.state.params)
        self._compiles = CompileCounter()
        self._home = self._steps = self._compile_steps(mesh, shardings)
        self._borrowed: Programs | None = None  # the extended mesh's steps, kept across switches
        # what `precompile` compiled ahead (a borrowed mesh compiles the same)
        self._variants = dict(snapshot=False, shared_params=False)
        self._params_shared = False
        self._acc: Accum | None = None
        self.micro_batches = MicroBatches.from_config(
            rows=cfg.micro_batch_rows,
            min_length_bucket=cfg.min_length_bucket,
            max_positions=cfg.max_length - 1,
            pack=cfg.packing,
            halvings=cfg.flush_halvings,
            row_multiple=shards,
        )
        self._pending: list[Seq] = []  # sequences not yet in a micro-batch, in arrival order
        self._behavior: Any = None
        self.updates_in_round = 0
        self.groups_in_update = 0
        self._tokens_in_update = 0  # loss tokens accumulated since the last update (host count)
        self._filtered_in_update = 0  # overlong filter: truncated sequences masked out
        self._positions_in_update = 0  # model positions (rows x length) of its micro-batches
        self._filled_in_update = 0  # of those, the positions sequences hold

    @property
    def mesh(self) -> Mesh:
        """The mesh the TrainState is on now (the extended one while devices are borrowed)."""
        return self._steps.mesh

    @property
    def shardings(self) -> Any:
        """The TrainState's shardings on `mesh`."""
        return self._steps.shardings

    def _compile_steps(self, mesh: Mesh, shardings: Any, tag: str = "") -> Programs:
        """The jitted step functions of one mesh (learner/programs.py)."""
        return build_programs(
            mesh,
            shardings,
            tree_shardings(self.frozen, mesh, self.rules),
            graphdef=self.graphdef,
            cfg=self.cfg,
            tx=self.tx,
            lr_schedule=self.lr_schedule,
            compiles=self._compiles,
            tag=tag,
        )

    @contextlib.contextmanager
    def _on_mesh(self) -> Iterator[None]:
        with jax.set_mesh(self.mesh), axis_rules(self.rules):
            yield

    # ------------------------------------------------------------------------------------ state

    @property
    def params(self) -> Any:
        """The current parameters of the whole model (an nnx State on the learner mesh): what a
        publish hands the sampler. With LoRA the base's arrays are the same objects every time."""
        if not self.lora:
            return self.state.params
        return nnx.merge_state(self.frozen, self.state.params)

    @property
    def lora(self) -> bool:
        """Only LoRA adapters train: `state.params` holds them, `frozen` the base."""
        return bool(jax.tree.leaves(self.frozen))

    def share_params(self) -> Any:
        """The current parameters of the whole model (`params`), handed out without a copy
        (colocated publishing).

        The next `update` then writes new parameter buffers instead of donating (overwriting)
        these, so a reader that keeps them (a sampler decoding with them) is not affected (a LoRA
        base is never donated).
        """
        self._params_shared = True
        return self.params

    @property
    def step(self) -> int:
        return int(self.state.step)

    def set_params(self, params: Any) -> None:
        """Replaces the trained parameters (`state.params`' structure: every parameter, or the
        LoRA adapters; e.g. after an SFT warm start); the KL reference follows them."""
        if self._pending or self._acc is not None:
            raise RuntimeError("set_params called with groups accumulated but not applied.")
        params = self._steps.copy(params)
        self.state = dataclasses.replace(self.state, params=params)
        if self.ref_params is not None:
            self.ref_params = self._steps.copy(params)

    def begin_round(self, updates: int) -> None:
        """Starts a round of `updates` optimizer updates from the current (= published) params.

        With more than one update and old_logprobs == "snapshot", the current params are kept as
        the behaviour policy for the round's later updates.
        """
        if self._pending or self._acc is not None:
            raise RuntimeError("begin_round called with groups accumulated but not applied.")
        self.updates_in_round = 0
        self._behavior = None
        if updates > 1 and self.cfg.old_logprobs == "snapshot":
            self._behavior = self._steps.copy(self.state.params)

    # ----------------------------------------------------------------------------------- groups

    def add_groups(
        self, groups: Iterable[Group], *, before_batch: Callable[[], None] | None = None
    ) -> None:
        """Computes advantages and accumulates gradients of every full micro-batch.

        `before_batch` (if given) is called before each micro-batch is accumulated: a driver may
        move the learner onto borrowed devices there (`borrow`; async borrowing, rl/driver.py).
        """
        groups = list(groups)
        if not groups:
            return
        by_size: dict[int, list[int]] = {}
        for i, g in enumerate(groups):
            by_size.setdefault(len(g.completions), []).append(i)
        advantages: list[np.ndarray] = [np.empty(0)] * len(groups)
        estimator = get_advantage_estimator(self.cfg.advantage)
        for idx in by_size.values():  # one estimator call per group size, not per group
            rewards = np.asarray([groups[i].rewards for i in idx], np.float32)
            adv = np.asarray(estimator(rewards))
            for row, i in enumerate(idx):
                advantages[i] = adv[row]
        for g, adv in zip(groups, advantages, strict=True):
            seqs = sequences_of([g], [adv])
            if self.cfg.overlong_filter:  # DAPO: truncated responses get no loss
                truncated = [c.finish_reason == "length" for c in g.completions]
                seqs = [
                    dataclasses.replace(x, masked=t) for x, t in zip(seqs, truncated, strict=True)
                ]
                self._filtered_in_update += sum(truncated)
            self._pending.extend(seqs)
            self.groups_in_update += 1
            self._form(final=False, before_batch=before_batch)

    def _form(self, *, final: bool, before_batch: Callable[[], None] | None = None) -> None:
        """Accumulates every micro-batch the pending sequences fill (all of them when `final`)."""
        planned = self.micro_batches.plan([len(x) for x in self._pending], final=final)
        if not planned:
            return
        for shape, bins in planned:
            if before_batch is not None:
                before_batch()
            shape = self.micro_batches.on(shape, self._steps.shards)
            batch = self.micro_batches.batch(self._pending, shape, bins)
            self._tokens_in_update += batch.num_tokens
            self._positions_in_update += batch.segments.size
            self._filled_in_update += int((batch.segments > 0).sum())
            self._accumulate_batch(batch)
        chosen = {i for _, bins in planned for b in bins for i in b}
        self._pending = [x for i, x in enumerate(self._pending) if i not in chosen]

    @property
    def compiles(self) -> CompileCounter:
        """The programs its jitted steps compiled: counts, seconds, and those after start."""
        return self._compiles

    def compile_counts(self) -> dict[str, int]:
        """How many programs each jitted step function has compiled."""
        return self._compiles.counts()

    def block_until_ready(self) -> None:
        """Waits for the micro-steps dispatched so far to finish computing (for timing them)."""
        jax.block_until_ready(self._acc)

    def _accumulate_batch(self, batch: Batch) -> None:
        # Every process of a multi-process learner packed the same batch; each copies its rows.
        batch = jax.tree.map(put_global, batch, batch_shardings(batch, self.mesh, self.rules))
        with self._on_mesh():
            if self._acc is None:
                self._acc = self._steps.zero(self.state.params)
            self._acc = self._steps.accumulate(
                self._acc,
                self.state.params,
                batch,
                frozen=self.frozen,
                behavior_params=self._behavior if self.updates_in_round else None,
                ref_params=self.ref_params,
            )

    def update(self) -> dict[str, float]:
        """Applies one optimizer update from everything accumulated since the last one.

        Raises:
          ValueError: nothing (or no response token) was accumulated.
          FloatingPointError: the loss or gradient norm is NaN/inf (names the step and metric), or
            the update would make a parameter or optimizer state value NaN/inf (names the step
            and the leaf); the update is not applied.
        """
        self._form(final=True)
        if self._acc is None:
            raise ValueError(
                "update() with no groups accumulated; expected at least one group with response "
                "tokens (the schedule gives every Update a non-empty batch)."
            )
        step = self.step
        filtered, self._filtered_in_update = self._filtered_in_update, 0
        tokens, self._tokens_in_update = self._tokens_in_update, 0
        # The micro-batches' padded area: what the model computed on that held no sequence.
        positions, self._positions_in_update = self._positions_in_update, 0
        filled, self._filled_in_update = self._filled_in_update, 0
        if tokens == 0 and filtered:  # every response truncated and filtered: no gradient, no step
            shapes = self._home.apply.eval_shape(self.state, self._acc)[1]  # metric names
            self._acc = None
            metrics = dict.fromkeys(shapes, 0.0)
            metrics.update(lr=float(self.lr_schedule(step)), nonfinite_leaf=-1.0)
        else:
            with self._on_mesh():
                if self._params_shared:  # the sampler reads these params: no donation
                    rest = dataclasses.replace(self.state, params=None)
                    self.state, metrics = self._steps.apply_keep_params(
                        self.state.params, rest, self._acc
                    )
                    self._params_shared = False
                else:
                    self.state, metrics = self._steps.apply(self.state, self._acc)
            self._acc = None
            metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
            if metrics["tokens"] == 0:
                raise ValueError(f"Update {step}: the accumulated batch holds no response tokens.")
        metrics["overlong_filtered"] = float(filtered)  # truncated sequences masked out
        for name in ("loss", "grad_norm"):
            if not math.isfinite(metrics[name]):
                raise FloatingPointError(
                    f"Non-finite {name}={metrics[name]} at update {step}; the update was not "
                    "applied (parameters and optimizer state are unchanged)."
                )
        bad = int(metrics.pop("nonfinite_leaf"))
        if bad >= 0:
            raise FloatingPointError(
                f"Non-finite values in {float_leaf_names(self.state)[bad]} after update {step} "
                f"(loss={metrics['loss']:.4g}, grad_norm={metrics['grad_norm']:.4g}, "
                f"lr={metrics['lr']:.4g}); the update was not applied (parameters and optimizer "
                "state are unchanged). Expected finite values: lower learner.optimizer.lr."
            )
        metrics["groups"] = float(self.groups_in_update)
        metrics["positions"] = float(positions)
        metrics["padded_fraction"] = 1.0 - filled / positions
        self.groups_in_update = 0
        self.updates_in_round += 1
        return metrics

    # --------------------------------------------------------------------------- borrowing

    @property
    def borrowing(self) -> bool:
        """True while the TrainState is on the mesh extended over borrowed devices."""
        return self._steps is not self._home

    def prepare_borrow(self, devices: Sequence[Any]) -> None:
        """Compiles the steps (what `precompile` compiled on the learner's own mesh) for the
        data-parallel mesh over the learner's devices then `devices` (fsdp over all of them, tp
        kept). Called by `borrow` if not before; the compiled steps are kept for later switches to
        the same devices.
        """
        mesh = extended_mesh(self._home.mesh, devices)
        if self._borrowed is not None and list(self._borrowed.mesh.devices.flat) == list(
            mesh.devices.flat
        ):
            return
        with jax.set_mesh(mesh), axis_rules(self.rules):
            shardings = state_shardings(
                jax.eval_shape(lambda p: p, self.state.params), self.tx, mesh, self.rules
            )
            steps = self._compile_steps(mesh, shardings, tag="@borrowed")
        self._precompile(steps, **self._variants)
        self._borrowed = steps

    def precompile(self, *, updates_per_round: int = 1, shared_params: bool = False) -> None:
        """Compiles, now, every program a run calls on the learner's mesh: the accumulator, one
        micro-step per micro-batch shape (and per old-log-prob source), the optimizer update.

        Args:
          updates_per_round: the schedule's updates per round S; with S > 1 and old_logprobs
            "snapshot" the micro-steps of later updates also read a behaviour snapshot.
          shared_params: publishing shares the learner's parameters with a colocated sampler
            (learner.publish.DevicePutSync): the update after a publish keeps them.
        """
        self._variants = dict(
            snapshot=updates_per_round > 1 and self.cfg.old_logprobs == "snapshot",
            shared_params=shared_params,
        )
        self._precompile(self._home, **self._variants)

    def _precompile(self, steps: Programs, *, snapshot: bool, shared_params: bool) -> None:
        precompile(
            steps,
            state=self.state,
            frozen=self.frozen,
            with_ref=self.ref_params is not None,
            micro_batches=self.micro_batches,
            rules=self.rules,
            snapshot=snapshot,
            shared_params=shared_params,
        )

    def borrow(self, devices: Sequence[Any], snapshot: BorrowSnapshot | None = None) -> None:
        """Reshards the TrainState (and the accumulator, behaviour and reference params) onto the
        mesh extended over `devices`; later add_groups / update run there until `give_back`.

        Devices of other processes of this jax.distributed job (a Ray sampler replica's, lent to
        the learner) cannot be reached by a device_put: every process of the extended mesh then
        calls `borrow` with the same `snapshot` (the learner's `borrow_snapshot`, host arrays and
        the round's bookkeeping) and builds its own shards from it; the others hold none of the
        learner's arrays before.
        """
        if self.borrowing:
            raise RuntimeError("borrow called while already borrowing; call give_back first.")
        self.prepare_borrow(devices)
        assert self._borrowed is not None
        if self._borrowed.mesh.is_multi_process:
            if snapshot is None:
                raise ValueError(
                    "borrow: the extended mesh spans processes; expected the learner's "
                    "borrow_snapshot() (the same in every process of the mesh)."
                )
            self._move_from_host(self._borrowed, snapshot)
        else:
            self._move(self._borrowed)

    def give_back(self) -> None:
        """Reshards everything back onto the learner's own mesh (before weights are published).

        Across processes (see `borrow`), every process of the extended mesh calls it: the arrays
        are gathered whole on the extended mesh (a collective) and the learner's process keeps
        them on its own devices; a lending process keeps nothing.
        """
        if not self.borrowing:
            raise RuntimeError("give_back called while not borrowing.")
        if self._steps.mesh.is_multi_process:
            self._move_home_across()
        else:
            self._move(self._home)

    def borrow_snapshot(self) -> BorrowSnapshot:
        """What the processes lending devices need to join the learner's borrowed steps: the
        TrainState, accumulator, behaviour and reference params as host arrays, and the round's
        bookkeeping (groups not yet in a micro-batch, counters). Called on the learner's mesh."""
        if self.borrowing:
            raise RuntimeError("borrow_snapshot called while borrowing; call give_back first.")
        arrays = jax.device_get(self._arrays())
        fields = {name: getattr(self, name) for name in BorrowSnapshot.FIELDS}
        return BorrowSnapshot(arrays=arrays, fields=fields)

    def _arrays(self) -> Arrays:
        return (self.state, self._acc, self._behavior, self.ref_params, self.frozen)

    def _set_arrays(self, arrays: Arrays) -> None:
        self.state, self._acc, self._behavior, self.ref_params, self.frozen = arrays

    def _move_from_host(self, to: Programs, snapshot: BorrowSnapshot) -> None:
        self._set_arrays(from_host(snapshot.arrays, to))
        for name, value in snapshot.fields.items():
            setattr(self, name, value)
        self._steps = to

    def _move_home_across(self) -> None:
        self._set_arrays(gather_home(self._arrays(), self._steps, self._home))
        self._steps = self._home

    def _move(self, to: Programs) -> None:
        self._set_arrays(move(self._arrays(), to))
        self._steps = to
