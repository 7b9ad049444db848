"""What a Ray worker process sets up for itself: its config, its mesh, the learner's job, its cores.

Each worker (rl.runtime.ray_learner.LearnerWorker, rl.runtime.ray_replica.ReplicaCore) builds its
part of the run from the run's config (`worker_payload`: the config and every registration of the
driver's process, so the rewards, tasks, losses, ... a user's script registered resolve in the
worker too) on the devices its process sees (Ray gives each its GPUs;
on CPU every process sees the host). With learner borrowing (elastic.borrowing learner / both) the
learner worker and the replicas lending it their devices are processes of one jax.distributed job.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import ml_collections
from ray import cloudpickle

from learner.distributed import DistributedConfig, initialize
from learner.mesh import MeshConfig, make_meshes
from rl import registry


def worker_payload(config: Any) -> dict[str, Any]:
    """What a worker is built from: the run's config as a dict and this process's registrations
    (rl/registry.py `snapshot`), each entry pickled on its own (cloudpickle: a function defined in
    the user's script travels by value, one of an importable module by reference), so that one the
    worker cannot load fails alone, and only if the run uses it."""
    packed = {
        kind: {name: _pack(fn) for name, fn in named.items()}
        for kind, named in registry.snapshot().items()
    }
    return {"config": config.to_dict(), "registrations": packed}


def worker_config(payload: dict[str, Any]) -> Any:
    """The run's config from a `worker_payload`, the registrations it carries installed here
    first (names this process lacks: what the driver's script registered)."""
    registry.install(payload["registrations"], _unpack)
    return ml_collections.ConfigDict(payload["config"])


def _pack(fn: Any) -> bytes | str:
    """A registry entry pickled; a str: why it could not be."""
    try:
        return cloudpickle.dumps(fn)
    except Exception as e:  # noqa: BLE001 - recorded, raised in the worker only if used
        return f"it could not be pickled in the driver: {type(e).__name__}: {e}"


def _unpack(packed: bytes | str) -> Any:
    if isinstance(packed, str):
        raise RuntimeError(packed)
    return cloudpickle.loads(packed)


def local_mesh(config: Any, side: str, devices: list[Any] | None = None) -> Any:
    """The `side` ("learner" | "sampler") mesh over this process's first config.mesh.<side>_devices
    devices (0: every device the process sees) with config.mesh.<side>_tp; `devices`: another
    process's instead (a lending replica names the learner worker's mesh so)."""

    devices = jax.local_devices() if devices is None else devices
    n = config.mesh[f"{side}_devices"] or len(devices)
    tp = config.mesh[f"{side}_tp"]
    learner, sampler = make_meshes(
        MeshConfig(
            learner_devices=n, sampler_devices=n, learner_tp=tp, sampler_tp=tp, colocated=True
        ),
        devices,
    )
    return learner if side == "learner" else sampler


def job_devices(ids: list[int]) -> list[Any]:
    """The jax devices of the learner's jax.distributed job with these ids (every process's)."""

    by_id = {d.id: d for d in jax.devices()}
    return [by_id[i] for i in ids]


def join_job(config: Any, job: tuple[str, int, int]) -> None:
    """Joins the learner's jax.distributed job (coordinator, processes, rank) that the learner
    worker (rank 0) and the replicas lending it their devices form (elastic.borrowing learner /
    both); the job outlives a replica that dies."""

    coordinator, processes, rank = job
    initialize(
        DistributedConfig(
            coordinator_address=coordinator,
            num_processes=processes,
            process_id=rank,
            initialization_timeout_s=config.learner.distributed.initialization_timeout_s,
        ),
        recoverable=True,
    )


def pin(cores: list[int]) -> list[int]:
    """Pins this worker process to `cores` (os.sched_setaffinity); returns the cores it has."""
    os.sched_setaffinity(0, cores)
    return sorted(os.sched_getaffinity(0))
