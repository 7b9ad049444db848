"""One config for a schedule, shared by the threaded driver and the simulator, and the mode names.

A mode name is what the benchmarks and launch.simulate print: "sync", "cgp+<admission>+<batching>",
"sync+tail", "cgp+<admission>+tail" (tail batching; cgp batches then form in completion order),
"async+<admission>+s<max_staleness>", which may end in "+u<groups_per_update>" (an async row's own
batch per update) or "+fill" (the smallest batch per update whose staleness window keeps the
sampler's slots busy: rl.schedules.asynchronous.fill_groups_per_update).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

from rl.admission import make_policy
from rl.formation import make_former
from rl.round_planner import TailConfig
from rl.schedules.base import SCHEDULES


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScheduleConfig:
    """What a schedule needs: which mode, the policies it uses, the round and batch shape.

    rl.driver.DriverConfig adds the runtime's fields (sampling, queue size), rl.sim.SimConfig the
    simulated sampler's shape; both validate here.
    """

    prefix: ClassVar[str] = "schedule"  # how errors name the config ("driver" in DriverConfig)

    mode: str = "cgp"  # sync | cgp | async, or a name registered in rl.schedules.SCHEDULES
    admission: str = "frontier"  # a name in rl.admission.POLICIES: fcfs | frontier | shuffled
    batching: str = "ordered"  # a name in rl.formation.FORMERS: fifo | ordered (cgp)
    groups_per_round: int = 64  # R (P0 under tail batching)
    groups_per_update: int = 8  # U; S = R / U updates per round
    group_size: int = 8  # G samples per prompt
    max_staleness: int = 0  # async: the sampler runs at most this many versions ahead
    tail: TailConfig = TailConfig()  # tail batching (rl.round_planner); off: plain rounds
    epoch_size: int = 0  # prompts per epoch of the source (tail.epoch_end="flush"); 0: no epochs
    # DAPO dynamic sampling: a group whose rewards are all equal (zero advantage) is discarded and
    # a fresh prompt is drawn in its place, until the round holds R groups with reward variance or
    # it has drawn ceil(max_oversample * R) prompts (then it trains the informative ones it has).
    dynamic_sampling: bool = False
    max_oversample: float = 3.0  # dynamic sampling: prompts drawn per round <= this * R (>= 1)

    def __post_init__(self):
        if self.mode not in SCHEDULES:
            raise ValueError(
                f"{self.prefix}.mode={self.mode!r}; expected one of {tuple(SCHEDULES)}."
            )
        make_policy(self.admission)
        make_former(self.batching, 1, 1)
        if self.groups_per_update < 1 or self.groups_per_round % self.groups_per_update:
            raise ValueError(
                f"groups_per_round ({self.groups_per_round}) must be a positive multiple of "
                f"groups_per_update ({self.groups_per_update})."
            )
        if self.group_size < 1:
            raise ValueError(f"group_size must be >= 1; received {self.group_size}.")
        if self.epoch_size is None or self.epoch_size < 0:
            raise ValueError(f"epoch_size must be >= 0 (0: no epochs); received {self.epoch_size}.")
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0; received {self.max_staleness}.")
        if self.mode != "async" and self.max_staleness:
            raise ValueError(
                f"max_staleness={self.max_staleness} needs mode='async'; received mode="
                f"{self.mode!r} (sync and cgp are on-policy)."
            )
        if not isinstance(self.dynamic_sampling, bool):
            raise ValueError(
                f"{self.prefix}.dynamic_sampling must be a bool; received "
                f"{self.dynamic_sampling!r}."
            )
        if (
            isinstance(self.max_oversample, bool)
            or not isinstance(self.max_oversample, (int, float))
            or not math.isfinite(self.max_oversample)
            or self.max_oversample < 1.0
        ):
            raise ValueError(
                f"{self.prefix}.max_oversample must be a finite number >= 1 (prompts drawn per "
                f"round / groups_per_round); received {self.max_oversample!r}."
            )
        if self.dynamic_sampling and (self.mode == "async" or self.tail.enabled):
            raise ValueError(
                f"{self.prefix}.dynamic_sampling=True with mode={self.mode!r}, tail.enabled="
                f"{self.tail.enabled}; expected mode sync or cgp without tail batching (refills "
                "extend a plain round)."
            )
        if self.dynamic_sampling and self.batching not in ("fifo", "ordered"):
            raise ValueError(
                f"{self.prefix}.dynamic_sampling=True with batching={self.batching!r}; expected "
                "'fifo' or 'ordered' (refilled rounds batch their informative groups in "
                "completion or logical order)."
            )
        if self.dynamic_sampling and self.group_size < 2:
            raise ValueError(
                f"{self.prefix}.dynamic_sampling=True with group_size={self.group_size}; expected "
                "group_size >= 2 (a group of one sample never has reward variance)."
            )
        if self.mode == "async":
            if self.tail.enabled:
                raise ValueError(
                    "mode='async' with tail.enabled=True; expected tail batching off (async "
                    "draws plain rounds)."
                )
            if self.batching != "ordered":
                raise ValueError(
                    f"mode='async' with batching={self.batching!r}; expected 'ordered' (update k "
                    "trains logical groups kU..kU+U-1, which is what bounds the lag by "
                    "max_staleness)."
                )

    @property
    def updates_per_round(self) -> int:
        return self.groups_per_round // self.groups_per_update

    @property
    def name(self) -> str:
        """The mode name (see the module docstring)."""
        if self.mode == "async":
            return f"async+{self.admission}+s{self.max_staleness}"
        if self.mode == "sync":
            return "sync+tail" if self.tail.enabled else "sync"
        if self.tail.enabled and self.batching == "fifo":  # what mode_fields reads back
            return f"cgp+{self.admission}+tail"
        return f"cgp+{self.admission}+{self.batching}" + ("+tail" if self.tail.enabled else "")


FILL = "fill"  # mode_fields' groups_per_update for "+fill": resolved against the sampler's slots


def mode_fields(name: str) -> dict[str, Any]:
    """The ScheduleConfig fields a mode name sets (mode, admission, batching, max_staleness,
    tail.enabled as `tail_enabled`; an async name's "+u<N>" sets groups_per_update to N, "+fill"
    to FILL).

    Raises:
      ValueError: the name is not one of the forms in the module docstring.
    """
    parts = name.split("+")
    out: dict[str, Any] = dict(tail_enabled=False, max_staleness=0)
    if parts[-1] == "tail" and parts[0] in ("sync", "cgp"):
        out["tail_enabled"] = True
        parts = parts[:-1] + (["fifo"] if parts[0] == "cgp" else [])
    if parts == ["sync"]:
        out.update(mode="sync", admission="fcfs", batching="ordered")
    elif len(parts) == 3 and parts[0] == "cgp":
        out.update(mode="cgp", admission=parts[1], batching=parts[2])
    elif (
        len(parts) in (3, 4)
        and parts[0] == "async"
        and parts[2][:1] == "s"
        and parts[2][1:].isdigit()
        and (len(parts) == 3 or parts[3] == FILL or _is_u(parts[3]))
    ):
        out.update(
            mode="async", admission=parts[1], batching="ordered", max_staleness=int(parts[2][1:])
        )
        if len(parts) == 4:
            out["groups_per_update"] = FILL if parts[3] == FILL else int(parts[3][1:])
    else:
        raise ValueError(
            f"Mode {name!r}; expected sync, cgp+<admission>+<batching>, sync+tail, "
            "cgp+<admission>+tail or async+<admission>+s<max_staleness>[+u<N>|+fill]."
        )
    return out


def _is_u(part: str) -> bool:
    return part[:1] == "u" and part[1:].isdigit() and int(part[1:]) > 0
