"""GRPO on MATH from a local Qwen2.5-Math-1.5B-Instruct: a GPU-pod recipe (one host, 8 or 1 GPUs).

Inputs are local: the model as a Hugging Face directory (`huggingface-cli download
Qwen/Qwen2.5-Math-1.5B-Instruct --local-dir /models/Qwen2.5-Math-1.5B-Instruct`) and MATH-style
JSONL rows {"problem", "solution": "... \\boxed{<answer>} ..."} (e.g. the MATH train split, and
MATH-500 as the held-out file). Every row is kept: answers that are not one number
("\\sqrt{2}", "(1, 2)") are checked symbolically by the "math" verifier (math-verify). Use an
Instruct checkpoint: its eos is the chat turn's end, where a base model's would be <|endoftext|>.

Launch (8 GPUs: learner fsdp=4, 4 sampler replicas of one GPU each):
  python -m launch.train --config=configs/math_qwen.py \
      --config.model.hf_path=/models/Qwen2.5-Math-1.5B-Instruct \
      --config.data.train_path=/data/math/train.jsonl \
      --config.data.heldout_path=/data/math/math500.jsonl --config.workdir=runs/math_qwen
  One GPU: add --config.mesh.colocated=True --config.mesh.sampler_replicas=1.
Smoke (CPU, about a minute): python -m launch.train --config=configs/math_qwen.py:smoke
  --config.data.train_path=/data/math/train.jsonl (a tiny random model, the byte tokenizer).

Expect: as configs/gsm8k_qwen.py (held-out greedy accuracy before, every 10 rounds and after;
metrics.jsonl, tb/, summary.json); responses up to 2048 tokens. Not yet measured here.
"""

import ml_collections

from configs import gsm8k_qwen

SYSTEM = "Please reason step by step, and put your final answer within \\boxed{}."


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    config = gsm8k_qwen.get_config()
    config.workdir = "runs/math_qwen"
    config.model.preset = "qwen2.5-1.5b"  # shapes only; the weights come from model.hf_path
    config.task.name = "math"
    config.task.reward = "math"  # the last \boxed{}: numbers exactly, other answers symbolically
    config.data.system = SYSTEM  # Qwen2.5-Math's chain-of-thought system prompt
    config.data.instruction = ""
    config.data.numeric_answers_only = False  # non-numeric answers are verified symbolically
    config.sampling.max_new_tokens = 2048
    config.engine.max_length = 2560  # within Qwen2.5-Math's 4096 positions
    config.engine.max_slots = 128  # per replica (longer responses): 512 in one wave on 4
    config.rounds = 100

    if arg == "smoke":
        gsm8k_qwen.shrink_real_for_smoke(config, "runs/math_qwen_smoke")
    elif arg:
        raise ValueError(f"Unknown config argument {arg!r}; expected 'smoke' or nothing.")
    return config
