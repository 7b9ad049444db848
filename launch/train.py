"""Entry point: python -m launch.train [--config=configs/X.py[:arg]] [--config.field=value ...].

For now it builds the configured model and tokenizer and checks both call paths (a forward pass and
a short cached greedy decode); the RL driver takes over this entry point as it lands.
"""

import os
import sys

from absl import app
from ml_collections import config_flags

import configs
from rl.models.summary import summarize

_CONFIG = config_flags.DEFINE_config_file(
    "config",
    os.path.join(os.path.dirname(configs.__file__), "smoke.py"),
    "Experiment config file.",
    lock_config=True,
)


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    config = _CONFIG.value
    try:
        s = summarize(config)
    except (ValueError, FileNotFoundError) as e:  # bad config or input: the message says what
        sys.exit(f"launch.train: {e}")
    name = config.model.hf_path or config.model.preset
    print(
        f"model: {name} ({s['family']}), {s['params']:,} parameters "
        f"({s['param_bytes'] / 2**20:.1f} MiB), {s['layers']} layers, d_model {s['d_model']}, "
        f"vocab {s['vocab_size']}, {s['devices']} device(s)"
    )
    print(f"forward: {s['prompt_tokens']} prompt tokens, mean log-prob {s['mean_logprob']:.3f}")
    print(f"greedy decode: {s['greedy_continuation']!r}")
    print(f"done in {s['seconds']:.1f} s")


if __name__ == "__main__":
    app.run(main)
