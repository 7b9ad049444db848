"""Sampling: greedy, temperature, top-k, top-p, the reported log-prob, row independence."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sampler.sampling import sample_tokens

N = 20000  # draws per distribution check; 4 sigma of a frequency is < 0.015


def _draw(logits_V, temperature=1.0, top_k=0, top_p=1.0, n=N):
    logits = jnp.broadcast_to(jnp.asarray(logits_V, jnp.float32), (n, len(logits_V)))
    keys = jax.random.split(jax.random.key(0), n)
    full = lambda x: jnp.full((n,), x)
    toks, logp = jax.jit(sample_tokens)(logits, keys, full(temperature), full(top_k), full(top_p))
    return np.asarray(toks), np.asarray(logp)


LOGITS = np.log(np.array([0.5, 0.3, 0.15, 0.05]))


def test_greedy_is_argmax_with_unit_temperature_logprob():
    toks, logp = _draw([0.1, 2.0, -1.0], temperature=0.0, n=3)
    assert (toks == 1).all()
    np.testing.assert_allclose(logp, jax.nn.log_softmax(jnp.array([0.1, 2.0, -1.0]))[1], atol=1e-6)


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_frequencies_follow_tempered_softmax(temperature):
    toks, logp = _draw(LOGITS, temperature=temperature)
    expected = np.asarray(jax.nn.softmax(jnp.asarray(LOGITS) / temperature))
    np.testing.assert_allclose(np.bincount(toks, minlength=4) / N, expected, atol=0.015)
    np.testing.assert_allclose(logp, np.log(expected)[toks], atol=1e-5)


def test_top_k_keeps_k_most_likely_and_reports_unfiltered_logprob():
    toks, logp = _draw(LOGITS, top_k=2)
    freq = np.bincount(toks, minlength=4) / N
    np.testing.assert_allclose(freq, [0.5 / 0.8, 0.3 / 0.8, 0, 0], atol=0.015)
    np.testing.assert_allclose(logp, LOGITS[toks], atol=1e-5)  # the learner's quantity


@pytest.mark.parametrize(
    "top_p,allowed", [(0.5, {0}), (0.7, {0, 1}), (0.8, {0, 1}), (0.81, {0, 1, 2})]
)
def test_top_p_keeps_smallest_nucleus(top_p, allowed):
    toks, _ = _draw(LOGITS, top_p=top_p, n=4000)
    assert set(np.unique(toks)) == allowed


def test_a_row_does_not_depend_on_its_neighbours():
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(4, 50)), jnp.float32)
    keys = jax.random.split(jax.random.key(3), 4)
    temp, k, p = (
        jnp.array([1.0, 0.7, 0.0, 1.3]),
        jnp.array([0, 5, 0, 0]),
        jnp.array([1.0, 1.0, 1.0, 0.9]),
    )
    toks, logp = sample_tokens(logits, keys, temp, k, p)
    for i in range(4):
        alone = sample_tokens(
            logits[i : i + 1], keys[i : i + 1], temp[i : i + 1], k[i : i + 1], p[i : i + 1]
        )
        assert int(alone[0][0]) == int(toks[i])
        np.testing.assert_allclose(alone[1][0], logp[i], atol=1e-6)


@pytest.mark.parametrize("top_k", [0, 5])
def test_fast_argmax_draws_the_same_tokens_as_categorical(top_k):
    # Ties included (rounded logits, greedy rows): the first maximal index wins in both. The
    # reference is jax.random.categorical over the top-k-masked logits (temperature 1: unscaled).
    b, v = 64, 259
    logits = jnp.round(3 * jax.random.normal(jax.random.key(1), (b, v)))
    keys = jax.random.split(jax.random.key(2), b)
    temperature = jnp.where(jnp.arange(b) % 4 == 0, 0.0, 1.0)
    args = (logits, keys, temperature, jnp.full((b,), top_k), jnp.ones((b,)))
    tokens, logp = jax.jit(sample_tokens)(*args)
    kth = jnp.sort(logits, axis=-1)[:, v - top_k] if top_k else jnp.min(logits, axis=-1)
    masked = jnp.where(logits >= kth[:, None], logits, -1e30)
    drawn = jax.vmap(jax.random.categorical)(keys, masked)
    ref = jnp.where(temperature > 0, drawn, jnp.argmax(logits, axis=-1)).astype(jnp.int32)
    ref_logp = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), ref[:, None], axis=-1)
    np.testing.assert_array_equal(tokens, ref)
    np.testing.assert_array_equal(logp, ref_logp[:, 0])
