"""Export a trained policy as a Hugging Face directory that transformers loads.

    export_hf(model, "runs/x/hf", tokenizer=tok, tokenizer_dir="/models/Qwen3-0.6B")

Weights and config.json come from `save_hf` (rl.models.hf_io); the tokenizer's files are copied
when the run loaded a Hugging Face tokenizer directory (the byte tokenizer has no files, and
transformers has no loader for it). `rl.run.train` calls this with config.export.hf_dir.
"""

from __future__ import annotations

import os
import shutil

from rl.models.hf_io import save_hf
from rl.models.tokenizer import Tokenizer
from rl.models.transformer import Transformer

# What transformers.AutoTokenizer reads from a directory (those present are copied).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)


def export_hf(
    model: Transformer,
    path: str,
    *,
    tokenizer: Tokenizer | None = None,
    tokenizer_dir: str | None = None,
    dtype: str | None = None,
) -> list[str]:
    """Writes `model` (config.json, safetensors) and the tokenizer's files into `path`.

    Args:
      model: the policy (its params may be sharded; every process must call this).
      path: the output directory (created; files of the same names are replaced).
      tokenizer: its bos/eos/pad ids go into config.json when given.
      tokenizer_dir: a Hugging Face tokenizer directory whose files are copied (None: none).
      dtype: tensor dtype on disk (default: the model's param dtype).

    Returns:
      The names of the tokenizer files copied.

    Raises:
      ValueError: `tokenizer_dir` is not a directory holding tokenizer.json.
    """
    if tokenizer_dir is not None and not os.path.isfile(
        os.path.join(tokenizer_dir, "tokenizer.json")
    ):
        raise ValueError(
            f"export_hf: tokenizer_dir={tokenizer_dir!r} holds no tokenizer.json; expected the "
            "Hugging Face tokenizer directory the run loaded."
        )
    extra = {}
    if tokenizer is not None:
        for key, value in (
            ("bos_token_id", tokenizer.bos_id),
            ("eos_token_id", tokenizer.eos_id),
            ("pad_token_id", tokenizer.pad_id),
        ):
            if value is not None:
                extra[key] = int(value)
    save_hf(model, path, dtype=dtype, extra_config=extra)
    copied = []
    for name in TOKENIZER_FILES if tokenizer_dir is not None else ():
        src = os.path.join(tokenizer_dir, name)
        if os.path.isfile(src):
            shutil.copyfile(src, os.path.join(path, name))
            copied.append(name)
    return copied
