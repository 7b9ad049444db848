"""Advantage estimators agree with straightforward numpy references; the registry is strict."""

import functools

import jax
import numpy as np
import pytest

from rl import advantages
from rl.advantages import (
    ADVANTAGE_ESTIMATORS,
    get_advantage_estimator,
    group_advantages,
    register_advantage_estimator,
    zero_variance_groups,
)
from rl.types import Completion, Group, Request

TOL = dict(rtol=1e-5, atol=1e-6)  # float32 against a float64 reference


# Jitted entry point: eager op-by-op dispatch compiles every primitive and is slow on CPU.
@functools.partial(jax.jit, static_argnames=("name", "kwargs"))
def _estimate(rewards, *, name, kwargs=()):
    return get_advantage_estimator(name)(rewards, **dict(kwargs))


def _ref_grpo(r, eps=1e-6):
    out = np.zeros_like(r, dtype=np.float64)
    for i, row in enumerate(r):
        if len(row) > 1:
            mean = sum(row) / len(row)
            std = (sum((x - mean) ** 2 for x in row) / (len(row) - 1)) ** 0.5
            out[i] = [(x - mean) / (std + eps) for x in row]
    return out


def _ref_drgrpo(r):
    return np.array([[x - sum(row) / len(row) for x in row] for row in r], np.float64)


def _ref_rloo(r):
    out = np.zeros_like(r, dtype=np.float64)
    for i, row in enumerate(r):
        g = len(row)
        if g > 1:
            out[i] = [row[j] - (sum(row) - row[j]) / (g - 1) for j in range(g)]
    return out


REFERENCES = {"grpo": _ref_grpo, "drgrpo": _ref_drgrpo, "rloo": _ref_rloo}


def test_every_registered_estimator_has_a_reference():
    assert set(ADVANTAGE_ESTIMATORS) == set(REFERENCES)


@pytest.mark.parametrize("name", sorted(REFERENCES))
@pytest.mark.parametrize("shape", [(5, 8), (3, 2), (1, 16)])
def test_estimator_matches_reference(name, shape):
    rng = np.random.default_rng(sum(shape))
    rewards = rng.normal(size=shape).astype(np.float32)
    rewards[0, :] = rewards[0, 0]  # one zero-variance group
    adv = _estimate(rewards, name=name)
    assert adv.shape == shape
    np.testing.assert_allclose(adv, REFERENCES[name](rewards.astype(np.float64)), **TOL)
    np.testing.assert_allclose(adv[0], 0.0, atol=1e-6)
    if shape == (3, 2):  # eager works too
        np.testing.assert_allclose(get_advantage_estimator(name)(rewards), adv, **TOL)


def test_grpo_golden_values_use_unbiased_std():
    # mean 0.25, std (ddof=1) 0.5: the biased std (0.433) would give 1.732 / -0.577.
    adv = _estimate(np.array([[1.0, 0.0, 0.0, 0.0]]), name="grpo", kwargs=(("eps", 0.0),))
    np.testing.assert_allclose(adv, [[1.5, -0.5, -0.5, -0.5]], **TOL)


@pytest.mark.parametrize("name", sorted(REFERENCES))
def test_equal_rewards_give_exact_zeros_despite_float32_rounding(name):
    # In float32 mean([0.1] * 16) != 0.1; (0.1 - mean) / (0 + eps) once gave ~0.1 per sample.
    rewards = np.full((2, 16), 0.1, np.float32)
    rewards[1] = 0.7
    np.testing.assert_array_equal(_estimate(rewards, name=name), np.zeros((2, 16)))


def test_grpo_eps_keyword():
    r = np.array([[1.0, 0.0]], np.float32)  # std (ddof=1) = 1/sqrt(2)
    adv = _estimate(r, name="grpo", kwargs=(("eps", 0.5),))
    np.testing.assert_allclose(adv, _ref_grpo(r.astype(np.float64), eps=0.5), **TOL)


def test_rloo_golden_values():
    adv = _estimate(np.array([[1.0, 0.0, 0.0, 0.0]]), name="rloo")
    np.testing.assert_allclose(adv, [[1.0, -1 / 3, -1 / 3, -1 / 3]], **TOL)


