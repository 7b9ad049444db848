"""Sampler replicas hosted in another actor, and the replica mesh a multiplexed Ray sweep shares.

`HostedReplica` is the handle of a ReplicaCore living inside another actor, behind the interface
of a SamplerReplica actor handle (`handle.method.remote(*args)` runs ReplicaCore.method there):
the learner worker's lent replicas (LearnerWorker.lend: BiDiRL borrowing) and the pipelines'
replicas on a `ReplicaHost`.

`ReplicaHost` is one sampler replica mesh of a multiplexed sweep under Ray (rl/runtime/pool.py,
launch.sweep): an actor on that mesh's devices hosting one ReplicaCore per pipeline (its own
engine, weights, loop and rewards, putting onto its own pipeline's queue actor), of which the pool
lets one serve at a time. Moving the mesh to another pipeline stops the first's loop (a fresh one,
with no weights, waits: `release`) and gives the second's core its pipeline's latest weights
(ReplicaRouter.add_replica). `pool_hosts` starts them, with Ray if this process has not, once per
pool (ReplicaPool.shared); the pool ends them.

A host runs one call at a time (Ray's default for an actor): its cores' loops run in threads of
its own, and every ReplicaCore method is safe to call while they do.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import ray

from rl.runtime.ray_cluster import actor_name, actor_repr, connect, worker_env
from rl.runtime.ray_replica import ReplicaCore


class HostedReplica:
    """A ReplicaCore inside another actor, as a SamplerReplica handle: `method.remote(*args)` runs
    `actor.<call>.remote(key, method, *args)`, and `close` runs `actor.<close>.remote(key)` (stop
    its loop and ready a fresh one: the actor keeps the core and its compiled engine)."""

    def __init__(self, actor: Any, key: Any, *, call: str = "call", close: str = "release"):
        self.actor, self.key, self._call, self._close = actor, key, call, close

    def __getattr__(self, method: str) -> Any:
        if method.startswith("_"):
            raise AttributeError(method)
        if method == "close":
            return _Remote(lambda: getattr(self.actor, self._close).remote(self.key))
        call = getattr(self.actor, self._call)
        return _Remote(lambda *args: call.remote(self.key, method, *args))


@dataclasses.dataclass(frozen=True)
class _Remote:
    call: Callable[..., Any]

    def remote(self, *args: Any) -> Any:
        return self.call(*args)


@ray.remote
class ReplicaHost:
    """One replica mesh of a multiplexed Ray sweep: a ReplicaCore per pipeline (module docstring).

    Args:
      index: the mesh's index in the pool (its name and its role in errors).
    """

    def __repr__(self) -> str:  # its role, in Ray's error messages (rl.runtime.worker_errors)
        return actor_repr(self)

    def __init__(self, index: int):
        self.index = index
        self.cores: dict[str, ReplicaCore] = {}

    def build(self, pipeline: str, payload: dict[str, Any], queue: Any) -> int:
        """Builds `pipeline`'s ReplicaCore on this host's devices (its engine compiled now),
        putting groups on `queue`; returns its slots."""
        self.cores[pipeline] = ReplicaCore(payload, queue)
        return self.cores[pipeline].num_slots()

    def call(self, pipeline: str, method: str, *args: Any) -> Any:
        """ReplicaCore `method` of `pipeline`'s core (HostedReplica's calls)."""
        return getattr(self.cores[pipeline], method)(*args)

    def release(self, pipeline: str) -> BaseException | None:
        """Stops `pipeline`'s loop and readies a fresh one (no weights, nothing queued) for when
        the mesh serves it again; returns the loop's error, if any."""
        error = self.cores[pipeline].close()
        self.cores[pipeline].renew()
        return error

    def drop(self, pipeline: str) -> None:
        """`pipeline` ended: its core goes, and with it its engine's memory."""
        core = self.cores.pop(pipeline, None)
        if core is not None:
            core.close()


def pool_hosts(config: Any, pool: Any) -> list[Any]:
    """The ReplicaHost actors of `pool` (a ReplicaPool or a Member of it), started by the first
    to ask. Ask on the thread that runs the sweep, before its pipelines start (rl.runtime.factory.
    share_pool): Ray started on a pipeline's thread ends the other pipelines' learner workers when
    that pipeline's runtime closes."""
    return pool.shared("ray_hosts", lambda: start_hosts(config, pool.replicas))


def start_hosts(config: Any, n: int) -> tuple[list[Any], Callable[[], None]]:
    """`n` ReplicaHost actors (config.ray's replica resources), Ray started first if this process
    has not; returns them and what ends them (and Ray, if this call started it). They are named
    for the sweep's root workdir (a pipeline's is <root>/<name>)."""
    owns_ray = connect(config.ray)
    env = worker_env()
    sweep = SimpleNamespace(workdir=os.path.dirname(os.path.abspath(config.workdir)))
    hosts = [
        ReplicaHost.options(
            name=actor_name(sweep, f"replica{i}"),
            num_cpus=config.ray.replica_cpus,
            num_gpus=config.ray.replica_gpus,
            runtime_env=env,
        ).remote(i)
        for i in range(n)
    ]

    def stop() -> None:
        for host in hosts:
            ray.kill(host)
        if owns_ray:
            ray.shutdown()

    return hosts, stop
