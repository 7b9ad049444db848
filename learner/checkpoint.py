"""Orbax checkpoints of the TrainState plus JSON host state, verified, restorable onto any mesh.

    ckpt = Checkpointer("/tmp/run/ckpt", max_to_keep=3)
    ckpt.save(step, learner.state, {"round": r, "data": iterator.get_state()})
    state, meta = ckpt.restore(abstract_state=learner.state, shardings=learner.shardings)

A step directory holds `state` (the TrainState arrays; typed PRNG keys as their uint32 key data),
`prng` (JSON: each key leaf's implementation, to re-wrap the data), `meta` (JSON: the caller's
host state: round, policy version, data iterator state, queues) and `checksums.json`: the size and
SHA-256 of every file of the step, written last, once orbax has finished the step
(learner/checksums.py). `save` is asynchronous: it returns once the arrays are copied off the
devices (the step may donate them next); `wait` blocks until the files and the checksums are
written. `save` refuses a state holding NaN/inf.

`restore` verifies a step before orbax reads it. A step with no checksums.json (a save that did not
finish: killed, or an empty directory), a missing or truncated file, or a file whose checksum
differs (a flipped bit) is damaged: `restore()` of the latest step logs one line naming the step
and the file, moves the step to `<directory>/damaged/` and falls back to the newest intact step
(older steps are kept for this reason); with `strict=True`, or for an explicit step, it raises
`CheckpointDamagedError` with that line instead. When every step is damaged it raises
`NoIntactCheckpointError` (a run then starts over: rl/run.py).

Orbax keys the operations in flight on one process-wide counter, so two managers saving at once
in one process (pipelines multiplexed in threads: rl/runtime/pool.py) read each other's signals
and write into each other's temporary directories. Orbax's work is therefore one Checkpointer's
at a time per process (`_ORBAX`): a save holds it from its start until orbax has written the step
(the background part included), a restore while it reads.

A multi-process learner (learner/distributed.py) makes the same calls in every process, on one
directory they all see: orbax writes each process's shards and process 0 the metadata; process 0
alone writes the checksums (the others wait for them at a barrier) and, in `restore`, verifies the
steps, moves damaged ones aside and tells the others which step to read.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import shutil
import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from jax.experimental import multihost_utils

from learner.checksums import verify_checksums, write_checksums
from learner.state import TrainState

BARRIER_TIMEOUT_S = 600  # a multi-process save: how long processes wait for process 0's checksums
# A multi-process restore: what process 0 found instead of a step.
_NO_STEP, _DAMAGED, _NONE_INTACT = -1, -2, -3
DAMAGED = "damaged"  # damaged steps are moved to <directory>/damaged/<step>
_ORBAX = threading.Lock()  # orbax at work for one Checkpointer of this process (module docstring)


class CheckpointDamagedError(ValueError):
    """A checkpoint step is incomplete or corrupt; the message names the step and the file."""


class NoIntactCheckpointError(CheckpointDamagedError):
    """Every step of a checkpoint directory was damaged (each was moved to `damaged/`)."""


def _is_key(x: Any) -> bool:
    return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _json_safe(x: Any) -> bool:
    try:
        json.dumps(x)
    except (TypeError, ValueError):
        return False
    return True


def _path_str(path: tuple[Any, ...]) -> str:
    """A tree path as "params/layers/0/mlp/up/value" (dict keys, attribute names, indices)."""
    return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def saved_steps(directory: str | os.PathLike) -> list[int]:
    """Step directories under `directory` (finished or not, unverified), without opening orbax."""
    try:
        names = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(
        int(n) for n in names if n.isdigit() and os.path.isdir(os.path.join(directory, n))
    )


@jax.jit
def _finite_leaves(arrays: Any) -> jax.Array:
    leaves = [x for x in jax.tree.leaves(arrays) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves] or [jnp.bool_(True)])


def _shapes(tree: Any) -> dict[str, tuple[int, ...]]:
    """Leaf path ("params/layers/0/mlp/up/value") -> shape, in tree order."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {_path_str(p): tuple(x.shape) for p, x in leaves}


