"""Typed learner configuration, built from the `config.learner` ConfigDict in one place."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from rl.advantages import ADVANTAGE_ESTIMATORS
from rl.aggregation import AGGREGATIONS
from rl.losses import POLICY_LOSSES, LossConfig, loss_config_from
from rl.sections import from_section

LR_SCHEDULES = ("constant", "cosine")
OLD_LOGPROBS = ("snapshot", "sampler")


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    lr: float = 1e-6  # peak learning rate
    schedule: str = "constant"  # constant | cosine (after warmup)
    warmup_steps: int = 0  # linear warmup from 0
    total_steps: int = 0  # cosine: decay horizon in updates, > warmup_steps
    end_lr_ratio: float = 0.0  # cosine: final lr / peak lr
    b1: float = 0.9  # Adam first-moment decay
    b2: float = 0.999  # Adam second-moment decay
    eps: float = 1e-8  # Adam denominator epsilon
    weight_decay: float = 0.0  # AdamW decoupled decay
    grad_clip_norm: float = 1.0  # global-norm clipping; 0 turns it off

    def __post_init__(self):
        if not self.lr > 0:
            raise ValueError(f"optimizer.lr must be > 0; received {self.lr}.")
        if self.schedule not in LR_SCHEDULES:
            raise ValueError(
                f"optimizer.schedule={self.schedule!r}; expected one of {LR_SCHEDULES}."
            )
        if self.warmup_steps < 0 or self.grad_clip_norm < 0 or self.weight_decay < 0:
            raise ValueError(
                "optimizer.warmup_steps, grad_clip_norm and weight_decay must be >= 0; received "
                f"{self.warmup_steps}, {self.grad_clip_norm}, {self.weight_decay}."
            )
        if self.schedule == "cosine" and self.total_steps <= self.warmup_steps:
            raise ValueError(
                f"optimizer.schedule='cosine' needs total_steps ({self.total_steps}) > "
                f"warmup_steps ({self.warmup_steps}); in a run, total_steps 0 means the run's "
                "rounds x updates per round."
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class LearnerConfig:
    optimizer: OptimizerConfig = OptimizerConfig()
    loss: LossConfig = LossConfig()
    policy_loss: str = "ppo_clip"  # rl.losses.POLICY_LOSSES
    aggregation: str = "token_mean"  # rl.aggregation.AGGREGATIONS
    norm_constant: float = (
        0.0  # seq_mean_token_sum_norm: the Dr. GRPO constant (max response length)
    )
    advantage: str = "grpo"  # rl.advantages.ADVANTAGE_ESTIMATORS
    overlong_filter: bool = False  # DAPO: truncated responses (finish_reason "length") get no loss
    old_logprobs: str = (
        "snapshot"  # later updates of a round: behaviour params snapshot | sampler's
    )
    # log-probs are of softmax(logits / T); a run sets it from config.sampling.temperature
    temperature: float = 1.0
    # A micro-batch: this many rows of the longest row length, or as many more rows of a shorter
    # length as hold the same tokens (learner/micro_batches.py); divisible by the mesh's batch shards.
    micro_batch_rows: int = 16
    # An update's last micro-batch may take any whole multiple of 1/2^k of the token budget (1/2
    # for k = 1; 1/4, 1/2, 3/4 for k = 2: rows of the longest length, when a whole number of
    # them that the mesh's batch shards divide): 2^k - 1 more compiled micro-steps, less padding
    # where an update's tokens end partway through a micro-batch.
    flush_halvings: int = 1
    min_length_bucket: int = 32  # row lengths: powers of two from here up to max_length's bucket
    # the longest prompt + response the learner is given (a run sets it to engine.max_length):
    # each row length up to its bucket is one compiled micro-step
    max_length: int = 128
    packing: bool = True  # several sequences per row, first-fit by length (learner/batching.py)
    entropy_metric: bool = True  # compute the policy entropy per token (one more pass over V)

    def __post_init__(self):
        for name, registry in (
            ("policy_loss", POLICY_LOSSES),
            ("aggregation", AGGREGATIONS),
            ("advantage", ADVANTAGE_ESTIMATORS),
        ):
            registry.get(getattr(self, name))
        if self.old_logprobs not in OLD_LOGPROBS:
            raise ValueError(
                f"learner.old_logprobs={self.old_logprobs!r}; expected one of {OLD_LOGPROBS}."
            )
        if self.aggregation == "seq_mean_token_sum_norm" and not self.norm_constant > 0:
            raise ValueError(
                "learner.aggregation='seq_mean_token_sum_norm' needs norm_constant > 0 (the maximum "
                f"response length); received {self.norm_constant}."
            )
        if not isinstance(self.overlong_filter, bool):
            raise ValueError(
                f"learner.overlong_filter must be a bool; received {self.overlong_filter!r}."
            )
        if not self.temperature > 0:
            raise ValueError(f"learner.temperature must be > 0; received {self.temperature}.")
        if (
            isinstance(self.flush_halvings, bool)
            or not isinstance(self.flush_halvings, int)
            or (self.flush_halvings < 0)
        ):
            raise ValueError(
                f"learner.flush_halvings must be an int >= 0; received {self.flush_halvings!r}."
            )
        if min(self.micro_batch_rows, self.min_length_bucket, self.max_length - 1) < 1:
            raise ValueError(
                "learner.micro_batch_rows and min_length_bucket must be >= 1 and max_length >= 2; "
                f"received {self.micro_batch_rows}, {self.min_length_bucket}, {self.max_length}."
            )


def learner_config_from(
    cfg: Mapping[str, Any],
    *,
    total_updates: int = 0,
    temperature: float = 1.0,
    max_length: int = LearnerConfig.max_length,
) -> LearnerConfig:
    """LearnerConfig from a `config.learner` ConfigDict (nested `optimizer` and `loss` dicts).

    A cosine schedule with `optimizer.total_steps` 0 decays over `total_updates`, the updates the
    whole run will make (rl.run passes rounds x updates per round). `temperature` is the sampling
    temperature (`config.sampling.temperature`): the loss recomputes the sampler's log-probs, so
    there is one temperature, read from there; greedy sampling (0) scores log-probs at 1.0.
    `max_length` is the sampler's `config.engine.max_length` (prompt + response): the learner's
    micro-batch shapes, compiled at start, go up to it.
    """
    for name, instead in (
        ("temperature", "sampling.temperature"),
        ("max_length", "engine.max_length"),
    ):
        if name in cfg:
            raise ValueError(
                f"config.learner.{name} is not a field: the learner uses config.{instead} (one "
                f"value for the sampler and the learner); expected --config.{instead} instead."
            )
    optimizer = dict(cfg.get("optimizer", {}))
    if optimizer.get("schedule") == "cosine" and not optimizer.get("total_steps"):
        optimizer["total_steps"] = total_updates
    # `distributed` names the learner's process group (learner/distributed.py), not its math.
    fields = {k: v for k, v in dict(cfg).items() if k not in ("optimizer", "loss", "distributed")}
    return from_section(
        LearnerConfig,
        fields,
        name="learner",
        optimizer=from_section(OptimizerConfig, optimizer, name="learner.optimizer"),
        loss=loss_config_from(cfg.get("loss", {})),
        temperature=temperature if temperature > 0 else 1.0,
        max_length=max_length,
    )
