"""Schedules: one pure, clock-free object per mode, driven by every runtime (rl.driver's threads,
rl.sim's virtual clock) and used by the device planner (rl.device_split).

    schedule = make_schedule(cfg, planner=..., requests_of=...)
    actions = schedule.begin(0)            # then on_group / on_update_done / on_published

`SCHEDULES` is the registry (sync, cgp, async); a user adds one with
`@SCHEDULES.register("name")` on a class with the rl.schedules.base.Schedule methods.
"""

from rl.schedules import synchronous  # noqa: I001, F401 (registers sync and cgp, then async)
from rl.schedules import asynchronous  # noqa: F401
from rl.schedules.base import (
    SCHEDULES,
    Action,
    Add,
    Begin,
    Publish,
    RoundDone,
    Schedule,
    StageTimes,
    Submit,
    Update,
    make_schedule,
)
from rl.schedules.config import ScheduleConfig, mode_fields

MODES = tuple(SCHEDULES)  # the built-in mode names: sync, cgp, async (the one list)

__all__ = [
    "MODES",
    "SCHEDULES",
    "Action",
    "Add",
    "Begin",
    "Publish",
    "RoundDone",
    "Schedule",
    "ScheduleConfig",
    "StageTimes",
    "Submit",
    "Update",
    "make_schedule",
    "mode_fields",
]
