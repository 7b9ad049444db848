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
from rl.rewards import RewardRunner, get_reward
from rl.tasks.pipeline import prompt_dataset
from rl.tasks.synthetic import addition_records, countdown_records
from rl.types import SamplingParams

TASKS = ("addition", "countdown")


def _records(task: Any, seed: int) -> list[dict[str, Any]]:
    if task.name == "addition":
        return addition_records(task.train_size, digits=task.digits, seed=seed, split="train")
    return countdown_records(task.train_size, seed=seed, split="train")


def train(config: Any, *, stdout: bool = True) -> dict[str, Any]:
    """Runs `config.rounds` rounds of the configured pipeline; writes metrics and the timeline.

    Returns:
      A summary: per-round metrics of the rounds run here, the first round run (> 0 after a resume),
      the final TrainState, wall time, and the paths written under config.workdir.
    """
    from learner.checkpoint import Checkpointer
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
    prompts = iter(prompt_dataset(_records(config.task, config.seed), tokenizer, seed=config.seed))
    reward = RewardRunner(
        get_reward(config.task.reward),
        decode=tokenizer.decode,
        timeout_s=config.task.reward_timeout_s,
    )
    os.makedirs(config.workdir, exist_ok=True)
    ckpt = Checkpointer(os.path.join(config.workdir, "ckpt"))
    first_round, version = 0, 0
    if config.resume and ckpt.latest_step() is not None:
        learner.state, meta = ckpt.restore(
            abstract_state=learner.state, shardings=learner.shardings
        )
        first_round, version = meta["round"], meta["version"]
        prompts.set_state(meta["data"])
    driver = Driver(
        driver_cfg,
        engine=engine,
        learner=learner,
        weight_sync=sync,
        prompts=prompts,
        reward_fn=reward,
        version=version,
    )
    writer = MetricsWriter(config.workdir, stdout=stdout)
    rounds = []
    try:
        for r in range(first_round, config.rounds):
            bar = writer.progress(driver_cfg.groups_per_round, desc=f"round {r} groups")
            driver.on_group = lambda group, bar=bar: bar.update(1)
            try:
                result = driver.run_round(r)
            finally:
                bar.close()
            writer.write(r, {"round": float(r), **result.metrics}, prefix="train")
            rounds.append(result.metrics)
            if config.checkpoint_every and (
                (r + 1) % config.checkpoint_every == 0 or r + 1 == config.rounds
            ):
                meta = {"round": r + 1, "version": driver.version, "data": prompts.get_state()}
                ckpt.save(r + 1, learner.state, meta)
    finally:
        driver.close()
        writer.close()
        ckpt.close()
        reward.close()
    trace = os.path.join(config.workdir, "timeline.json")
    gantt = os.path.join(config.workdir, "timeline.png")
    driver.timeline.write_chrome_trace(trace)
    driver.timeline.write_gantt_png(gantt, title=f"{driver_cfg.name}: {config.rounds} rounds")
    return {
        "rounds": rounds,
        "first_round": first_round,
        "state": learner.state,
        "mode": driver_cfg.name,
        "wall_s": time.perf_counter() - start,
        "timeline": trace,
        "gantt": gantt,
        "metrics": os.path.join(config.workdir, "metrics.jsonl"),
    }
