"""Verifiable rewards: answer verifiers, a reward registry and a timeout-guarded runner.

from rl.rewards import RewardRunner, get_reward

reward_fn = RewardRunner(get_reward("math"), decode=tokenizer.decode, timeout_s=5.0)
loop = SamplerLoop(..., reward_fn=reward_fn, ...)
"""

from rl.rewards.registry import (
    REWARDS,
    TextRewardFn,
    get_reward,
    meta_value,
    register_reward,
)
from rl.rewards.runner import RewardRunner
from rl.rewards.verifiers import (
    countdown_expression,
    countdown_reward,
    extract_boxed,
    extract_hash_answer,
    extract_last_number,
    format_reward,
    gsm8k_reward,
    math_reward,
    numbers_equal,
    parse_number,
)

__all__ = [
    "REWARDS",
    "RewardRunner",
    "TextRewardFn",
    "countdown_expression",
    "countdown_reward",
    "extract_boxed",
    "extract_hash_answer",
    "extract_last_number",
    "format_reward",
    "get_reward",
    "gsm8k_reward",
    "math_reward",
    "meta_value",
    "numbers_equal",
    "parse_number",
    "register_reward",
]
