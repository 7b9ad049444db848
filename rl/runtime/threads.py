"""The threaded runtime: one process, sampler loops in threads, the learner loop in the driver's.

    driver = threaded_driver(cfg, engine=engine, learner=learner, weight_sync=sync,
                             prompts=prompts, reward_fn=reward)
    driver = threaded_driver(cfg, engine=[engine0, engine1], ...)   # two sampler replicas

Wires sampler replicas (rl.runtime.replicas: a SamplerLoop per Engine, one thread each) and a
GroupQueue to the Driver (rl.driver), which then talks to them only through rl.runtime.protocols;
rl.runtime.ray wires replica actors to the same Driver.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from rl.admission import make_policy
from rl.driver import Driver, DriverConfig
from rl.elastic.migration import MigrationPolicy
from rl.queue import GroupQueue
from rl.runtime.replicas import ReplicaSampler
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
    engine: Engine | Sequence[Engine],
    learner: Learner,
    weight_sync: WeightSync,
    prompts: Iterator[Prompt],
    reward_fn: RewardFn,
    timeline: Timeline | None = None,
    clock: Callable[[], float] = time.monotonic,
    driver_cls: type[Driver] = Driver,
    routing: str = "round_robin",
    migration: MigrationPolicy | None = None,
    **driver_kwargs: Any,
) -> Driver:
    """A Driver over sampler replica threads (one per engine) and an in-process GroupQueue.

    Args:
      cfg: the schedule and runtime config (queue_size, admission, group_atomic, recompute_kv).
      engine: the sampler Engine, or one per replica (each on its own devices).
      driver_cls: Driver or a subclass.
      routing: request -> replica, "round_robin" or "least_loaded" (rl.runtime.routing).
      migration: a long-tail migration policy (rl.elastic.migration); default none.
      driver_kwargs: passed on to the Driver (version, rounds, barrier_every).
    """
    timeline = Timeline() if timeline is None else timeline
    queue = GroupQueue(cfg.queue_size)
    sampler = ReplicaSampler(
        [engine] if not isinstance(engine, Sequence) else engine,
        # the Driver gives the first weights (set_params) before it starts the loops
        make_admission=functools.partial(make_policy, cfg.admission),
        reward_fn=reward_fn,
        emit=queue.put,
        version=driver_kwargs.get("version", 0),
        group_atomic=cfg.group_atomic,
        recompute_kv=cfg.recompute_kv,
        routing=routing,
        migration=migration,
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
