"""Splitting the local devices into a learner mesh (fsdp, tp) and a sampler mesh (data, tp)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

SPLITS = ("fixed", "plan")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshConfig:
    learner_devices: int = 0  # 0: half of the devices (all of them when colocated)
    learner_tp: int = 1  # tensor parallelism on the learner; fsdp = learner_devices / learner_tp
    sampler_devices: int = 0  # 0: the other half (all of them when colocated)
    sampler_tp: int = 1  # tensor parallelism on the sampler; data = sampler_devices / sampler_tp
    colocated: bool = False  # both sides on the same devices, time-sliced (one GPU, Colab, CPU)
    split: str = "fixed"  # fixed: the counts above; plan: rl.elastic.planning.plan_mesh picks them

    def __post_init__(self):
        if self.split not in SPLITS:
            raise ValueError(f"mesh.split={self.split!r}; expected one of {SPLITS}.")
        for name in ("learner_devices", "learner_tp", "sampler_devices", "sampler_tp"):
            v = getattr(self, name)
            if v < 0 or (name.endswith("_tp") and v < 1):
                raise ValueError(
                    f"mesh.{name} must be >= {1 if name.endswith('_tp') else 0}; received {v}."
                )


def make_meshes(cfg: MeshConfig, devices: Sequence[Any] | None = None) -> tuple[Mesh, Mesh]:
    """Returns (learner_mesh, sampler_mesh): disjoint device sets unless `cfg.colocated`."""
    if cfg.split != "fixed":
        raise ValueError(
            f"make_meshes needs mesh.split='fixed'; received {cfg.split!r} (an open split: "
            "rl.elastic.planning.plan_mesh turns it into the fixed one first)."
        )
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices)
    if cfg.colocated:
        learner_n = cfg.learner_devices or n
        sampler_n = cfg.sampler_devices or n
        need = max(learner_n, sampler_n)
    else:
        if n < 2 and not (cfg.learner_devices or cfg.sampler_devices):
            raise ValueError(
                f"Only {n} device: the learner and sampler need disjoint devices; set "
                "mesh.colocated=True to share it."
            )
        learner_n = cfg.learner_devices or (
            n - cfg.sampler_devices if cfg.sampler_devices else n // 2
        )
        sampler_n = cfg.sampler_devices or n - learner_n
        need = learner_n + sampler_n
    if need > n or learner_n < 1 or sampler_n < 1:
        raise ValueError(
            f"Too few devices: the learner needs {learner_n} and the sampler {sampler_n} "
            f"({'shared' if cfg.colocated else 'disjoint'}), but {n} are available."
        )
    for side, count, tp in (
        ("learner", learner_n, cfg.learner_tp),
        ("sampler", sampler_n, cfg.sampler_tp),
    ):
        if count % tp:
            raise ValueError(f"mesh.{side}_tp={tp} does not divide the {side}'s {count} devices.")
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
