"""DAPO's overlong handling: the soft punishment against hand-computed values."""

import pytest

from rl.overlong import OverlongPenalty, overlong_penalty
from rl.types import Completion, Request, SamplingParams


@pytest.mark.parametrize(
    "length, reason, expected",
    [
        (3, "stop", 0.0),
        (12, "stop", 0.0),  # L_max - L_cache = 12: the ramp starts after it
        (13, "stop", -0.25),  # (12 - 13) / 4
        (15, "stop", -0.75),
        (16, "stop", -1.0),  # stopped on the last allowed token
        (16, "length", -1.0),  # truncated
        (5, "length", -1.0),  # truncated (e.g. by a long round's smaller cap): finish_reason rules
    ],
)
def test_penalty_is_dapos_linear_ramp(length, reason, expected):
    got = overlong_penalty(length, reason, max_new_tokens=16, cache_tokens=4)
    assert got == pytest.approx(expected, abs=1e-12)
    assert overlong_penalty(
        length, reason, max_new_tokens=16, cache_tokens=4, factor=0.5
    ) == pytest.approx(0.5 * expected, abs=1e-12)


def _completion(n, reason):
    return Completion(
        uid=0,
        round=0,
        sample=0,
        prompt=(1,),
        tokens=(7,) * n,
        logprobs=(0.0,) * n,
        versions=(0,) * n,
        finish_reason=reason,
    )


def test_wrapper_adds_the_penalty_to_the_task_reward_with_each_requests_cap():
    fn = OverlongPenalty(lambda request, completion: 1.0, cache_tokens=4, factor=1.0)
    req = Request(uid=0, prompt=(1,), group_size=1, params=SamplingParams(max_new_tokens=10))
    assert fn(req, _completion(6, "stop")) == 1.0
    assert fn(req, _completion(8, "stop")) == pytest.approx(1.0 - 0.5)  # (6 - 8) / 4
    assert fn(req, _completion(10, "length")) == 0.0


def test_bad_settings_name_the_field():
    with pytest.raises(ValueError, match=r"cache_tokens must be an int >= 1 .* received 0"):
        OverlongPenalty(lambda r, c: 0.0, cache_tokens=0)
    with pytest.raises(ValueError, match=r"factor must be finite and >= 0; received -1"):
        OverlongPenalty(lambda r, c: 0.0, cache_tokens=2, factor=-1.0)
    with pytest.raises(ValueError, match=r"cache_tokens must be in \[1, max_new_tokens=4\]"):
        overlong_penalty(3, "stop", max_new_tokens=4, cache_tokens=8)
    with pytest.raises(ValueError, match=r"finish_reason='eos'; expected 'stop' or 'length'"):
        overlong_penalty(3, "eos", max_new_tokens=4, cache_tokens=2)


def test_the_penalty_keeps_a_reward_runner_off_the_decode_thread():
    # sampler.loop scores through `submit` when the reward has one: wrapping a RewardRunner must
    # keep it (same values as the inline call), and a plain function stays inline (None).
    from rl.rewards import RewardRunner

    runner = RewardRunner(
        lambda request, text: float(len(text)), decode=lambda t: "x" * len(t), timeout_s=10.0
    )
    try:
        fn = OverlongPenalty(runner, cache_tokens=4, factor=1.0)
        req = Request(uid=0, prompt=(1,), group_size=1, params=SamplingParams(max_new_tokens=10))
        for n, reason in [(6, "stop"), (8, "stop"), (10, "length")]:
            c = _completion(n, reason)
            assert fn.submit(req, c).result(timeout=10) == fn(req, c)
        assert fn.submit(req, _completion(8, "stop")).result(timeout=10) == pytest.approx(7.5)
    finally:
        runner.close()
    assert OverlongPenalty(lambda r, c: 1.0, cache_tokens=4).submit is None
