"""The Ray cluster a run uses: joining it, the workers' environment and names, the planned split.

`connect` joins the cluster at config.ray.address or starts a local one; `worker_env` is the
workers' runtime_env (this checkout's code and this process's JAX/XLA settings); `actor_name`
names a run's workers (one run per workdir); `planned_config` fixes the planner's split over the
cluster's GPUs into the config (config.mesh.split="plan").
"""

from __future__ import annotations

import logging
import os
from typing import Any

import jax
import ml_collections
import ray

import rl
from rl.runtime.mesh_plan import plan_mesh
from rl.runtime.worker_errors import role_label


def planned_config(config: Any) -> tuple[Any, Any]:
    """config with the planner's split fixed in (config.mesh.split="plan"; rl.runtime.mesh_plan),
    and the plan. The devices split are the cluster's GPUs (the learner worker then gets
    learner_devices of them, each replica sampler_devices), or, on a CPU cluster, the devices each
    worker process sees (every worker takes its first ones)."""

    gpus = int(ray.cluster_resources().get("GPU", 0))
    mesh, plan = plan_mesh(config, gpus or len(jax.devices()))
    out = ml_collections.ConfigDict(config.to_dict())
    for name in ("split", "learner_devices", "sampler_devices", "sampler_replicas"):
        out.mesh[name] = getattr(mesh, name)
    if gpus:
        out.ray.learner_gpus, out.ray.replica_gpus = mesh.learner_devices, mesh.sampler_devices
    return out, plan


def worker_env() -> dict[str, Any]:
    """runtime_env for the workers: this checkout's code first on their path, and this process's
    JAX/XLA settings (platform, fake CPU device count, compilation cache)."""

    root = os.path.dirname(os.path.dirname(os.path.abspath(rl.__file__)))
    env = {k: v for k, v in os.environ.items() if k.startswith(("JAX_", "XLA_"))}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    return {"env_vars": env}


def connect(cfg: Any) -> bool:
    """Joins the cluster at cfg.address ("auto" or host:port), or starts a local one ("").

    Returns:
      Whether this call started Ray (and so shuts it down at the end).
    """
    if ray.is_initialized():
        return False
    kwargs: dict[str, Any] = dict(
        log_to_driver=cfg.log_to_driver,  # workers' output stays in Ray's log files unless asked
        logging_level=logging.INFO if cfg.log_to_driver else logging.ERROR,
        include_dashboard=False,
    )
    if cfg.address:
        ray.init(address=cfg.address, **kwargs)
    else:
        ray.init(num_cpus=cfg.num_cpus or None, **kwargs)
    return True


def actor_name(config: Any, role: str) -> str:
    """The Ray name of a run's worker ("learner", "replica0", "queue"): one run per workdir."""
    return f"rolloutpipe:{os.path.abspath(config.workdir)}:{role}"


def actor_repr(actor: Any) -> str:
    """What the run's actors return as their repr: their role ("sampler replica 0"), which Ray
    puts in an error's message (rl.runtime.worker_errors); outside an actor, object's repr."""
    name = ray.get_runtime_context().get_actor_name()
    label = role_label(name) if name else None
    return label or object.__repr__(actor)
