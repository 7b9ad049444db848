"""Reward functions by name: `fn(request, completion_text) -> float`, reading `request.meta`.

A config names one (`get_reward("countdown")`); a user adds one with `@register_reward("name")`.
`rl.rewards.RewardRunner` turns a registered function into the sampler's RewardFn (it decodes
the tokens, applies a timeout and turns errors into 0.0).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rl.registry import Registry
from rl.rewards import verifiers
from rl.types import Request

TextRewardFn = Callable[[Request, str], float]

REWARDS: Registry[TextRewardFn] = Registry("reward")
register_reward = REWARDS.register


def get_reward(name: str) -> TextRewardFn:
    """The reward function registered under `name`.

    Args:
        name: A registered name, e.g. "math", "gsm8k", "countdown" or "exact".

    Returns:
        `fn(request, completion_text) -> float`.

    Raises:
        ValueError: If `name` is not registered; the message lists the registered names.
    """
    return REWARDS.get(name)


def meta_value(request: Request, key: str) -> Any:
    """`request.meta[key]`; a ValueError names the request and the keys it has if it is missing."""
    if key not in request.meta:
        raise ValueError(
            f"Request uid={request.uid} round={request.round}: the reward needs meta[{key!r}]; "
            f"received meta keys {sorted(request.meta)}."
        )
    return request.meta[key]


@register_reward("math")
def reward_math(request: Request, completion_text: str) -> float:
    """`verifiers.math_reward` against meta["answer"]: the last \\boxed{} (else last number)."""
    return verifiers.math_reward(completion_text, meta_value(request, "answer"))


@register_reward("gsm8k")
def reward_gsm8k(request: Request, completion_text: str) -> float:
    """`verifiers.gsm8k_reward` against meta["answer"] (a number or a "... #### 42" solution)."""
    return verifiers.gsm8k_reward(completion_text, meta_value(request, "answer"))


@register_reward("countdown")
def reward_countdown(request: Request, completion_text: str) -> float:
    """`verifiers.countdown_reward` with meta["numbers"], meta["target"], meta.get("use_all")."""
    return verifiers.countdown_reward(
        completion_text,
        meta_value(request, "numbers"),
        meta_value(request, "target"),
        use_all=bool(request.meta.get("use_all", False)),
    )


@register_reward("exact")
def reward_exact(request: Request, completion_text: str) -> float:
    """1.0 iff the stripped text equals `str(meta["answer"])`, stripped."""
    return 1.0 if completion_text.strip() == str(meta_value(request, "answer")).strip() else 0.0


@register_reward("digits")
def reward_digits(request: Request, completion_text: str) -> float:
    """Partial credit: the share of positions where the stripped text equals `meta["answer"]`,
    0.0 if the lengths differ. 1.0 iff the answer is exact, so exact-match accuracy (reward >= 1)
    is unchanged; the per-digit credit is a denser signal for arithmetic."""
    text, answer = completion_text.strip(), str(meta_value(request, "answer")).strip()
    if len(text) != len(answer) or not answer:
        return 0.0
    return sum(a == b for a, b in zip(text, answer, strict=True)) / len(answer)
