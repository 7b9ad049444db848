"""The learner as a group of processes: one `jax.distributed` job (one process per host), one mesh.

    mesh = init_learner_group(config)          # in every learner process, before any jax work
    learner = Learner(model, cfg, mesh=mesh)   # unchanged: a Learner spans the processes
    learner.begin_round(...); learner.add_groups(groups); learner.update()
    host = gather_to_host(learner.params)      # numpy arrays in every process; process 0 publishes

The group runs SPMD: every process runs the same program. Each builds the same model (the same
seed, or the same checkpoint files), receives the same groups in the same order and makes the same
Learner calls; the jitted steps then run as one computation over the global mesh, gradients
reduced across processes by XLA's collectives (gloo on CPU, NCCL on GPU). Groups are host data
(token ids, a few KB): each process packs the same micro-batch and copies only the rows its own
devices hold (`put_global`), so no process moves another's shard. A checkpoint directory must be
one file system every process sees (orbax writes each process's shards; process 0 the metadata
and the checksums; learner/checkpoint.py).

`config.learner.distributed` names the job (configs/base.py): the coordinator's host:port (process
0's address), the number of processes and this process's id; fields left at their defaults come
from JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID, so a launcher can start the
same command on every host with a different environment. One process (the default) initialises
nothing.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding

from learner.mesh import MeshConfig
from rl.sections import from_section

ENV = {  # config field -> the environment variable a default value falls back to
    "coordinator_address": "JAX_COORDINATOR_ADDRESS",
    "num_processes": "JAX_NUM_PROCESSES",
    "process_id": "JAX_PROCESS_ID",
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistributedConfig:
    coordinator_address: str = ""  # "host:port" of process 0; needed with num_processes > 1
    num_processes: int = 1  # processes in the learner's jax.distributed job; 1: one process
    process_id: int = 0  # this process's rank in [0, num_processes)
    initialization_timeout_s: int = 300  # how long to wait for every process to join

    def __post_init__(self):
        for name in ("num_processes", "process_id", "initialization_timeout_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(
                    f"learner.distributed.{name}={v!r}; expected an integer (received "
                    f"{type(v).__name__})."
                )
        if self.num_processes < 1:
            raise ValueError(
                f"learner.distributed.num_processes={self.num_processes}; expected >= 1."
            )
        if not 0 <= self.process_id < self.num_processes:
            raise ValueError(
                f"learner.distributed.process_id={self.process_id}; expected an integer in "
                f"[0, num_processes={self.num_processes})."
            )
        if self.initialization_timeout_s < 1:
            raise ValueError(
                "learner.distributed.initialization_timeout_s="
                f"{self.initialization_timeout_s}; expected >= 1 (seconds)."
            )
        if self.num_processes > 1:
            host, sep, port = self.coordinator_address.rpartition(":")
            if not (sep and host and port.isdigit() and 0 < int(port) < 65536):
                raise ValueError(
                    f"learner.distributed.coordinator_address={self.coordinator_address!r} with "
                    f"num_processes={self.num_processes}; expected 'host:port' of process 0 "
                    f"(e.g. '10.0.0.1:1234'), in the config or in ${ENV['coordinator_address']}."
                )

    @property
    def multi_process(self) -> bool:
        return self.num_processes > 1


def _env_int(env: Mapping[str, str], name: str) -> int:
    value = env[name]
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"${name}={value!r}; expected an integer.") from None


def distributed_config_from(
    cfg: Mapping[str, Any] | None, *, env: Mapping[str, str] | None = None
) -> DistributedConfig:
    """DistributedConfig from `config.learner.distributed`, defaults filled from the environment.

    Args:
      cfg: the section (None or empty: everything from the environment, else one process).
        `coordinator_address` "" reads $JAX_COORDINATOR_ADDRESS, `num_processes` 0 reads
        $JAX_NUM_PROCESSES (else 1), `process_id` -1 reads $JAX_PROCESS_ID (else 0).
      env: the environment (default os.environ).

    Raises:
      ValueError: an unknown field, a malformed environment variable, or a bad value.
    """
    env = os.environ if env is None else env
    fields = dict(cfg or {})
    if not fields.get("coordinator_address"):
        fields["coordinator_address"] = env.get(ENV["coordinator_address"], "")
    if fields.get("num_processes", 0) == 0:
        name = ENV["num_processes"]
        fields["num_processes"] = _env_int(env, name) if env.get(name) else 1
    if fields.get("process_id", -1) == -1:
        name = ENV["process_id"]
        fields["process_id"] = _env_int(env, name) if env.get(name) else 0
    return from_section(DistributedConfig, fields, name="learner.distributed")


def initialize(cfg: DistributedConfig, *, recoverable: bool = False) -> None:
    """Joins this process to the learner's jax.distributed job; nothing for one process.

    Call it before any other jax work in the process (jax's rule). Calling it again with the same
    job is a no-op. `recoverable`: the job outlives a process that dies (jax's
    jax_enable_recoverability), for processes that only lend their devices to the learner now
    and then (Ray sampler replicas: rl.runtime.ray_replica).

    Raises:
      RuntimeError: jax is already initialised for a different job, or jax computations ran
        before it (the process must be restarted).
    """
    if jax.distributed.is_initialized():
        got = (jax.process_count(), jax.process_index())
        if got != (cfg.num_processes, cfg.process_id):
            raise RuntimeError(
                f"jax.distributed is already initialised as process {got[1]} of {got[0]}; "
                f"expected process {cfg.process_id} of {cfg.num_processes} "
                "(learner.distributed)."
            )
        return
    if not cfg.multi_process:
        return
    # Cross-process computations on CPU need a collectives library (jax 0.10 defaults to gloo;
    # older versions to none); on GPU and TPU the option is unused.
    if jax.config.jax_cpu_collectives_implementation is None:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if recoverable:
        jax.config.update("jax_enable_recoverability", True)
    try:
        jax.distributed.initialize(
            coordinator_address=cfg.coordinator_address,
            num_processes=cfg.num_processes,
            process_id=cfg.process_id,
            initialization_timeout=cfg.initialization_timeout_s,
        )
    except RuntimeError as e:
        raise RuntimeError(
            f"Process {cfg.process_id} of {cfg.num_processes} could not join the learner's "
            f"jax.distributed job at {cfg.coordinator_address}: {e}. Expected every process to "
            "call init_learner_group before any other jax work, and process 0 to be reachable "
            "at that address."
        ) from e


def make_learner_mesh(cfg: MeshConfig, devices: list[Any] | None = None) -> Mesh:
    """The learner mesh (fsdp, tp) over the job's devices: all of them, every process's.

    Devices are ordered by process, so `tp` groups stay inside one process (host) and `fsdp` spans
    the processes; with one process of N devices this is the mesh `make_meshes` gives a learner of
    N devices. The sampler is not here: in a multi-process job it runs in other processes.

    Args:
      cfg: `mesh.learner_devices` (0: all of the job's devices; with several processes it must be
        0 or all of them) and `mesh.learner_tp`.
      devices: the devices to use (default: jax.devices(), global).

    Raises:
      ValueError: learner_devices or learner_tp do not fit the job's devices.
    """
    devices = sorted(
        jax.devices() if devices is None else devices, key=lambda d: (d.process_index, d.id)
    )
    n = len(devices)
    processes = len({d.process_index for d in devices})
    want = cfg.learner_devices or n
    if want > n or (processes > 1 and want != n):
        raise ValueError(
            f"mesh.learner_devices={cfg.learner_devices}, but the learner's job has {n} devices "
            f"({processes} processes); expected "
            + (
                f"0 or {n} (a multi-process learner uses every device)."
                if processes > 1
                else f"<= {n}."
            )
        )
    devices = devices[:want]
    per_process = want // processes
    if want % cfg.learner_tp or (processes > 1 and per_process % cfg.learner_tp):
        raise ValueError(
            f"mesh.learner_tp={cfg.learner_tp} does not divide the learner's {want} devices"
            + (f" ({per_process} per process)" if processes > 1 else "")
            + "; expected a divisor"
            + (
                " of the devices per process (tensor parallelism stays within a host)."
                if processes > 1
                else "."
            )
        )
    return Mesh(np.array(devices).reshape(want // cfg.learner_tp, cfg.learner_tp), ("fsdp", "tp"))


def init_learner_group(config: Any) -> Mesh:
    """Initialises this learner process's group from a run config and returns the learner mesh.

    Every process of the group calls it with the same config, except `learner.distributed.
    process_id` (or $JAX_PROCESS_ID), before any other jax work.

    Args:
      config: the run's ConfigDict; reads `learner.distributed` and `mesh`.

    Returns:
      The (fsdp, tp) mesh over every device of the group (`make_learner_mesh`).
    """
    initialize(distributed_config_from(config.learner.get("distributed")))
    return make_learner_mesh(from_section(MeshConfig, config.mesh, name="mesh"))


def coordinator_address_here(host: str = "") -> str:
    """A "host:port" for process 0 to serve the job on: this host and a port free right now.

    For a launcher that starts the processes itself (e.g. Ray actors): process 0 calls it and
    passes the address to the others as `learner.distributed.coordinator_address`.

    Args:
      host: the address the other processes reach this host at; "": this host's resolved name.
    """
    host = host or socket.gethostbyname(socket.gethostname())
    with socket.socket() as s:
        s.bind(("", 0))
        return f"{host}:{s.getsockname()[1]}"


def put_global(x: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A global array from host data every process holds whole; each copies only its own shards."""
    if sharding.is_fully_addressable:
        return jax.device_put(x, sharding)
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def gather_to_host(tree: Any) -> Any:
    """The pytree as numpy arrays, whole, in every process (a collective: every process calls it).

    The publishing step of a multi-process learner: process 0 (or any) then hands the arrays to
    the sampler (a Ray object store put); with one process it is a plain device_get.
    """
    if all(x.is_fully_addressable for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)):
        return jax.tree.map(np.asarray, jax.device_get(tree))
    return jax.tree.map(np.asarray, multihost_utils.process_allgather(tree, tiled=True))