class Checkpointer:
    """Saves and restores (TrainState, meta) pairs under `directory`, one step directory each.

    Args:
      directory: where step directories are written (created if missing).
      max_to_keep: how many of the newest checkpoints to keep; older ones are deleted.
      async_save: write files in a background thread (`wait` blocks until they are written).
    """

    def __init__(
        self, directory: str | os.PathLike, *, max_to_keep: int = 3, async_save: bool = True
    ):
        if max_to_keep < 1:
            raise ValueError(f"max_to_keep must be >= 1; received {max_to_keep}.")
        self.directory = os.path.abspath(os.fspath(directory))
        json_item = ocp.JsonCheckpointHandler
        handlers = dict(state=ocp.StandardCheckpointHandler(), prng=json_item(), meta=json_item())
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, enable_async_checkpointing=async_save
        )
        with _ORBAX:
            self._mngr = ocp.CheckpointManager(
                self.directory, options=options, item_handlers=handlers
            )
        self._async = async_save
        # One worker finishes each save: waits for orbax, then writes the step's checksums. Every
        # other method waits for it first, so one thread at a time uses the manager.
        self._finisher = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ckpt")
        self._pending: concurrent.futures.Future | None = None
        self._closed = False
        self.damaged: list[tuple[int, str]] = []  # (step, what) found by the last restore
        # Barrier names of a multi-process save: unique per directory and per call, the same in
        # every process (each process makes the same saves in the same order).
        self._barrier_prefix = hashlib.sha256(self.directory.encode()).hexdigest()[:12]
        self._barriers = 0

    def save(self, step: int, state: TrainState, meta: dict[str, Any]) -> None:
        """Starts saving `state` and the JSON-serialisable host data `meta` as checkpoint `step`.

        Args:
          step: the checkpoint's number (e.g. the optimizer step); must exceed the latest saved.
          state: the TrainState; typed PRNG keys are stored as their key data.
          meta: host state to resume with (round, policy version, iterator state, queues); JSON
            turns tuples into lists and dict keys into strings.

        Raises:
          TypeError: `meta` is not a JSON-serialisable dict (names the offending keys).
          ValueError: `step` is not above the latest saved step.
          FloatingPointError: `state` holds NaN/inf (names the first such leaf); nothing is saved.
          RuntimeError: the Checkpointer is closed.
        """
        if self._closed:
            raise RuntimeError(
                f"Checkpoint step {step} was not saved: the Checkpointer of {self.directory} is "
                "closed; expected save before close."
            )
        if not isinstance(meta, dict):
            raise TypeError(f"Checkpoint meta must be a dict; received {type(meta).__name__}.")
        bad = [k for k, v in meta.items() if not _json_safe(v)]
        if bad or not _json_safe(meta):
            raise TypeError(
                f"Checkpoint meta must be JSON-serialisable (dict, list, str, int, float, bool, "
                f"None); received non-serialisable values under keys {bad or list(meta)}."
            )
        leaves = jax.tree_util.tree_flatten_with_path(state)[0]
        impls = {_path_str(p): str(jax.random.key_impl(x)) for p, x in leaves if _is_key(x)}
        arrays = jax.tree.map(lambda x: jax.random.key_data(x) if _is_key(x) else x, state)
        finite = jax.device_get(_finite_leaves(arrays))
        if not finite.all():
            names = [_path_str(p) for p, x in leaves if jnp.issubdtype(x.dtype, jnp.inexact)]
            raise FloatingPointError(
                f"Checkpoint step {step} was not saved: {names[int(finite.argmin())]} holds "
                "NaN/inf; expected finite values."
            )
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(arrays),
            prng=ocp.args.JsonSave(impls),
            meta=ocp.args.JsonSave(meta),
        )
        self._finish_pending()
        latest = self._mngr.latest_step()
        _ORBAX.acquire()  # released by `_finish` once orbax has written the step
        try:
            saved = self._mngr.save(int(step), args=args)
        except BaseException:
            _ORBAX.release()
            raise
        if not saved:
            _ORBAX.release()
            raise ValueError(
                f"Checkpoint step {step} was not saved: steps must increase, and "
                f"{self.directory} already holds step {latest}."
            )
        if self._async:
            self._pending = self._finisher.submit(self._finish, int(step))
        else:
            self._finish(int(step))

    def _finish(self, step: int) -> None:
        """Waits until orbax has written `step`, then writes its checksums (process 0 only).

        With several processes the others wait at a barrier until process 0 has written them, so
        that no process sees a finished save without its checksums (a damaged step).
        """
        try:
            self._mngr.wait_until_finished()
        finally:
            _ORBAX.release()  # taken by `save`
        if jax.process_count() == 1:
            write_checksums(self._step_dir(step))
            return
        self._barriers += 1
        try:
            if jax.process_index() == 0:
                write_checksums(self._step_dir(step))
        finally:  # a failed write on process 0 still releases the others (it raises there)
            ocp.multihost.get_barrier_sync_fn()(
                key=f"rolloutpipe_checksums_{self._barrier_prefix}_{step}_{self._barriers}",
                timeout_ms=BARRIER_TIMEOUT_S * 1000,
            )

    def _finish_pending(self) -> None:
        """Waits for the save in flight, if any; re-raises its error."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def _step_dir(self, step: int) -> str:
        return os.path.join(self.directory, str(step))

    def latest_step(self) -> int | None:
        """The newest checkpoint's step (not verified: see `restore`), or None when there is none."""
        self._finish_pending()
        return self._mngr.latest_step()

    def all_steps(self) -> list[int]:
        """Steps of all checkpoints orbax lists (not verified), oldest first."""
        self._finish_pending()
        return sorted(self._mngr.all_steps())

    def verify(self, step: int) -> str | None:
        """What is wrong with checkpoint `step` (the file and how), or None if it is intact."""
        self._finish_pending()
        return verify_checksums(self._step_dir(step))

    def _newest_intact(self, step: int | None, strict: bool) -> int:
        """The step to restore: `step` if intact, else (step None) the newest intact one.

        With several processes, process 0 alone verifies the steps and moves damaged ones aside;
        it tells the others the step to restore (or that there is none: then every process raises,
        process 0 with the message naming the step and the file).
        """
        if jax.process_count() == 1:
            return self._find_intact(step, strict)
        found, error = _NO_STEP, None
        if jax.process_index() == 0:
            try:
                found = self._find_intact(step, strict)
            except FileNotFoundError as e:
                error = e
            except NoIntactCheckpointError as e:
                found, error = _NONE_INTACT, e
            except CheckpointDamagedError as e:
                found, error = _DAMAGED, e
        found = int(multihost_utils.broadcast_one_to_all(np.int32(found)))
        if error is not None:
            raise error
        if found == _NO_STEP:
            raise FileNotFoundError(
                f"Process 0 found no checkpoint {'' if step is None else f'for step {step} '}"
                f"in {self.directory}; expected one (the directory must be shared by every "
                "process of the learner)."
            )
        if found == _NONE_INTACT:
            raise NoIntactCheckpointError(
                f"Process 0 found every step in {self.directory} damaged (its error names them); "
                "expected an intact step."
            )
        if found == _DAMAGED:
            raise CheckpointDamagedError(
                f"Process 0 found no intact checkpoint to restore in {self.directory} (its error "
                "names the step and the file); expected an intact step."
            )
        self._mngr.reload()  # process 0 may have moved damaged steps away
        return found

    def _find_intact(self, step: int | None, strict: bool) -> int:
        """`_newest_intact` in one process: verifies, and moves damaged steps aside."""
        steps = self.all_steps()
        if not steps:
            raise FileNotFoundError(f"No checkpoint found in {self.directory}.")
        if step is not None and int(step) not in steps:
            raise FileNotFoundError(
                f"No checkpoint for step {step} in {self.directory}; available steps: {steps}."
            )
        self.damaged = []
        for s in [int(step)] if step is not None else reversed(steps):
            problem = verify_checksums(self._step_dir(s))
            if problem is None:
                break
            where = f"Checkpoint step {s} in {self.directory} is damaged: {problem}"
            if step is not None or strict:
                raise CheckpointDamagedError(
                    f"{where}; expected an intact step"
                    + ("" if step is not None else " (resume is strict: no fall-back)")
                    + "."
                )
            self.damaged.append((s, problem))
            moved = self._quarantine(s)
            logging.warning("%s; moved it to %s and falling back to an older step.", where, moved)
        else:
            self._mngr.reload()  # every step was moved: the directory is empty for orbax
            raise NoIntactCheckpointError(
                f"No intact checkpoint in {self.directory}: every step was damaged ("
                + "; ".join(f"step {s}: {p}" for s, p in self.damaged)
                + f"; moved to {os.path.join(self.directory, DAMAGED)}). Expected at least one "
                "intact step."
            )
        if self.damaged:
            self._mngr.reload()  # orbax forgets the moved steps; saves continue after step s
        return s

    def _quarantine(self, step: int) -> str:
        """Moves a damaged step out of orbax's sight, to <directory>/damaged/<step>[.n]."""
        target = os.path.join(self.directory, DAMAGED, str(step))
        n = 1
        while os.path.exists(target):
            target = os.path.join(self.directory, DAMAGED, f"{step}.{n}")
            n += 1
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.move(self._step_dir(step), target)
        return target

    def restore(
        self,
        step: int | None = None,
        *,
        abstract_state: TrainState,
        shardings: TrainState,
        strict: bool = False,
    ) -> tuple[TrainState, dict[str, Any]]:
        """Restores checkpoint `step` (default: the newest intact one) onto `shardings`.

        Args:
          step: the checkpoint to restore; None for the newest intact one (damaged newer steps
            are logged, moved to <directory>/damaged/ and listed in `self.damaged`).
          abstract_state: a TrainState of arrays or ShapeDtypeStructs giving the expected
            structure, shapes and dtypes (e.g. `jax.eval_shape` of the initial state).
          shardings: a TrainState of shardings to place the arrays on; the mesh may differ from
            the one the checkpoint was saved from.
          strict: with step None, a damaged newest step raises instead of falling back.

        Returns:
          (state, meta): the TrainState on `shardings` and the host data given to `save`.

        Raises:
          FileNotFoundError: `directory` holds no checkpoint, or none for `step`.
          CheckpointDamagedError: `step` (or, strict, the newest step) is damaged, or no step
            is intact; names the step and the file.
          ValueError: the saved arrays do not match `abstract_state` (path and shapes named).
        """
        self.wait()
        step = self._newest_intact(step, strict)
        leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract_state)
        shard_leaves = treedef.flatten_up_to(shardings)
        data = jax.tree.map(
            lambda x: jax.eval_shape(jax.random.key_data, x) if _is_key(x) else x, abstract_state
        )
        with _ORBAX:
            saved = self._mngr.item_metadata(step)["state"]
        self._check_shapes(_shapes(getattr(saved, "tree", saved)), _shapes(data), step)
        target = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), data, shardings
        )
        args = ocp.args.Composite(
            state=ocp.args.StandardRestore(target),
            prng=ocp.args.JsonRestore(),
            meta=ocp.args.JsonRestore(),
        )
        with _ORBAX:
            out = self._mngr.restore(step, args=args)
        result = treedef.flatten_up_to(out["state"])
        for i, ((path, want), s) in enumerate(zip(leaves, shard_leaves, strict=True)):
            impl = out["prng"].get(_path_str(path))
            if _is_key(want):
                key = jax.random.wrap_key_data(result[i], impl=impl) if impl else result[i]
                if key.dtype != want.dtype:
                    raise ValueError(
                        f"Checkpoint step {step} in {self.directory}: {_path_str(path)} is saved "
                        f"as {key.dtype}; expected a {want.dtype} PRNG key."
                    )
                result[i] = jax.device_put(key, s)
        return treedef.unflatten(result), dict(out["meta"])

    def _check_shapes(
        self, saved: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]], step: int
    ) -> None:
        where = f"Checkpoint step {step} in {self.directory}"
        for path, shape in expected.items():
            if path not in saved:
                raise ValueError(f"{where} has no array {path}; expected one of shape {shape}.")
            if saved[path] != shape:
                raise ValueError(
                    f"{where} does not match the model: {path} has shape {saved[path]} in the "
                    f"checkpoint; expected {shape}."
                )
        extra = sorted(
            (p for p in saved if p not in expected), key=lambda p: p.split("/")[0] != "params"
        )
        if extra:
            raise ValueError(
                f"{where} holds arrays the model does not have: {extra[:5]} (shape "
                f"{saved[extra[0]]} for the first)."
            )

    def wait(self) -> None:
        """Blocks until every started save is written, its checksums included."""
        self._finish_pending()
        self._mngr.wait_until_finished()

    def close(self) -> None:
        """Waits for pending saves (checksums included) and releases the manager's resources.
        Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._finish_pending()
        finally:
            self._finisher.shutdown()
            self._mngr.close()
