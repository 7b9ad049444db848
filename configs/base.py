"""Base config: every field the launchers read, with its default.

Launch:  python -m launch.train --config=configs/base.py
         python -m launch.train --config=configs/base.py:smoke   (shrunk to run on CPU in seconds)
Expect:  the model summary (parameter count, layout) and one forward pass over a prompt.
"""

import ml_collections

from rl.models.sharding import DEFAULT_RULES


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()
    config.seed = 0  # one seed for parameter init and all sampling streams
    config.workdir = "runs/base"  # logs, checkpoints, summaries

    config.model = ml_collections.ConfigDict()
    config.model.preset = "qwen3-0.6b"  # rl.models.PRESETS name; shapes only
    config.model.hf_path = ""  # local Hugging Face directory; when set it replaces the preset
    config.model.param_dtype = "bfloat16"  # parameter storage dtype: float32 | bfloat16
    config.model.dtype = "bfloat16"  # activation compute dtype: float32 | bfloat16
    config.model.remat = "full"  # per-layer rematerialisation: none | full | dots
    config.model.logits_chunk = 512  # sequence chunk for log-prob computation

    config.tokenizer = ""  # "byte" or a local tokenizer directory; default: model.hf_path

    # logical axis -> mesh axes; one table serves the learner (fsdp, tp) and sampler (data, tp) meshes
    config.sharding_rules = [list(rule) for rule in DEFAULT_RULES]

    config.prompt = "The answer to 12 + 30 is"  # text for the smoke forward pass

    if arg == "smoke":
        shrink_for_smoke(config)
    elif arg:
        raise ValueError(f"Unknown config argument {arg!r}; expected 'smoke' or nothing.")
    return config


def shrink_for_smoke(config: ml_collections.ConfigDict) -> None:
    """Shrinks any config in place to a tiny float32 model with the byte tokenizer (CPU, seconds)."""
    config.workdir = "runs/smoke"
    config.model.preset = "tiny"
    config.model.hf_path = ""
    config.model.param_dtype = "float32"
    config.model.dtype = "float32"
    config.model.remat = "none"
    config.tokenizer = "byte"
