"""Entry point: python -m launch.train [--config=configs/X.py[:arg]] [--config.field=value ...].

Runs `config.rounds` RL rounds through the pipelined driver (rl.run.train), writing metrics.jsonl,
TensorBoard logs and the timeline (timeline.json for Perfetto, timeline.png) to config.workdir.
`--check_model` instead builds the model and runs one forward pass and a short greedy decode.

The whole config is checked first (rl.config_check), before anything is built or written. The
console shows the progress bars, one metrics line per round and the final table; library logging
goes to workdir/run.log. A run that stops on bad input (a config field, a data file, a damaged
checkpoint, a NaN, stuck reward calls, or any error of a Ray worker, named: "sampler replica 0
(ReplicaCore.__init__) failed: ValueError: ...") prints one `launch.train: ...` line and exits 1;
its traceback is in run.log, and `--verbose` prints it (and the library logging) on the console.
"""

import functools
import os
import sys
import traceback

from absl import app, flags
from ml_collections import config_flags

import configs
from launch.cli import one_line, parse_flags, stop_on_sigterm
from rl.config_check import ConfigError, check_config
from rl.logs import log_file, quiet_console, to_file_only
from rl.models.summary import summarize
from rl.run import train
from rl.runtime.worker_errors import worker_failure

_CONFIG = config_flags.DEFINE_config_file(
    "config",
    os.path.join(os.path.dirname(configs.__file__), "default.py"),
    "Experiment config file.",
    lock_config=True,
)
_CHECK = flags.DEFINE_bool(
    "check_model", False, "Only check the model: size, forward, greedy decode."
)
_VERBOSE = flags.DEFINE_bool(
    "verbose", False, "Print library logging and the traceback of an error on the console."
)
# What stops a run with one line: bad input or a guarded failure (the message says what), and
# any error of a Ray worker (rl.runtime.worker_errors names the worker and the cause).
_STOPS = (ValueError, OSError, FloatingPointError, RuntimeError)


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    quiet_console(verbose=_VERBOSE.value)  # library logging is held back for workdir/run.log
    try:
        config = _CONFIG.value
        config.get("workdir")  # a config file that failed to load raises on first use
    except Exception as e:  # the config file is missing or raised (e.g. an unknown :arg)
        sys.exit(f"launch.train: {type(e).__name__}: {one_line(str(e))}")
    if not _CHECK.value:
        try:
            check_config(config)  # every field, before anything is built or written
        except ConfigError as e:
            sys.exit(f"launch.train: {e}")
    try:
        if _CHECK.value:
            s = summarize(config)
            name = config.model.hf_path or config.model.preset
            print(
                f"model: {name} ({s['family']}), {s['params']:,} parameters "
                f"({s['param_bytes'] / 2**20:.1f} MiB), {s['layers']} layers, d_model "
                f"{s['d_model']}, vocab {s['vocab_size']}, {s['devices']} device(s)"
            )
            print(
                f"forward: {s['prompt_tokens']} prompt tokens, mean log-prob {s['mean_logprob']:.3f}"
            )
            print(f"greedy decode: {s['greedy_continuation']!r}")
            print(f"done in {s['seconds']:.1f} s")
            return
        summary = train(config, stop=stop_on_sigterm("launch.train"))
    except Exception as e:  # bad input, a guarded failure, or a Ray worker's error: one line
        failure = worker_failure(e)  # "sampler replica 0 (ReplicaCore.__init__) failed: ..."
        if failure is None and not isinstance(e, _STOPS):
            raise  # a bug: its traceback
        to_file_only(f"launch.train stopped:\n{traceback.format_exc()}")
        if _VERBOSE.value:
            traceback.print_exc()
        where = f"traceback in {log_file()}" if log_file() else "--verbose prints the traceback"
        message = failure or str(e).strip() or type(e).__name__
        sys.exit(f"launch.train: {message} [{type(e).__name__}; {where}]")
    if summary.get("stopped_at") == 0:
        again = (
            "rerun the same command to start over"
            if config.resume
            else "rerun with --config.overwrite=True to start over"
        )
        print(
            f"stopped by SIGTERM during the SFT warm start (step {summary['sft_steps']}); nothing "
            f"is saved before round 0's checkpoint: {again}"
        )
        return
    if summary.get("stopped_at") is not None:
        print(
            f"stopped by SIGTERM after round {summary['stopped_at'] - 1} of {config.rounds}; "
            + (
                f"checkpoint {summary['stopped_at']} saved: rerun the same command to resume"
                if config.checkpoint_every
                else "config.checkpoint_every is 0: nothing saved"
            )
        )
        return
    if "mode" not in summary:  # a finished run's rerun: nothing trained, nothing evaluated
        print(
            f"nothing to run: the checkpoint in {config.workdir} is at round "
            f"{summary['first_round']} and config.rounds is {config.rounds}"
            + (f"; exported it to {summary['export_hf']}" if "export_hf" in summary else "")
        )
        return
    data = summary["data"]
    rows = [
        ("pipeline", summary["mode"]),
        ("held-out accuracy before RL", f"{summary['heldout_acc_before']:.1%}"),
        ("held-out accuracy after RL", f"{summary['heldout_acc_after']:.1%}"),
        ("SFT warm-start steps", f"{summary['sft_steps']}"),
        (
            "wall time",
            f"{summary['wall_s']:.1f} s (setup {summary['setup_s']:.1f}, SFT "
            f"{summary['sft_s']:.1f}, RL {summary['rl_s']:.1f}, eval {summary['eval_s']:.1f})",
        ),
        (
            "tokens/s",
            f"sampler {summary['sampler_tokens_per_s']:.0f}, learner "
            f"{summary['learner_tokens_per_s']:.0f}",
        ),
        (
            "reward calls scored 0",
            f"{summary['reward_errors']} errors, {summary['reward_timeouts']} timeouts (rollouts)",
        ),
        (
            "data rows",
            f"{data['train_rows']} train, {data['heldout_rows']} held-out; dropped "
            f"{data['skipped_malformed']} malformed, {data['too_long']} too long, "
            f"{data['non_numeric']} non-numeric",
        ),
    ]
    if summary["rounds"]:  # config.rounds 0: an SFT warm start only
        last = summary["rounds"][-1]
        rows.append(
            (
                "last round",
                f"reward {last['reward_mean']:.3f}, rollout-to-train-end "
                f"{last['rollout_to_train_end_s']:.2f} s, first dispatch "
                f"{last['first_dispatch_s']:.2f} s, trainer wait {last['trainer_wait_ratio']:.2f}",
            )
        )
    if summary.get("export_hf"):
        rows.append(("exported", summary["export_hf"]))
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"{k:<{width}}  {v}" for k, v in rows))
    pictures = ", ".join(summary[k] for k in ("gantt", "learning_curve") if k in summary)
    print(
        f"wrote {config.workdir}/summary.json, {summary['metrics']}, {summary['timeline']} "
        f"(Perfetto), {pictures}; library log: {log_file()}"
    )


def cli() -> None:
    """Runs main() under absl with one-line flag errors (python -m launch.train)."""
    app.run(main, flags_parser=functools.partial(parse_flags, "launch.train"))


if __name__ == "__main__":
    cli()
