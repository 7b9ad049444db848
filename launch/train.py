"""Entry point: python -m launch.train [--config=configs/X.py[:arg]] [--config.field=value ...].

Runs `config.rounds` RL rounds through the pipelined driver (rl.run.train), writing metrics.jsonl,
TensorBoard logs and the timeline (timeline.json for Perfetto, timeline.png) to config.workdir.
`--check_model` instead builds the model and runs one forward pass and a short greedy decode.
"""

import os
import sys

from absl import app, flags
from ml_collections import config_flags

import configs
from rl.models.summary import summarize
from rl.run import train

_CONFIG = config_flags.DEFINE_config_file(
    "config",
    os.path.join(os.path.dirname(configs.__file__), "default.py"),
    "Experiment config file.",
    lock_config=True,
)
_CHECK = flags.DEFINE_bool(
    "check_model", False, "Only check the model: size, forward, greedy decode."
)


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    config = _CONFIG.value
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
        summary = train(config)
    except (ValueError, FileNotFoundError) as e:  # bad config or input: the message says what
        sys.exit(f"launch.train: {e}")
    if not summary["rounds"]:
        print(
            f"nothing to run: the checkpoint in {config.workdir} is at round "
            f"{summary['first_round']} and config.rounds is {config.rounds}"
        )
        return
    last, data = summary["rounds"][-1], summary["data"]
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
        (
            "last round",
            f"reward {last['reward_mean']:.3f}, rollout-to-train-end "
            f"{last['rollout_to_train_end_s']:.2f} s, first dispatch "
            f"{last['first_dispatch_s']:.2f} s, trainer wait {last['trainer_wait_ratio']:.2f}",
        ),
    ]
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"{k:<{width}}  {v}" for k, v in rows))
    print(
        f"wrote {config.workdir}/summary.json, {summary['metrics']}, {summary['timeline']} "
        f"(Perfetto), {summary['gantt']}"
    )


if __name__ == "__main__":
    app.run(main)
