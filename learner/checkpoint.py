"""Orbax checkpoints of the TrainState plus JSON host state, restorable onto any learner mesh.

    ckpt = Checkpointer("/tmp/run/ckpt", max_to_keep=3)
    ckpt.save(step, learner.state, {"round": r, "data": iterator.get_state()})
    state, meta = ckpt.restore(abstract_state=learner.state, shardings=learner.shardings)

A step directory holds `state` (the TrainState arrays; typed PRNG keys as their uint32 key data),
`prng` (JSON: each key leaf's implementation, to re-wrap the data) and `meta` (JSON: the caller's
host state: round, policy version, data iterator state, queues). `save` is asynchronous: it returns
once the arrays are copied off the devices (the step may donate them next); `wait` blocks until the
files are written.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import orbax.checkpoint as ocp

from learner.state import TrainState


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
        self._mngr = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)

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
        """
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
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(arrays),
            prng=ocp.args.JsonSave(impls),
            meta=ocp.args.JsonSave(meta),
        )
        latest = self._mngr.latest_step()
        if not self._mngr.save(int(step), args=args):
            raise ValueError(
                f"Checkpoint step {step} was not saved: steps must increase, and "
                f"{self.directory} already holds step {latest}."
            )

    def latest_step(self) -> int | None:
        """The newest finished checkpoint's step, or None when there is none."""
        return self._mngr.latest_step()

    def all_steps(self) -> list[int]:
        """Steps of all finished checkpoints, oldest first."""
        return sorted(self._mngr.all_steps())

    def restore(
        self, step: int | None = None, *, abstract_state: TrainState, shardings: TrainState
    ) -> tuple[TrainState, dict[str, Any]]:
        """Restores checkpoint `step` (default: the latest) onto `shardings`.

        Args:
          step: the checkpoint to restore; None for the latest.
          abstract_state: a TrainState of arrays or ShapeDtypeStructs giving the expected
            structure, shapes and dtypes (e.g. `jax.eval_shape` of the initial state).
          shardings: a TrainState of shardings to place the arrays on; the mesh may differ from
            the one the checkpoint was saved from.

        Returns:
          (state, meta): the TrainState on `shardings` and the host data given to `save`.

        Raises:
          FileNotFoundError: `directory` holds no checkpoint, or none for `step`.
          ValueError: the saved arrays do not match `abstract_state` (path and shapes named).
        """
        self.wait()
        steps = self.all_steps()
        if not steps:
            raise FileNotFoundError(f"No checkpoint found in {self.directory}.")
        step = steps[-1] if step is None else int(step)
        if step not in steps:
            raise FileNotFoundError(
                f"No checkpoint for step {step} in {self.directory}; available steps: {steps}."
            )
        leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract_state)
        shard_leaves = treedef.flatten_up_to(shardings)
        data = jax.tree.map(
            lambda x: jax.eval_shape(jax.random.key_data, x) if _is_key(x) else x, abstract_state
        )
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
        """Blocks until every started save is written."""
        self._mngr.wait_until_finished()

    def close(self) -> None:
        """Waits for pending saves and releases the manager's resources."""
        self._mngr.close()
