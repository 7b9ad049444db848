"""Splitting the local devices into a learner mesh (fsdp, tp) and a sampler mesh (data, tp)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from rl.runtime.routing import ROUTINGS

SPLITS = ("fixed", "plan")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshConfig:
    learner_devices: int = 0  # 0: half of the devices (all of them when colocated)
    learner_tp: int = 1  # tensor parallelism on the learner; fsdp = learner_devices / learner_tp
    # devices of each sampler replica; 0: the other half (all of them when colocated), split
    # evenly over the replicas
    sampler_devices: int = 0
    sampler_tp: int = 1  # tensor parallelism on the sampler; data = sampler_devices / sampler_tp
    sampler_replicas: int = 1  # sampler replicas (an Engine + SamplerLoop each), disjoint devices
    sampler_routing: str = "round_robin"  # request -> replica: round_robin | least_loaded
    colocated: bool = False  # both sides on the same devices, time-sliced (one GPU, Colab, CPU)
    split: str = "fixed"  # fixed: the counts above; plan: rl.runtime.mesh_plan.plan_mesh picks them

    def __post_init__(self):

        if self.split not in SPLITS:
            raise ValueError(f"mesh.split={self.split!r}; expected one of {SPLITS}.")

        if self.sampler_routing not in ROUTINGS:
            raise ValueError(
                f"mesh.sampler_routing={self.sampler_routing!r}; expected one of {ROUTINGS}."
            )
        for name in (
            "learner_devices",
            "learner_tp",
            "sampler_devices",
            "sampler_tp",
            "sampler_replicas",
        ):
            v = getattr(self, name)
            least = 0 if name.endswith("_devices") else 1
            if not isinstance(v, int) or v < least:
                raise ValueError(f"mesh.{name} must be >= {least}; received {v!r}.")


def make_meshes(cfg: MeshConfig, devices: Sequence[Any] | None = None) -> tuple[Mesh, Mesh]:
    """Returns (learner_mesh, sampler_mesh): disjoint device sets unless `cfg.colocated`.

    The sampler mesh holds the devices of all `cfg.sampler_replicas` replicas, replica after
    replica along its data axis; `replica_meshes` splits it.
    """
    if cfg.split != "fixed":
        raise ValueError(
            f"make_meshes needs mesh.split='fixed'; received {cfg.split!r} (an open split: "
            "rl.runtime.mesh_plan.plan_mesh turns it into the fixed one first)."
        )
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices)
    per = cfg.sampler_devices * cfg.sampler_replicas  # 0: not set
    if cfg.colocated:
        learner_n = cfg.learner_devices or n
        sampler_n = per or n
        need = max(learner_n, sampler_n)
    else:
        if n < 2 and not (cfg.learner_devices or cfg.sampler_devices):
            raise ValueError(
                f"Only {n} device: the learner and sampler need disjoint devices; set "
                "mesh.colocated=True to share it."
            )
        learner_n = cfg.learner_devices or (n - per if per else n // 2)
        sampler_n = per or n - learner_n
        need = learner_n + sampler_n
    if need > n or learner_n < 1 or sampler_n < 1:
        raise ValueError(
            f"Too few devices: the learner needs {learner_n} and the sampler {sampler_n} "
            f"({'shared' if cfg.colocated else 'disjoint'}), but {n} are available."
        )
    if sampler_n % cfg.sampler_replicas:
        raise ValueError(
            f"mesh.sampler_replicas={cfg.sampler_replicas} does not divide the sampler's "
            f"{sampler_n} devices; expected each replica to get as many."
        )
    for side, count, tp in (
        ("learner", learner_n, cfg.learner_tp),
        ("sampler", sampler_n // cfg.sampler_replicas, cfg.sampler_tp),
    ):
        if count % tp:
            each = " (per replica)" if side == "sampler" and cfg.sampler_replicas > 1 else ""
            raise ValueError(
                f"mesh.{side}_tp={tp} does not divide the {side}'s {count} devices{each}."
            )
    learner = devices[:learner_n]
    sampler = devices[:sampler_n] if cfg.colocated else devices[learner_n : learner_n + sampler_n]
    return (
        Mesh(
            np.array(learner).reshape(learner_n // cfg.learner_tp, cfg.learner_tp), ("fsdp", "tp")
        ),
        Mesh(
            np.array(sampler).reshape(sampler_n // cfg.sampler_tp, cfg.sampler_tp), ("data", "tp")
        ),
    )


def replica_meshes(sampler_mesh: Mesh, replicas: int) -> list[Mesh]:
    """The sampler mesh cut into `replicas` meshes (data, tp) over disjoint devices, in order."""
    data = sampler_mesh.shape["data"]
    if replicas < 1 or data % replicas:
        raise ValueError(
            f"{replicas} sampler replicas do not divide the sampler mesh's data axis ({data})."
        )
    per = data // replicas
    return [
        Mesh(sampler_mesh.devices[i * per : (i + 1) * per], sampler_mesh.axis_names)
        for i in range(replicas)
    ]


def lent_meshes(devices: Sequence[Any], per: int, tp: int) -> list[Mesh]:
    """Sampler meshes (data, tp) of `per` devices each over `devices` (the learner's, lent to the
    sampler), as many as fit, in order."""
    if per < 1 or per % tp:
        raise ValueError(f"Lent replicas of {per} devices each: expected a multiple of tp={tp}.")
    return [
        Mesh(np.array(devices[i : i + per]).reshape(per // tp, tp), ("data", "tp"))
        for i in range(0, len(devices) - per + 1, per)
    ]
