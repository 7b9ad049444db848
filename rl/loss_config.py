"""Loss hyperparameters: the KL penalty's, and each policy loss's own options dataclass.

A policy loss registered with `register_policy_loss(name, options=cls)` (rl.losses) gets its
options from `LossConfig.options(name)`; a run sets them as config.learner.loss.<name>.<field>.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping
from typing import Any

from rl.kl import KL_ESTIMATORS
from rl.registry import Registry

# ---------------------------------------------------------------------------------------------
# Config.


def _is_real(v: object) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _check_fields(cfg: object, where: str, *, below_one=(), nonneg=(), positive=()) -> None:
    """Range checks of float fields; errors name `where.field`, the value and the range."""
    for name in below_one:
        v = getattr(cfg, name)
        if not (_is_real(v) and 0.0 <= v < 1.0):
            raise ValueError(f"{where}.{name} must be in [0, 1); received {v!r}.")
    for name in nonneg:
        v = getattr(cfg, name)
        if not (_is_real(v) and math.isfinite(v) and v >= 0.0):
            raise ValueError(f"{where}.{name} must be finite and >= 0; received {v!r}.")
    for name in positive:
        v = getattr(cfg, name)
        if not (_is_real(v) and math.isfinite(v) and v > 0.0):
            raise ValueError(f"{where}.{name} must be finite and > 0; received {v!r}.")


# Each policy loss declares its hyperparameters in its own frozen dataclass, registered with it
# (`register_policy_loss(name, options=...)`) and set from the command line as
# --config.learner.loss.<name>.<field>=...; the loss function receives that dataclass.


@dataclasses.dataclass(frozen=True, kw_only=True)
class NoOptions:
    """The options of a loss that declares none."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class PpoClipOptions:
    clip_low: float = 0.2  # ratio clipped below at 1 - clip_low
    clip_high: float = 0.28  # ratio clipped above at 1 + clip_high (DAPO clip-higher; PPO: 0.2)

    def __post_init__(self) -> None:
        _check_fields(self, "learner.loss.ppo_clip", below_one=("clip_low",), nonneg=("clip_high",))


@dataclasses.dataclass(frozen=True, kw_only=True)
class GspoOptions:
    clip_low: float = 3e-4  # sequence ratio clipped below at 1 - clip_low (GSPO paper)
    clip_high: float = 4e-4  # sequence ratio clipped above at 1 + clip_high

    def __post_init__(self) -> None:
        _check_fields(self, "learner.loss.gspo", below_one=("clip_low",), nonneg=("clip_high",))


@dataclasses.dataclass(frozen=True, kw_only=True)
class TisOptions:
    clip: float = 5.0  # importance weights truncated at this cap c (PipelineRL)

    def __post_init__(self) -> None:
        _check_fields(self, "learner.loss.tis_reinforce", positive=("clip",))


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecoupledPpoOptions:
    clip_low: float = 0.2  # proximal ratio clipped below at 1 - clip_low
    clip_high: float = 0.28  # proximal ratio clipped above at 1 + clip_high
    behav_clip: float = 5.0  # behaviour importance weight cap

    def __post_init__(self) -> None:
        _check_fields(
            self,
            "learner.loss.decoupled_ppo",
            below_one=("clip_low",),
            nonneg=("clip_high",),
            positive=("behav_clip",),
        )


# policy loss name -> its options dataclass (a registry: it reaches Ray workers, rl/registry.py)
LOSS_OPTIONS: Registry[type] = Registry("policy loss options")
BUILTIN_OPTIONS: dict[str, type] = {  # the built-in policy losses and their options
    "ppo_clip": PpoClipOptions,
    "gspo": GspoOptions,
    "tis_reinforce": TisOptions,
    "decoupled_ppo": DecoupledPpoOptions,
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class LossConfig:
    """The KL penalty, and each policy loss's own options (`options(name)`)."""

    kl_coef: float = 0.0  # weight of the per-token KL penalty to the reference; 0: off
    kl_estimator: str = "k3"  # one of KL_ESTIMATORS
    ppo_clip: PpoClipOptions = PpoClipOptions()
    gspo: GspoOptions = GspoOptions()
    tis_reinforce: TisOptions = TisOptions()
    decoupled_ppo: DecoupledPpoOptions = DecoupledPpoOptions()
    # Options of losses registered outside this module: (name, options instance) pairs.
    custom: tuple[tuple[str, object], ...] = ()

    def __post_init__(self) -> None:
        _check_fields(self, "learner.loss", nonneg=("kl_coef",))
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(
                f"learner.loss.kl_estimator must be one of {sorted(KL_ESTIMATORS)}; received "
                f"{self.kl_estimator!r}."
            )
        for name, cls in BUILTIN_OPTIONS.items():
            if not isinstance(getattr(self, name), cls):
                raise ValueError(
                    f"learner.loss.{name} must be a {cls.__name__}; received "
                    f"{getattr(self, name)!r}."
                )
        for name, opts in self.custom:
            expected = LOSS_OPTIONS.get(name, None)
            if expected is None or name in BUILTIN_OPTIONS or not isinstance(opts, expected):
                raise ValueError(
                    f"learner.loss.custom entry {name!r}: expected a policy loss registered "
                    f"outside rl.losses with its options dataclass ({expected}); received "
                    f"{type(opts).__name__}."
                )

    def options(self, name: str) -> object:
        """The options of policy loss `name`: its field here, its `custom` entry, or defaults."""
        if name in BUILTIN_OPTIONS:
            return getattr(self, name)
        custom = dict(self.custom)
        if name in custom:
            return custom[name]
        if name not in LOSS_OPTIONS and name not in LOSS_OPTIONS.unloaded:
            raise ValueError(
                f"Unknown policy loss {name!r}; expected one of {sorted(LOSS_OPTIONS)}."
            )
        return LOSS_OPTIONS.get(name)()  # one this worker could not load: a ValueError saying why


def loss_config_from(section: Mapping[str, Any]) -> LossConfig:
    """LossConfig from a `config.learner.loss` section: kl_coef, kl_estimator, and one sub-section
    per policy loss (`gspo: {clip_low: ...}`), each built into that loss's options dataclass."""
    fields: dict[str, Any] = {}
    custom = []
    for key, value in dict(section).items():
        if key in ("kl_coef", "kl_estimator"):
            fields[key] = value
        elif key in LOSS_OPTIONS:
            cls = LOSS_OPTIONS[key]
            if not hasattr(value, "keys"):
                raise ValueError(
                    f"learner.loss.{key} must be a section of {cls.__name__} fields; received "
                    f"{value!r}."
                )
            known = {f.name for f in dataclasses.fields(cls)}
            unknown = sorted(set(value.keys()) - known)
            if unknown:
                raise ValueError(
                    f"learner.loss.{key} has no field(s) {unknown}; expected some of "
                    f"{sorted(known)}."
                )
            opts = cls(**dict(value))
            if key in BUILTIN_OPTIONS:
                fields[key] = opts
            else:
                custom.append((key, opts))
        else:
            raise ValueError(
                f"learner.loss has no field {key!r}; expected kl_coef, kl_estimator or a policy "
                f"loss's options section, one of {sorted(LOSS_OPTIONS)}."
            )
    return LossConfig(**fields, custom=tuple(custom))
