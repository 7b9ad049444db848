"""Building a whole run from a config and running its rounds: what `python -m launch.train` calls.

from configs import smoke
summary = rl.run.train(smoke.get_config())   # also from a Colab cell
"""

from __future__ import annotations

import json
import os
import shutil
import time
from typing import Any

import jax
import numpy as np

from rl.config_check import check_config
from rl.curves import read_metrics, write_learning_curve_png
from rl.driver import Driver, driver_config_from
from rl.evaluate import evaluate
from rl.logs import flush_held_to
from rl.metrics import MetricsWriter
from rl.models.build import build_model
from rl.models.sharding import normalize_rules
from rl.models.summary import tokenizer_from
from rl.rewards import RewardRunner, get_reward
from rl.tasks.data import DataConfig, data_config_from, load_task
from rl.tasks.pipeline import prompt_dataset
from rl.types import SamplingParams

# What a run writes into its workdir; a fresh run replaces them only with config.overwrite.
RESULTS = (
    "summary.json",
    "metrics.jsonl",
    "tb",
    "ckpt",
    "timeline.json",
    "timeline.png",
    "learning_curve.png",
)


def _prepare_workdir(config: Any) -> bool:
    """Decides whether the run resumes; a fresh run never silently replaces earlier results.

    Returns:
      True to resume from workdir/ckpt (config.resume, not config.overwrite, a checkpoint there).

    Raises:
      ValueError: a fresh run, without config.overwrite, into a workdir holding a previous run's
        results (named); nothing is changed.
    """
    from learner.checkpoint import saved_steps

    workdir = config.workdir
    if config.resume and not config.get("overwrite", False):
        if saved_steps(os.path.join(workdir, "ckpt")):
            return True
    found = [
        name
        for name in RESULTS
        if os.path.isfile(os.path.join(workdir, name))
        or (os.path.isdir(os.path.join(workdir, name)) and os.listdir(os.path.join(workdir, name)))
    ]
    if found and not config.get("overwrite", False):
        why = "no checkpoint to resume from" if config.resume else "config.resume is False"
        raise ValueError(
            f"{workdir} holds a previous run's results ({', '.join(found)}) and {why}; expected "
            "an empty workdir: pass --config.overwrite=True to replace them, or another "
            "--config.workdir."
        )
    for name in found:  # overwrite: a fresh run starts from an empty workdir
        path = os.path.join(workdir, name)
        shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    return False


def _reward_counts(runner: RewardRunner, seen: dict[str, int]) -> dict[str, float]:
    """Reward errors and timeouts since the last call (`seen` holds the totals then)."""
    stats = runner.stats()
    out = {f"reward_{k}": float(stats[k] - seen.get(k, 0)) for k in ("errors", "timeouts")}
    seen.update(stats)
    return out


