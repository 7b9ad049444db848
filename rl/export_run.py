"""A run's checkpoint as a Hugging Face directory, after the fact (`python -m launch.export`).

    save_run_config(config, "runs/x")                  # rl.run.train does this at start
    export_checkpoint("runs/x", "runs/x/hf-step4", step=4)

A run writes its config to workdir/config.json when it starts; the export reads it back, builds the
run's model and learner state on this host's devices (the checkpoint reshards onto any mesh),
restores checkpoint `step` (default: the newest intact one) and writes it with rl.models.export,
tokenizer files included. A workdir from before config.json was written takes the config file the
run used (`config=`).
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import ml_collections

from learner.checkpoint import Checkpointer, saved_steps
from learner.mesh import MeshConfig, make_meshes
from rl.runtime.compose import (
    Setup,
    build_checked_model,
    build_learner,
    export_policy,
    updates_per_round,
)

RUN_CONFIG = "config.json"  # in the workdir: the config the run was started with


def save_run_config(config: Any, workdir: str) -> str:
    """Writes `config` to workdir/config.json (atomically); returns the path."""
    path = os.path.join(workdir, RUN_CONFIG)
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(config.to_json_best_effort(indent=1, sort_keys=True))
    os.replace(tmp, path)
    return path


def load_run_config(workdir: str) -> ml_collections.ConfigDict:
    """The config a run saved in `workdir`.

    Raises:
      FileNotFoundError: the workdir holds no config.json (a run from before it was written).
      ValueError: config.json is not a JSON object.
    """
    path = os.path.join(workdir, RUN_CONFIG)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{path} does not exist: {workdir} holds no run config; expected the workdir of a run "
            "(it writes config.json when it starts), or pass the run's config file (--config)."
        )
    with open(path, encoding="utf-8") as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(
                f"{path} is not valid JSON ({e}); expected a run's saved config."
            ) from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} holds a {type(data).__name__}; expected a JSON object.")
    return ml_collections.ConfigDict(data)


def export_checkpoint(
    workdir: str,
    out: str | None = None,
    *,
    step: int | None = None,
    config: Any = None,
    dtype: str = "",
) -> dict[str, Any]:
    """Exports checkpoint `step` of the run in `workdir` as a Hugging Face directory `out`.

    Args:
      workdir: the run's workdir (its checkpoints are in workdir/ckpt).
      out: the output directory (created; files of the same names are replaced); None:
        workdir/hf-step<N>.
      step: the checkpoint step (a round count); None: the newest intact one.
      config: the run's config; None: workdir/config.json.
      dtype: tensor dtype on disk; "": config.export.dtype, else the model's param dtype.

    Returns:
      {"step", "out", "version"}: the step exported, where, and its weights' version.

    Raises:
      FileNotFoundError: no config, no checkpoint in workdir/ckpt, or none for `step`.
      ValueError: the checkpoint does not match the config's model, or is damaged.
    """
    config = load_run_config(workdir) if config is None else config
    directory = os.path.join(workdir, "ckpt")
    steps = saved_steps(directory)
    if not steps:
        raise FileNotFoundError(
            f"{directory} holds no checkpoint; expected a run trained with "
            "config.checkpoint_every > 0."
        )
    if step is not None and step not in steps:
        raise FileNotFoundError(f"{directory} holds no checkpoint {step}; expected one of {steps}.")
    setup = Setup.from_config(config)
    # Every local device holds a shard (fsdp): a model too large for one device still exports.
    mesh, _ = make_meshes(MeshConfig(colocated=True), jax.devices())
    model = build_checked_model(config, setup, mesh)
    learner = build_learner(
        config,
        setup,
        model,
        mesh,
        total_updates=max(1, config.rounds) * updates_per_round(config),
    )
    ckpt = Checkpointer(directory)
    try:
        learner.state, meta = ckpt.restore(
            step, abstract_state=learner.state, shardings=learner.shardings
        )
    finally:
        ckpt.close()
    done = meta["round"]  # a checkpoint's step: the rounds done when it was saved (rl.run)
    out = os.path.join(workdir, f"hf-step{done}") if out is None else out
    if dtype:
        config.export.dtype = dtype
    export_policy(config, setup, learner, out)
    return {"step": done, "out": out, "version": meta["version"]}
