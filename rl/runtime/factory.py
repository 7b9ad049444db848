"""The runtime config.runtime names, and a driver over it for benchmarks and tests.

runtime = make_runtime(config, setup, total_updates=...)  # ThreadsRuntime or RayRuntime
runtime, driver = build_driver(config, rounds=3)  # no workdir, logs or checkpoints
"""

from __future__ import annotations

from typing import Any

from rl.driver import Driver
from rl.runtime.compose import Setup
from rl.runtime.pool import Member, ReplicaPool
from rl.runtime.ray_config import check_ray_config
from rl.runtime.threads import ThreadsRuntime
from rl.tasks.data import load_task

RUNTIMES = ("threads", "ray")  # config.runtime


def check_runtime_config(config: Any) -> None:
    """config.runtime and, with "ray", config.ray: a clear error before anything starts."""
    runtime = config.get("runtime", "threads")
    if runtime not in RUNTIMES:
        raise ValueError(f"config.runtime={runtime!r}; expected one of {RUNTIMES}.")
    if runtime == "ray":
        check_ray_config(config)


def runtime_class(config: Any) -> type:
    """The runtime class config.runtime names: ThreadsRuntime or
    rl.runtime.ray_runtime.RayRuntime."""
    if config.get("runtime", "threads") == "ray":
        from rl.runtime.ray_runtime import RayRuntime  # Ray is imported only to use it

        return RayRuntime
    return ThreadsRuntime


def make_runtime(
    config: Any, setup: Setup, *, total_updates: int, pool: Member | None = None
) -> Any:
    """The runtime config.runtime names (`runtime_class`), built.

    Args:
      pool: this pipeline's place in a pool of replicas several pipelines share
        (rl.runtime.pool; launch.sweep); None: the run has its devices alone.
    """
    return runtime_class(config)(config, setup, total_updates=total_updates, pool=pool)


def share_pool(config: Any, pool: ReplicaPool) -> None:
    """Starts what the pipelines of `pool` share, on this thread, before they start: under Ray
    the replica host actors (RayRuntime.share_pool; Ray started here if it is not), nothing in
    threads."""
    if config.get("runtime", "threads") == "ray":
        runtime_class(config).share_pool(config, pool)


def build_driver(config: Any, *, rounds: int) -> tuple[Any, Driver]:
    """A runtime and its Driver for `rounds` rounds from the start of the config's data (no
    workdir, logging or checkpoints: what benchmarks and tests drive). Close the driver, then
    the runtime."""
    check_runtime_config(config)
    setup = Setup.from_config(config)
    data = load_task(setup.data, setup.tokenizer, max_prompt_tokens=setup.max_prompt_tokens)
    driver_cfg = setup.driver_config(config, epoch_size=len(data.train))
    runtime = make_runtime(config, setup, total_updates=rounds * driver_cfg.updates_per_round)
    try:
        prompts = setup.prompts(data.train, seed=config.seed)
        return runtime, runtime.driver(driver_cfg, prompts=prompts, rounds=rounds)
    except BaseException:
        runtime.close()
        raise
