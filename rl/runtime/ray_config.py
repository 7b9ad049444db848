"""config.ray as a typed config, and the rules that tie it to the other sections (no Ray import:
a config is checked before Ray starts)."""

from __future__ import annotations

import dataclasses
from typing import Any

from rl.runtime.routing import ROUTINGS
from rl.sections import from_section

ON_REPLICA_FAILURE = ("resample", "stop")
WEIGHTS = ("auto", "transfer", "object_store")  # rl/runtime/ray_weights.py


@dataclasses.dataclass(frozen=True, kw_only=True)
class RayConfig:
    """config.ray (configs/base.py documents each field)."""

    address: str = ""  # "": start a local Ray cluster; "auto" or host:port joins one
    num_cpus: float = 0  # CPUs of a local cluster; 0: every core
    learner_workers: int = 1  # learner actors forming one jax.distributed job
    on_replica_failure: str = "resample"  # resample | stop
    learner_gpus: float = 0
    replica_gpus: float = 0
    learner_cpus: float = 0
    replica_cpus: float = 0
    migration_poll_s: float = 0.01  # seconds between the migration policy's looks
    log_to_driver: bool = False
    weights: str = "auto"  # auto | transfer | object_store (rl/runtime/ray_weights.py)

    def __post_init__(self) -> None:
        if self.on_replica_failure not in ON_REPLICA_FAILURE:
            raise ValueError(
                f"config.ray.on_replica_failure={self.on_replica_failure!r}; expected one of "
                f"{ON_REPLICA_FAILURE}."
            )
        if isinstance(self.learner_workers, bool) or not isinstance(self.learner_workers, int):
            raise ValueError(
                f"config.ray.learner_workers must be an int >= 1; received {self.learner_workers!r}."
            )
        if self.learner_workers < 1:
            raise ValueError(
                f"config.ray.learner_workers must be an int >= 1; received {self.learner_workers!r}."
            )
        for name in ("num_cpus", "learner_cpus", "replica_cpus", "learner_gpus", "replica_gpus"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"config.ray.{name} must be a number >= 0; received {value!r}.")
        if self.weights not in WEIGHTS:
            raise ValueError(f"config.ray.weights={self.weights!r}; expected one of {WEIGHTS}.")
        poll = self.migration_poll_s
        if isinstance(poll, bool) or not isinstance(poll, (int, float)) or not poll > 0:
            raise ValueError(
                f"config.ray.migration_poll_s must be a number > 0; received {poll!r}."
            )


def check_ray_config(config: Any) -> RayConfig:
    """config.ray's fields and the rules tying them to config.mesh, .elastic and .sft, with what
    was received and what is expected; returns the typed config."""
    mesh = config.mesh
    if mesh.sampler_routing not in ROUTINGS:
        raise ValueError(
            f"config.mesh.sampler_routing={mesh.sampler_routing!r}; expected one of {ROUTINGS}."
        )
    if not isinstance(mesh.sampler_replicas, int) or mesh.sampler_replicas < 1:
        raise ValueError(
            f"config.mesh.sampler_replicas must be an int >= 1; received {mesh.sampler_replicas!r}."
        )
    r = from_section(RayConfig, config.ray, name="ray")
    if config.elastic.borrowing != "off" and r.learner_workers > 1:
        raise ValueError(
            f"config.elastic.borrowing={config.elastic.borrowing!r} with config.ray."
            f"learner_workers={r.learner_workers}: borrowing pairs a one-process learner worker "
            "with the replicas (lent replicas run in it; lending replicas join its "
            "jax.distributed job); expected config.ray.learner_workers=1."
        )
    if mesh.split == "plan" and r.learner_workers > 1:
        raise ValueError(
            f"config.mesh.split='plan' with config.ray.learner_workers={r.learner_workers}: the "
            "planner sizes a one-process learner worker; expected config.ray.learner_workers=1, "
            "or mesh.split='fixed'."
        )
    if config.sft.max_steps and r.learner_workers > 1:
        raise ValueError(
            f"config.sft.max_steps={config.sft.max_steps} with config.ray.learner_workers="
            f"{r.learner_workers}: the SFT warm start runs on a one-process learner; expected "
            "config.ray.learner_workers=1, or config.sft.max_steps=0."
        )
    return r


def check_pooled(config: Any) -> None:
    """What a pipeline of a multiplexed sweep under Ray (rl.runtime.ray_host) does not run: an
    error naming it."""
    if config.elastic.migration != "off":
        raise ValueError(
            f"config.elastic.migration={config.elastic.migration!r} in a multiplexed sweep under "
            "Ray: a recalled replica drains there (migration between pipelines' replicas runs in "
            "the threads runtime); expected 'off', or config.runtime='threads'."
        )
    if config.mesh.split == "plan":
        raise ValueError(
            "config.mesh.split='plan' in a multiplexed sweep under Ray: the pool's replica "
            "meshes are fixed; expected mesh.split='fixed'."
        )