def _sft(
    config: Any,
    learner: Any,
    tokenizer: Any,
    heldout_accuracy: Any,
    writer: MetricsWriter,
    records: list[dict[str, Any]],
    data: DataConfig,
) -> int:
    """Supervised warm start until held-out accuracy reaches config.sft.target_accuracy."""
    from learner.config import OptimizerConfig
    from learner.sft import make_sft_step, sft_batches
    from learner.state import create_train_state, make_optimizer

    if len(records) < config.sft.batch_size:
        raise ValueError(
            f"config.sft.batch_size={config.sft.batch_size} exceeds the {len(records)} training "
            "records; expected a smaller batch or config.sft.max_steps=0."
        )
    tx = make_optimizer(OptimizerConfig(lr=config.sft.lr, warmup_steps=config.sft.warmup_steps))
    state, shardings = create_train_state(
        learner.params, tx, seed=config.seed, mesh=learner.mesh, rules=learner.rules
    )
    step = make_sft_step(learner.graphdef, tx, shardings)
    batches = sft_batches(
        records,
        tokenizer,
        batch_size=config.sft.batch_size,
        seed=config.seed,
        min_length_bucket=config.learner.min_length_bucket,  # rows padded as in RL, not to 32
        **data.prompt_kwargs,
    )
    done = 0
    bar = writer.progress(config.sft.max_steps, desc="sft steps")
    for done in range(1, config.sft.max_steps + 1):
        state, metrics = step(state, next(batches))
        bar.update(1)
        if done % config.sft.eval_every == 0 or done == config.sft.max_steps:
            acc = heldout_accuracy(state.params)
            writer.write(done, {"loss": float(metrics["loss"]), "heldout_acc": acc}, prefix="sft")
            if acc >= config.sft.target_accuracy:
                break
    bar.close()
    learner.set_params(state.params)
    return done


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
    check_config(config)  # every field, before anything is built or written (rl/config_check.py)
    data_cfg = data_config_from(config)
    rules = normalize_rules(config.sharding_rules)
    learner_mesh, sampler_mesh = make_meshes(MeshConfig(**config.mesh))
    tokenizer = tokenizer_from(config)
    # Prompts the engine could not take (prefill limit, or no room for the response) are dropped.
    max_prompt = config.engine.max_length - config.sampling.max_new_tokens
    data = load_task(
        data_cfg,
        tokenizer,
        max_prompt_tokens=max(1, min(config.engine.max_prefill_length, max_prompt)),
    )
    resume = _prepare_workdir(config)  # the config and data are good: the workdir may change now
    flush_held_to(os.path.join(config.workdir, "run.log"))  # launch.train: library logging
    # Local HF weights (config.model.hf_path) or a fresh init, placed directly on the learner mesh.
    model = build_model(config.model, seed=config.seed, mesh=learner_mesh, rules=rules)
    if tokenizer.vocab_size > model.config.vocab_size:
        raise ValueError(
            f"The tokenizer's vocabulary ({tokenizer.vocab_size}) is larger than the model's "
            f"vocab_size ({model.config.vocab_size}); expected a tokenizer of the same model."
        )
    sampling = SamplingParams(**config.sampling, stop_token_ids=(tokenizer.eos_id,))
    driver_cfg = driver_config_from(config.driver, sampling=sampling, epoch_size=len(data.train))
    # A cosine schedule with total_steps 0 decays over the run; a run of no rounds (SFT only)
    # makes no RL update, so any valid horizon does.
    total_updates = config.rounds * driver_cfg.updates_per_round
    learner_cfg = learner_config_from(
        config.learner,
        total_updates=total_updates or config.learner.optimizer.warmup_steps + 1,
    )
    if learner_cfg.temperature != config.sampling.temperature and config.sampling.temperature > 0:
        raise ValueError(
            f"learner.temperature ({learner_cfg.temperature}) must equal sampling.temperature "
            f"({config.sampling.temperature}): the loss recomputes the sampler's log-probs."
        )
    learner = Learner(model, learner_cfg, mesh=learner_mesh, rules=rules, seed=config.seed)
    engine = Engine(
        model, EngineConfig(**config.engine, seed=config.seed), mesh=sampler_mesh, rules=rules
    )
    # Colocated with the same sharding and dtype, publishing shares the learner's arrays (no copy).
    sync = DevicePutSync(
        learner.params,
        sampler_mesh,
        dtype=config.sampler_dtype,
        rules=rules,
        share_with=learner,
    )
    prompts = iter(
        prompt_dataset(data.train, tokenizer, seed=config.seed, **data_cfg.prompt_kwargs)
    )
    # Rollouts and evaluation get their own runners, so each counts its own errors and timeouts.
    reward, eval_reward = (
        RewardRunner(
            get_reward(config.task.reward),
            decode=tokenizer.decode,
            timeout_s=config.task.reward_timeout_s,
        )
        for _ in range(2)
    )
    reward_seen: dict[str, int] = {}
    os.makedirs(config.workdir, exist_ok=True)
    ckpt = Checkpointer(os.path.join(config.workdir, "ckpt"))
    first_round, version, planner_state, logged = 0, 0, None, None
    if resume:  # the newest intact checkpoint; a damaged newer one is reported and set aside
        learner.state, meta = ckpt.restore(
            abstract_state=learner.state,
            shardings=learner.shardings,
            strict=config.get("resume_strict", False),
        )
        first_round, version = meta["round"], meta["version"]
        prompts.set_state(meta["data"])
        planner_state = meta["planner"]
        logged = meta.get("metrics")  # prefix -> last step logged when the checkpoint was taken
        if first_round >= config.rounds:  # a finished run: nothing to run, nothing rewritten
            ckpt.close()
            reward.close()
            eval_reward.close()
            return {"rounds": [], "first_round": first_round, "state": learner.state}
    # A resumed run cuts metrics.jsonl and TensorBoard back to its checkpoint: rounds run again
    # after it get one row each.
    writer = MetricsWriter(config.workdir, stdout=stdout, rewind_to=logged)
    heldout = data.heldout
    phases = {"setup_s": time.perf_counter() - start, "sft_s": 0.0, "eval_s": 0.0, "rl_s": 0.0}

    def heldout_accuracy(params: Any) -> float:
        jax.block_until_ready(params)  # pending training steps are not billed to evaluation
        t = time.perf_counter()
        published = sync.publish(params, version=-1).params
        acc = evaluate(
            engine,
            published,
            heldout,
            tokenizer,
            eval_reward,
            max_new_tokens=config.sampling.max_new_tokens,
            **data_cfg.prompt_kwargs,
        )["accuracy"]
        phases["eval_s"] += time.perf_counter() - t
        return acc

    sft_steps = 0
    if config.sft.max_steps and first_round == 0:
        t = time.perf_counter()
        sft_steps = _sft(config, learner, tokenizer, heldout_accuracy, writer, data.train, data_cfg)
        phases["sft_s"] = time.perf_counter() - t - phases["eval_s"]
    acc_before = heldout_accuracy(learner.params)
    driver = Driver(
        driver_cfg,
        engine=engine,
        learner=learner,
        weight_sync=sync,
        prompts=prompts,
        reward_fn=reward,
        version=version,
        rounds=config.rounds,  # async plans no round past the run's last
        barrier_every=config.checkpoint_every,  # async: nothing in flight at a checkpoint
    )
    if planner_state is not None:
        driver.planner.load_state_dict(planner_state)
    rounds = []
    # timeline.png draws rounds from `shown_from` on (timeline_rounds 0: the whole run)
    shown_from = max(first_round, config.rounds - config.timeline_rounds)
    if not config.timeline_rounds or shown_from == 0:
        shown_from = None
    gantt_since = None
    t_rl, eval_at_rl = time.perf_counter(), phases["eval_s"]
    try:
        for r in range(first_round, config.rounds):
            if r == shown_from:
                gantt_since = driver.clock()
            bar = writer.progress(driver_cfg.groups_per_round, desc=f"round {r} groups")
            driver.on_group = lambda group, bar=bar: bar.update(1)
            try:
                result = driver.run_round(r)
            finally:
                bar.close()
            metrics = {"round": float(r), **result.metrics, **_reward_counts(reward, reward_seen)}
            # RL time so far without evaluation: the x axis of "time to reach X% held-out"
            metrics["rl_elapsed_s"] = time.perf_counter() - t_rl - (phases["eval_s"] - eval_at_rl)
            if config.eval.every_rounds and (r + 1) % config.eval.every_rounds == 0:
                metrics["heldout_acc"] = heldout_accuracy(learner.params)
            writer.write(r, metrics, prefix="train")
            rounds.append(result.metrics)
            if config.checkpoint_every and (
                (r + 1) % config.checkpoint_every == 0 or r + 1 == config.rounds
            ):
                meta = {
                    "round": r + 1,
                    "version": driver.version,
                    "data": prompts.get_state(),
                    "planner": driver.planner.state_dict(),  # the long-prompt queue
                    "metrics": writer.last_steps,  # where a resume cuts the metrics log back to
                }
                ckpt.save(r + 1, learner.state, meta)
    finally:
        driver.close()
        ckpt.close()
    eval_in_rl = phases["eval_s"]
    acc_after = heldout_accuracy(learner.params)
    reward.close()
    eval_reward.close()
    writer.close()
    phases["rl_s"] = time.perf_counter() - t_rl - (phases["eval_s"] - eval_in_rl)
    trace = os.path.join(config.workdir, "timeline.json")
    gantt = os.path.join(config.workdir, "timeline.png")
    driver.timeline.write_chrome_trace(trace)
    gantt_title = f"{driver_cfg.name}: {config.rounds} rounds"
    if gantt_since is not None:
        gantt_title = (
            f"{driver_cfg.name}: the last {config.rounds - shown_from} of {config.rounds} rounds"
        )
    driver.timeline.write_gantt_png(gantt, title=gantt_title, since=gantt_since)
    curve = os.path.join(config.workdir, "learning_curve.png")
    write_learning_curve_png(
        curve,
        read_metrics(os.path.join(config.workdir, "metrics.jsonl")),
        before=acc_before,
        after=acc_after,
        first_round=first_round,
        rounds=config.rounds,
        title=f"{config.task.name}, {driver_cfg.name}: held-out {acc_before:.1%} -> {acc_after:.1%}",
    )
    summary = {
        "heldout_acc_before": acc_before,
        "heldout_acc_after": acc_after,
        "sft_steps": sft_steps,
        "wall_s": time.perf_counter() - start,
        **phases,
        "sampler_tokens_per_s": float(np.mean([m["sampler_tokens_per_s"] for m in rounds]))
        if rounds
        else 0.0,
        "learner_tokens_per_s": float(np.mean([m["learner_tokens_per_s"] for m in rounds]))
        if rounds
        else 0.0,
        # Rollout reward calls that raised (or returned no finite number) or timed out: scored 0.
        "reward_errors": reward.errors,
        "reward_timeouts": reward.timeouts,
        "reward_stats": {"rollout": reward.stats(), "eval": eval_reward.stats()},
        "data": data.counts,  # rows used and dropped (malformed, prompt too long, non-numeric)
    }
    with open(os.path.join(config.workdir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    return {
        **summary,
        "rounds": rounds,
        "first_round": first_round,
        "state": learner.state,
        "mode": driver_cfg.name,
        "timeline": trace,
        "gantt": gantt,
        "learning_curve": curve,
        "metrics": os.path.join(config.workdir, "metrics.jsonl"),
    }
