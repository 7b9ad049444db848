"""The records that cross between the sampler, the queue and the learner.

All are frozen: a Group on the queue is complete and immutable.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Literal

FinishReason = Literal["stop", "length"]
UID_LIMIT = 2**31  # uids, rounds and sample indices fold into 32-bit PRNG keys


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How one request is decoded. `temperature == 0` is greedy."""

    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off
    max_new_tokens: int = 512  # response length cap
    stop_token_ids: tuple[int, ...] = ()  # the stop token is part of the response

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0; received {self.temperature}.")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 turns it off); received {self.top_k}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1]; received {self.top_p}.")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1; received {self.max_new_tokens}.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Prompt:
    """A prompt from a task: what the driver turns into a Request of a round."""

    uid: int  # unique within an epoch
    tokens: tuple[int, ...]
    meta: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # e.g. the reference answer
    max_new_tokens: int | None = None  # this prompt's response cap, below the round's; None: none


@dataclasses.dataclass(frozen=True, kw_only=True)
class Request:
    """One prompt to be answered `group_size` times: the unit of admission and of one prefill.

    `(round, uid)` names it; its randomness derives only from (seed, round, uid, sample index,
    position), never from the slot it lands in.
    """

    uid: int  # the prompt's id, unique within a round
    round: int = 0
    index: int = 0  # position in the round's logical order: training batch k = indices kU..kU+U-1
    prompt: tuple[int, ...]
    group_size: int = 1  # samples launched
    keep: int = 0  # > 0: the group is the first `keep` samples to finish (the rest are cut); 0: all
    params: SamplingParams = SamplingParams()
    meta: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # e.g. the reference answer

    def __post_init__(self):
        if not self.prompt:
            raise ValueError(f"Request uid={self.uid}: the prompt is empty; expected >= 1 token.")
        for name in ("uid", "round"):
            if not 0 <= getattr(self, name) < UID_LIMIT:
                raise ValueError(
                    f"Request.{name}={getattr(self, name)}; expected 0 <= {name} < 2**31."
                )
        if self.group_size < 1:
            raise ValueError(
                f"Request uid={self.uid}: group_size must be >= 1; received {self.group_size}."
            )
        if not 0 <= self.keep <= self.group_size:
            raise ValueError(
                f"Request uid={self.uid}: keep must be in [0, group_size={self.group_size}]; "
                f"received {self.keep}."
            )

    @property
    def kept(self) -> int:
        """Samples in the request's group: `keep` if set, else all `group_size`."""
        return self.keep or self.group_size

    @property
    def key(self) -> tuple[int, int]:
        return (self.round, self.uid)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Completion:
    """One sampled response, with what the learner needs per token."""

    uid: int
    round: int
    sample: int  # index within the group, 0..G-1
    prompt: tuple[int, ...]
    tokens: tuple[int, ...]  # the response, stop token included
    logprobs: tuple[float, ...]  # behaviour log-probs: log_softmax(logits / temperature)[token]
    versions: tuple[int, ...]  # policy version that produced each token
    finish_reason: FinishReason
    reward: float | None = None
    # Multi-turn episodes (rl/envs): True where the environment wrote the token (an observation
    # between the model's turns: fed to the model, zero loss weight); empty: none did.
    observation_mask: tuple[bool, ...] = ()
    turn_rewards: tuple[float, ...] = ()  # the environment's reward for each of the model's turns


@dataclasses.dataclass(frozen=True, kw_only=True)
class Group:
    """All G rewarded completions of one request: the unit that crosses to the learner."""

    request: Request
    completions: tuple[Completion, ...]  # ordered by sample index

    def __post_init__(self):
        g, k = self.request.group_size, self.request.kept
        samples = [c.sample for c in self.completions]
        if (
            len(samples) != k
            or samples != sorted(set(samples))
            or not all(0 <= s < g for s in samples)
        ):
            raise ValueError(
                f"Group uid={self.request.uid}: expected {k} completions with distinct sample "
                f"indices in [0, {g}) in increasing order; received {samples}."
            )
        if any(c.reward is None for c in self.completions):
            raise ValueError(f"Group uid={self.request.uid}: every completion must be rewarded.")

    @property
    def rewards(self) -> tuple[float, ...]:
        return tuple(float(c.reward) for c in self.completions)  # type: ignore[arg-type]