@pytest.mark.parametrize("name", sorted(REFERENCES))
def test_group_of_one_gets_zero_advantage(name):
    adv = _estimate(np.array([[3.0], [-1.0]]), name=name)
    np.testing.assert_array_equal(adv, np.zeros((2, 1)))


@pytest.mark.parametrize("name", sorted(REFERENCES))
def test_integer_rewards_are_promoted_to_float(name):
    adv = _estimate(np.array([[1, 0, 0, 1]]), name=name)
    assert np.issubdtype(adv.dtype, np.floating)
    np.testing.assert_allclose(adv, REFERENCES[name](np.array([[1.0, 0.0, 0.0, 1.0]])), **TOL)


@pytest.mark.parametrize("shape", [(4,), (2, 0), (1, 2, 3)])
def test_bad_reward_shape_says_what_was_received(shape):
    with pytest.raises(ValueError, match=r"rewards_NxG.*received shape \(" + str(shape[0])):
        get_advantage_estimator("grpo")(np.zeros(shape))


def test_zero_variance_groups_with_tolerance():
    r = np.array([[1.0, 1.0, 1.0], [0.0, 0.0, 1.0], [2.0, 2.0 + 1e-8, 2.0], [5.0, 5.0, 5.1]])
    np.testing.assert_array_equal(zero_variance_groups(r), [True, False, True, False])
    np.testing.assert_array_equal(zero_variance_groups(r, atol=0.2), [True, False, True, True])
    np.testing.assert_array_equal(zero_variance_groups(np.array([[7.0]])), [True])


def test_unknown_estimator_lists_registered_names():
    with pytest.raises(ValueError, match=r"'nope'.*\['drgrpo', 'grpo', 'rloo'\]"):
        get_advantage_estimator("nope")


def test_register_adds_a_new_estimator_and_refuses_duplicates():
    @register_advantage_estimator("test_raw_reward")
    def raw(rewards_NxG):
        return advantages._as_rewards(rewards_NxG)

    try:
        assert get_advantage_estimator("test_raw_reward") is raw
        with pytest.raises(ValueError, match="already registered"):
            register_advantage_estimator("test_raw_reward")(raw)
        with pytest.raises(ValueError, match="already registered"):
            register_advantage_estimator("grpo")(raw)
    finally:
        del ADVANTAGE_ESTIMATORS["test_raw_reward"]


def _group(uid: int, rewards: list[float]) -> Group:
    req = Request(uid=uid, prompt=(1, 2), group_size=len(rewards))
    completions = tuple(
        Completion(
            uid=uid,
            round=0,
            sample=i,
            prompt=req.prompt,
            tokens=(3,),
            logprobs=(-0.5,),
            versions=(0,),
            finish_reason="stop",
            reward=r,
        )
        for i, r in enumerate(rewards)
    )
    return Group(request=req, completions=completions)


@pytest.mark.parametrize("name", sorted(REFERENCES))
def test_group_advantages_matches_estimator(name):
    rewards = [[1.0, 0.0, 0.5, 0.0], [0.0, 0.0, 0.0, 0.0], [2.0, -1.0, 0.0, 1.0]]
    groups = [_group(uid, r) for uid, r in enumerate(rewards)]
    out = group_advantages(groups, name)
    assert isinstance(out, list) and all(isinstance(t, tuple) for t in out)
    assert all(isinstance(a, float) for t in out for a in t)
    np.testing.assert_allclose(out, REFERENCES[name](np.array(rewards)), **TOL)


def test_group_advantages_forwards_kwargs_and_handles_empty():
    groups = [_group(0, [1.0, 0.0])]
    np.testing.assert_allclose(
        group_advantages(groups, "grpo", eps=0.5), _ref_grpo(np.array([[1.0, 0.0]]), 0.5), **TOL
    )
    assert group_advantages([], "grpo") == []


def test_group_advantages_rejects_unequal_sizes_and_unknown_names():
    groups = [_group(0, [1.0, 0.0]), _group(1, [1.0, 0.0, 1.0]), _group(2, [0.0, 1.0])]
    with pytest.raises(ValueError, match=r"received sizes \{2: 2, 3: 1\}"):
        group_advantages(groups, "grpo")
    with pytest.raises(ValueError, match=r"Unknown advantage estimator 'nope'.*'grpo'"):
        group_advantages(groups[:1], "nope")
