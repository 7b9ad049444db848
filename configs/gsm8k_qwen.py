"""GRPO on GSM8K from a local Qwen2.5-1.5B-Instruct: a GPU-pod recipe (one host, 8 or 1 GPUs).

Inputs are local (the run downloads nothing): the model as a Hugging Face directory
(`huggingface-cli download Qwen/Qwen2.5-1.5B-Instruct --local-dir /models/Qwen2.5-1.5B-Instruct`)
and GSM8K as JSONL rows {"question", "answer": "... #### 72"} (the openai/gsm8k "main" files, e.g.
`datasets.load_dataset("openai/gsm8k", "main")["train"].to_json("/data/gsm8k/train.jsonl")`).

Launch (8 GPUs: the learner fsdp=4 on 4 of them, 4 sampler replicas of one GPU each on the
other 4: a paged KV pool per GPU; one replica of data=4 would hold its whole pool on each of them):
  python -m launch.train --config=configs/gsm8k_qwen.py \
      --config.model.hf_path=/models/Qwen2.5-1.5B-Instruct \
      --config.data.train_path=/data/gsm8k/train.jsonl \
      --config.data.heldout_path=/data/gsm8k/test.jsonl --config.workdir=runs/gsm8k_qwen
  One GPU: add --config.mesh.colocated=True --config.mesh.sampler_replicas=1 (sampler and
  learner time-share it). Without a
  held-out file add --config.eval.heldout_size=500 (500 seeded train rows are held out).
Smoke (CPU, about a minute; a tiny random model and the byte tokenizer, any GSM8K-format file):
  python -m launch.train --config=configs/gsm8k_qwen.py:smoke --config.data.train_path=...
  (add --config.model.hf_path=/tiny/hf/dir --config.tokenizer= for a tiny local HF checkpoint).

Expect: held-out greedy accuracy on all of test.jsonl before RL, every 10 rounds and at the end;
per round reward_mean and the pipeline metrics in runs/gsm8k_qwen/metrics.jsonl and tb/,
reward_errors / reward_timeouts (reward calls scored 0), summary.json with heldout_acc_before
/ heldout_acc_after and the rows used and dropped. Not yet measured on a GPU pod here: no
accuracy is claimed. A round is 64 prompts x 8 samples (512 responses of up to 1024 tokens),
4 updates of 16 prompts each; ~117 rounds are one epoch of GSM8K's 7,473 training rows.
Weights train in float32 (bfloat16 compute, remat): at lr 1e-6, AdamW updates are below
bfloat16's resolution of the weights and would round away.
"""

import ml_collections

from configs import base

INSTRUCTION = (
    'Solve the following problem step by step, then write the final answer as a number after "####".'
    "\n\n"
)


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    config = base.get_config()
    config.workdir = "runs/gsm8k_qwen"
    config.model.preset = "qwen2.5-1.5b"  # shapes only; the weights come from model.hf_path
    config.model.hf_path = ""  # required: --config.model.hf_path=/models/Qwen2.5-1.5B-Instruct
    config.model.param_dtype = "float32"  # master weights (lr 1e-6 updates vanish in bfloat16)
    config.model.dtype = "bfloat16"  # compute
    config.model.remat = "full"
    config.tokenizer = ""  # the tokenizer of model.hf_path
    config.sampler_dtype = "bfloat16"  # weights published to the sampler

    config.mesh.colocated = False  # disjoint halves of the host's devices
    config.mesh.learner_devices = 0  # 0: half the devices (8 GPUs: fsdp=4)
    config.mesh.sampler_devices = 0  # 0: the other half, split over the replicas
    config.mesh.sampler_replicas = 4  # 8 GPUs: one GPU (a page pool) each

    config.task.name = "gsm8k"
    config.task.reward = "gsm8k"  # the number after the last "####", else the last number
    config.task.reward_timeout_s = 5.0
    config.data.train_path = ""  # required: --config.data.train_path=/data/gsm8k/train.jsonl
    config.data.heldout_path = ""  # e.g. /data/gsm8k/test.jsonl
    config.data.on_error = "skip"
    config.data.template = "chat"  # Qwen's chat template (its default system turn)
    config.data.instruction = INSTRUCTION
    config.eval.heldout_size = 0  # all rows of data.heldout_path (GSM8K test: 1,319)
    config.eval.every_rounds = 10
    config.sft.max_steps = 0  # an instruct model needs no warm start

    config.rounds = 120  # ~1 epoch
    config.checkpoint_every = 20
    config.resume = True
    config.driver.mode = "cgp"
    config.driver.admission = "frontier"
    config.driver.batching = "ordered"
    config.driver.groups_per_round = 64  # R prompts per round
    config.driver.group_size = 8  # G samples per prompt
    config.driver.groups_per_update = 16  # U: 128 responses per update, S = 4 updates per round

    config.sampling.temperature = 1.0
    config.sampling.top_p = 1.0
    config.sampling.max_new_tokens = 1024
    config.engine.max_slots = 256  # per replica: 4 x 256 take a round's 512 responses at once
    config.engine.max_prefill_length = 512  # longer prompts are dropped at load (counted)
    config.engine.max_length = 1536  # prompt + response
    config.engine.steps_per_call = 16

    config.learner.policy_loss = "ppo_clip"
    config.learner.advantage = "grpo"
    config.learner.aggregation = "token_mean"  # DAPO / veRL token-mean
    config.learner.micro_batch_rows = 16  # divisible by fsdp
    config.learner.min_length_bucket = 256
    config.learner.optimizer.lr = 1e-6
    config.learner.optimizer.schedule = "constant"
    config.learner.optimizer.warmup_steps = 10
    config.learner.optimizer.weight_decay = 0.01
    config.learner.optimizer.grad_clip_norm = 1.0
    config.learner.loss.ppo_clip.clip_low = 0.2
    config.learner.loss.ppo_clip.clip_high = 0.28
    config.learner.loss.kl_coef = 0.001  # k3 ("low_var_kl") to the initial policy
    config.learner.loss.kl_estimator = "k3"

    if arg == "smoke":
        shrink_real_for_smoke(config, "runs/gsm8k_qwen_smoke")
    elif arg:
        raise ValueError(f"Unknown config argument {arg!r}; expected 'smoke' or nothing.")
    return config


def shrink_real_for_smoke(config: ml_collections.ConfigDict, workdir: str) -> None:
    """base.shrink_for_smoke, with room for real-data prompts and a local held-out slice."""
    base.shrink_for_smoke(config)
    config.workdir = workdir
    config.sft.max_steps = 0
    config.data.heldout_path = ""  # a seeded slice of data.train_path
    config.eval.heldout_size = 4
    config.sampling.max_new_tokens = 16
    config.engine.max_prefill_length = 256  # longer prompts are dropped at load (counted)
    config.engine.max_length = 272
    config.learner.min_length_bucket = 32
    config.learner.loss.kl_coef = 0.0
