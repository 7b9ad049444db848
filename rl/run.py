"""Building a whole run from a config and running its rounds: what `python -m launch.train` calls.

from configs import smoke
summary = rl.run.train(smoke.get_config())   # also from a Colab cell
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import threading
import time
from typing import Any

import jax
import numpy as np
from absl import logging

from learner.checkpoint import NoIntactCheckpointError, saved_steps
from learner.publish import EVALUATION
from rl.compiles import round_compiles
from rl.config_check import check_config
from rl.curves import read_metrics, write_learning_curve_png
from rl.export_run import RUN_CONFIG, save_run_config
from rl.logs import flush_held_to
from rl.metrics_writer import MetricsWriter
from rl.round_planner import prompt_from_json, prompt_to_json
from rl.runtime.compose import Setup
from rl.runtime.factory import check_runtime_config, make_runtime
from rl.runtime.pool import Member
from rl.tasks.data import load_task
from rl.tracking import RUN_ID_FILE, open_tracker, tracking_config_from

# What a run writes into its workdir; a fresh run replaces them only with config.overwrite.
RESULTS = (
    "summary.json",
    "metrics.jsonl",
    "tb",
    "ckpt",
    "timeline.json",
    "timeline.png",
    "learning_curve.png",
    "hf",
    RUN_CONFIG,  # the run's config (rl/export_run.py: launch.export rebuilds the model from it)
    RUN_ID_FILE,  # config.log.wandb: the W&B run a resume continues (rl/tracking.py)
    "wandb",  # W&B's local files (without $WANDB_DIR)
)


def _prepare_workdir(config: Any) -> bool:
    """Decides whether the run resumes; a fresh run never silently replaces earlier results.

    Returns:
      True to resume from workdir/ckpt (config.resume, not config.overwrite, a checkpoint there).
      A run killed before its first checkpoint (config.resume, results but no summary.json and no
      checkpoint step) starts over: False, its metrics log and TensorBoard files removed.

    Raises:
      ValueError: a fresh run, without config.overwrite, into a workdir holding a previous run's
        results (named); nothing is changed.
    """
    workdir = config.workdir
    overwrite = config.get("overwrite", False)
    if config.resume and not overwrite and saved_steps(os.path.join(workdir, "ckpt")):
        return True
    found = [
        name
        for name in RESULTS
        if os.path.isfile(os.path.join(workdir, name))
        or (os.path.isdir(os.path.join(workdir, name)) and os.listdir(os.path.join(workdir, name)))
    ]
    if found and config.resume and not overwrite and "summary.json" not in found:
        # A run killed before its first checkpoint was written: it starts over.
        logging.warning(
            "%s holds an unfinished run with no checkpoint (it stopped before its first save "
            "finished); starting it over from round 0.",
            workdir,
        )
        found = [name for name in found if name != "ckpt"]  # its leftovers, damaged steps: kept
        overwrite = True
    if found and not overwrite:
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


def _reward_counts(stats: dict[str, int], seen: dict[str, int]) -> dict[str, float]:
    """Reward errors and timeouts since the last call (`seen` holds the totals then)."""
    out = {f"reward_{k}": float(stats[k] - seen.get(k, 0)) for k in ("errors", "timeouts")}
    seen.update(stats)
    return out


def warm_start(
    config: Any,
    sft: Any,
    learner: Any,
    heldout_accuracy: Any,
    writer: MetricsWriter,
    stop: threading.Event | None,
) -> tuple[int, bool]:
    """Supervised warm start until held-out accuracy reaches config.sft.target_accuracy.

    Args:
      sft: the runtime's SFT trainer (learner.sft.SftTrainer, or its Ray learner worker proxy);
        this loop, its progress bar and metrics are the same in both runtimes.
      learner: the runtime's learner; its params are the SFT's after each evaluation.
      stop: set (SIGTERM): the warm start ends after the step that runs (nothing is saved before
        round 0's checkpoint, so a rerun starts it over and reproduces it).

    Returns:
      The SFT steps run, and whether `stop` ended them.
    """
    done = 0
    bar = writer.progress(config.sft.max_steps, desc="sft steps")
    for done in range(1, config.sft.max_steps + 1):
        sft.step()
        bar.update(1)
        if stop is not None and stop.is_set():
            bar.close()
            return done, True
        # The last step is always evaluated: the learner ends with the SFT params.
        if done % config.sft.eval_every == 0 or done == config.sft.max_steps:
            loss = sft.loss()  # waits for the steps: their time is SFT's, not evaluation's
            sft.commit()
            acc = heldout_accuracy(learner.params)
            writer.write(done, {"loss": loss, "heldout_acc": acc}, prefix="sft")
            if acc >= config.sft.target_accuracy:
                break
    bar.close()
    return done, False


def train(
    config: Any,
    *,
    stdout: bool = True,
    stop: threading.Event | None = None,
    pool: Member | None = None,
) -> dict[str, Any]:
    """Runs `config.rounds` rounds of the configured pipeline; writes metrics and the timeline.

    `stop` (launch.train sets it on SIGTERM, a preempted pod) ends the run early at its next safe
    point: the end of the current round (`async`: of the next checkpoint barrier), where it saves
    a checkpoint (with checkpoint_every > 0) and returns with `stopped_at` set; a rerun resumes
    there. The final evaluation and the pictures are skipped. During the SFT warm start it ends
    after the running step, with `stopped_at` 0 and nothing saved (a rerun starts over).

    The components come from the composition root (rl.runtime.compose) for config.runtime:
    `threads` (one process) or `ray` (a learner worker and sampler replica actors). `pool`: the
    run is one pipeline of several sharing sampler replicas (rl.runtime.pool, launch.sweep).

    Returns:
      A summary: per-round metrics of the rounds run here, the first round run (> 0 after a resume),
      the final TrainState, wall time, and the paths written under config.workdir.
    """
    start = time.perf_counter()
    check_config(config)  # every field, before anything is built or written (rl/config_check.py)
    check_runtime_config(config)
    setup = Setup.from_config(config)
    data_cfg = setup.data
    data = load_task(data_cfg, setup.tokenizer, max_prompt_tokens=setup.max_prompt_tokens)
    resume = _prepare_workdir(config)  # the config and data are good: the workdir may change now
    flush_held_to(os.path.join(config.workdir, "run.log"))  # launch.train: library logging
    driver_cfg = setup.driver_config(config, epoch_size=len(data.train))
    # Everything the run starts (workers, threads, processes, actors, files) ends with it, when it
    # returns or raises: each is closed by `run`, newest first.
    with contextlib.ExitStack() as run:
        runtime = make_runtime(
            config, setup, total_updates=config.rounds * driver_cfg.updates_per_round, pool=pool
        )
        run.callback(runtime.close)
        return _train(config, start, setup, data, driver_cfg, runtime, resume, stdout, run, stop)


def _train(
    config: Any,
    start: float,
    setup: Setup,
    data: Any,
    driver_cfg: Any,
    runtime: Any,
    resume: bool,
    stdout: bool,
    run: contextlib.ExitStack,
    stop: threading.Event | None,
) -> dict[str, Any]:
    learner, sync = runtime.learner, runtime.weight_sync
    if getattr(runtime, "mesh_plan", None) is not None and stdout:  # config.mesh.split="plan"
        print(runtime.mesh_plan)
    prompts = setup.prompts(data.train, seed=config.seed)
    reward_seen: dict[str, int] = {}
    os.makedirs(config.workdir, exist_ok=True)
    save_run_config(config, config.workdir)  # launch.export rebuilds the model from it
    ckpt = runtime.checkpointer(os.path.join(config.workdir, "ckpt"))
    run.callback(ckpt.close)
    first_round, version, planner_state, logged, in_flight = 0, 0, None, None, []
    try:  # the newest intact checkpoint; a damaged newer one is reported and set aside
        meta = ckpt.restore(strict=config.get("resume_strict", False)) if resume else None
    except NoIntactCheckpointError as e:
        if config.get("resume_strict", False):
            raise
        logging.warning("%s The run starts over from round 0.", e)
        meta, logged = None, {}  # the metrics log is rewound to nothing
    if meta is not None:
        first_round, version = meta["round"], meta["version"]
        prompts.set_state(meta["data"])
        planner_state = meta["planner"]
        in_flight = meta.get("in_flight", [])  # async_resume="no_bubble": drawn, not trained
        logged = meta.get("metrics")  # prefix -> last step logged when the checkpoint was taken
        if first_round >= config.rounds:  # a finished run: no round to run, no result rewritten
            finished = {"rounds": [], "first_round": first_round, "state": learner.state}
            if config.export.hf:  # its final checkpoint, exported now
                finished["export_hf"] = os.path.join(config.workdir, "hf")
                runtime.export_hf(finished["export_hf"])
            return finished
    # A resumed run cuts metrics.jsonl and TensorBoard back to its checkpoint: rounds run again
    # after it get one row each.
    # config.log.wandb: every row also goes to a W&B run, finished (failed on an exception) when
    # the run ends. A resumed run continues the same W&B run, but W&B cannot delete rows: the
    # rounds the rewind removes from metrics.jsonl and TensorBoard stay there, and show twice.
    tracker = run.enter_context(
        open_tracker(
            tracking_config_from(config),
            workdir=config.workdir,
            config=config,
            resume=meta is not None,
        )
    )
    writer = run.enter_context(
        MetricsWriter(config.workdir, stdout=stdout, rewind_to=logged, tracker=tracker)
    )
    heldout = data.heldout
    phases = {"setup_s": time.perf_counter() - start, "sft_s": 0.0, "eval_s": 0.0, "rl_s": 0.0}

    pass_k = config.eval.pass_k if config.eval.pass_k > 1 else 1

    def heldout_eval(params: Any, k: int = pass_k) -> dict[str, float]:
        """{"accuracy": greedy, "pass@k": unbiased from eval.pass_n samples (eval.pass_k > 1)}."""
        jax.block_until_ready(params)  # pending training steps are not billed to evaluation
        t = time.perf_counter()
        out = runtime.evaluate(sync.publish(params, version=EVALUATION).params, heldout, k=k)
        phases["eval_s"] += time.perf_counter() - t
        return out

    def heldout_accuracy(params: Any) -> float:  # SFT's stopping rule: greedy accuracy only
        return heldout_eval(params, k=1)["accuracy"]

    sft_steps = 0
    if config.sft.max_steps and first_round == 0:
        t = time.perf_counter()
        sft_steps, stopped = warm_start(
            config, runtime.sft(data.train), learner, heldout_accuracy, writer, stop
        )
        phases["sft_s"] = time.perf_counter() - t - phases["eval_s"]
        if stopped:
            logging.warning(
                "Stopped on request during the SFT warm start (step %d); nothing saved: a rerun "
                "starts the run over.",
                sft_steps,
            )
            writer.close()
            return {
                "rounds": [],
                "first_round": 0,
                "state": learner.state,
                "stopped_at": 0,
                "sft_steps": sft_steps,
            }
    eval_before = heldout_eval(learner.params)
    acc_before = eval_before["accuracy"]
    driver = runtime.driver(
        driver_cfg,
        prompts=prompts,
        version=version,
        rounds=config.rounds,  # async plans no round past the run's last
        barrier_every=config.checkpoint_every,  # async: nothing in flight at a checkpoint...
        keep_sampling=config.get("async_resume", "exact") == "no_bubble",  # ...or recorded
    )
    run.callback(driver.close)
    if planner_state is not None:
        driver.planner.load_state_dict(planner_state)
        driver.planner.replay(map(prompt_from_json, in_flight))  # sampled again, first
    rounds = []
    # timeline.png draws rounds from `shown_from` on (timeline_rounds 0: the whole run)
    shown_from = max(first_round, config.rounds - config.timeline_rounds)
    if not config.timeline_rounds or shown_from == 0:
        shown_from = None
    gantt_since = None
    t_rl, eval_at_rl = time.perf_counter(), phases["eval_s"]
    runtime.start_compile_budget()  # from here on nothing should compile (rl/compiles.py)
    compiled = runtime.compile_stats()
    stopped_at = None
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
            counts = _reward_counts(runtime.reward_stats()[0], reward_seen)
            now = runtime.compile_stats()
            metrics = {
                "round": float(r),
                **result.metrics,
                **counts,
                **round_compiles(now, compiled),
            }
            compiled = now
            # RL time so far without evaluation: the x axis of "time to reach X% held-out"
            metrics["rl_elapsed_s"] = time.perf_counter() - t_rl - (phases["eval_s"] - eval_at_rl)
            if config.eval.every_rounds and (r + 1) % config.eval.every_rounds == 0:
                evaluated = heldout_eval(learner.params)
                metrics["heldout_acc"] = evaluated["accuracy"]
                if pass_k > 1:
                    metrics[f"heldout_pass@{pass_k}"] = evaluated[f"pass@{pass_k}"]
            writer.write(r, metrics, prefix="train")
            rounds.append(result.metrics)
            every = config.checkpoint_every
            barrier = every and ((r + 1) % every == 0 or r + 1 == config.rounds)
            # Where a stop may end the run: a checkpoint barrier (async with checkpoints), any
            # round's end (else).
            safe = barrier or driver_cfg.mode != "async" or not every
            if stop is not None and stop.is_set() and safe:
                stopped_at = r + 1
            if barrier or (every and stopped_at is not None):
                meta = {
                    "round": r + 1,
                    "version": driver.version,
                    "data": prompts.get_state(),
                    "planner": driver.planner.state_dict(),  # the long-prompt queue
                    "in_flight": [prompt_to_json(p) for p in driver.schedule.in_flight()],
                    "metrics": writer.last_steps,  # where a resume cuts the metrics log back to
                }
                ckpt.save(r + 1, meta)
            if stopped_at is not None:
                break
    finally:
        driver.close()
        ckpt.close()
    if stopped_at is not None and stopped_at < config.rounds:
        logging.warning(
            "Stopped on request after round %d of %d%s.",
            stopped_at - 1,
            config.rounds,
            f"; checkpoint {stopped_at} saved: a rerun resumes there" if every else "",
        )
        writer.close()
        return {
            "rounds": rounds,
            "first_round": first_round,
            "state": learner.state,
            "stopped_at": stopped_at,
        }
    eval_in_rl = phases["eval_s"]
    eval_after = heldout_eval(learner.params)
    acc_after = eval_after["accuracy"]
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
    export = None
    if config.export.hf:  # the final policy as a Hugging Face directory (rl/models/export.py)
        export = os.path.join(config.workdir, "hf")
        runtime.export_hf(export)
    rollout_stats, eval_stats = runtime.reward_stats()
    summary = {
        "export_hf": export,
        "heldout_acc_before": acc_before,
        "heldout_acc_after": acc_after,
        **(
            {
                f"heldout_pass@{pass_k}_before": eval_before[f"pass@{pass_k}"],
                f"heldout_pass@{pass_k}_after": eval_after[f"pass@{pass_k}"],
            }
            if pass_k > 1
            else {}
        ),
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
        "reward_errors": rollout_stats["errors"],
        "reward_timeouts": rollout_stats["timeouts"],
        "reward_stats": {"rollout": rollout_stats, "eval": eval_stats},
        "data": data.counts,  # rows used and dropped (malformed, prompt too long, non-numeric)
        # per program: compiled (at start, then after: the budget is 0), seconds compiling
        "compiles": runtime.compile_stats(),
    }
    with open(os.path.join(config.workdir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    if tracker is not None:
        tracker.log_final(summary, pictures=(gantt, curve))
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
