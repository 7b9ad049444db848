"""The threaded runtime: one process, the sampler loop in a thread, the learner loop in the driver's.

    driver = threaded_driver(cfg, engine=engine, learner=learner, weight_sync=sync,
                             prompts=prompts, reward_fn=reward)

Wires a SamplerLoop and a GroupQueue to the Driver (rl.driver), which then talks to them only
through rl.runtime.protocols; rl.runtime.ray wires replica actors to the same Driver.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from rl.admission import make_policy
from rl.driver import Driver, DriverConfig
from rl.queue import GroupQueue
from rl.timeline import Timeline
from rl.types import Prompt

if TYPE_CHECKING:
    from learner.learner import Learner
    from learner.publish import WeightSync
    from sampler.engine import Engine
    from sampler.loop import RewardFn


def threaded_driver(
    cfg: DriverConfig,
    *,
    engine: Engine,
    learner: Learner,
    weight_sync: WeightSync,
    prompts: Iterator[Prompt],
    reward_fn: RewardFn,
    timeline: Timeline | None = None,
    clock: Callable[[], float] = time.monotonic,
    driver_cls: type[Driver] = Driver,
    **driver_kwargs: Any,
) -> Driver:
    """A Driver over a SamplerLoop thread on `engine` and an in-process GroupQueue.

    Args:
      cfg: the schedule and runtime config (queue_size, admission, group_atomic, recompute_kv).
      driver_cls: Driver or a subclass.
      driver_kwargs: passed on to the Driver (version, rounds, barrier_every).
    """
    from sampler.loop import SamplerLoop

    timeline = Timeline() if timeline is None else timeline
    queue = GroupQueue(cfg.queue_size)
    sampler = SamplerLoop(
        engine,
        None,  # the Driver gives the first weights (set_params) before it starts the loop
        admission=make_policy(cfg.admission),
        reward_fn=reward_fn,
        emit=queue.put,
        version=driver_kwargs.get("version", 0),
        group_atomic=cfg.group_atomic,
        recompute_kv=cfg.recompute_kv,
        timeline=timeline,
        clock=clock,
    )
    return driver_cls(
        cfg,
        sampler=sampler,
        queue=queue,
        learner=learner,
        weight_sync=weight_sync,
        prompts=prompts,
        timeline=timeline,
        clock=clock,
        **driver_kwargs,
    )
