"""Building a whole run from a config and running its rounds: what `python -m launch.train` calls.

from configs import smoke
summary = rl.run.train(smoke.get_config())   # also from a Colab cell
"""

from __future__ import annotations

import os
import time
from typing import Any

from rl.driver import Driver, DriverConfig
from rl.metrics import MetricsWriter
from rl.models.build import build_model
from rl.models.sharding import normalize_rules
from rl.models.summary import tokenizer_from
from rl.tasks.addition import AdditionTask, make_reward
from rl.types import SamplingParams

TASKS = ("addition",)


def train(config: Any, *, stdout: bool = True) -> dict[str, Any]:
    """Runs `config.rounds` rounds of the configured pipeline; writes metrics and the timeline.

    Returns:
      A summary: per-round metrics, wall time, and the paths written under config.workdir.
    """
    from learner.config import learner_config_from
    from learner.learner import Learner
    from learner.mesh import MeshConfig, make_meshes
    from learner.publish import DevicePutSync
    from sampler.engine import Engine, EngineConfig

    start = time.perf_counter()
    if config.task.name not in TASKS:
        raise ValueError(f"config.task.name={config.task.name!r}; expected one of {TASKS}.")
    rules = normalize_rules(config.sharding_rules)
    learner_mesh, sampler_mesh = make_meshes(MeshConfig(**config.mesh))
    tokenizer = tokenizer_from(config)
    model = build_model(config.model, seed=config.seed)
    learner_cfg = learner_config_from(config.learner)
    if learner_cfg.temperature != config.sampling.temperature and config.sampling.temperature > 0:
        raise ValueError(
            f"learner.temperature ({learner_cfg.temperature}) must equal sampling.temperature "
            f"({config.sampling.temperature}): the loss recomputes the sampler's log-probs."
        )
    learner = Learner(model, learner_cfg, mesh=learner_mesh, rules=rules, seed=config.seed)
    engine = Engine(
        model, EngineConfig(**config.engine, seed=config.seed), mesh=sampler_mesh, rules=rules
    )
    sync = DevicePutSync(learner.params, sampler_mesh, dtype=config.sampler_dtype, rules=rules)
    sampling = SamplingParams(**config.sampling, stop_token_ids=(tokenizer.eos_id,))
    driver_cfg = DriverConfig(**config.driver, sampling=sampling)
    task = AdditionTask(digits=config.task.digits, seed=config.seed)
    driver = Driver(
        driver_cfg,
        engine=engine,
        learner=learner,
        weight_sync=sync,
        prompts=task.prompts(tokenizer),
        reward_fn=make_reward(tokenizer),
    )
    os.makedirs(config.workdir, exist_ok=True)
    writer = MetricsWriter(config.workdir, stdout=stdout)
    rounds = []
    try:
        for r in range(config.rounds):
            result = driver.run_round(r)
            writer.write(r, {"round": float(r), **result.metrics}, prefix="train")
            rounds.append(result.metrics)
    finally:
        driver.close()
        writer.close()
    trace = os.path.join(config.workdir, "timeline.json")
    gantt = os.path.join(config.workdir, "timeline.png")
    driver.timeline.write_chrome_trace(trace)
    driver.timeline.write_gantt_png(gantt, title=f"{driver_cfg.name}: {config.rounds} rounds")
    return {
        "rounds": rounds,
        "mode": driver_cfg.name,
        "wall_s": time.perf_counter() - start,
        "timeline": trace,
        "gantt": gantt,
        "metrics": os.path.join(config.workdir, "metrics.jsonl"),
    }
