"""Weight swaps in a running sampler. recompute_kv (AReaL interruptible generation): running samples
continue from a re-prefill with the new weights: the new policy's log-probs, nothing lost or
doubled. And a request submitted after a publish never runs on the weights before it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl.admission import FCFS
from rl.models import create_model, get_preset
from rl.types import Request, SamplingParams
from sampler.engine import Engine, EngineConfig
from sampler.loop import SamplerLoop


@pytest.fixture(scope="module")
def engine(model):
    # max_prefill_length 8 < prompt + tokens so far: re-prefills past it use the max_length bucket
    return Engine(
        model, EngineConfig(max_slots=4, max_length=32, max_prefill_length=8, steps_per_call=2)
    )


def _request(uid=3, group=2, n_new=12):
    prompt = tuple(int(t) for t in np.random.default_rng(uid).integers(0, 256, size=5))
    return Request(
        uid=uid,
        prompt=prompt,
        group_size=group,
        params=SamplingParams(temperature=1.0, max_new_tokens=n_new),
    )


def _fresh_logprobs(engine, params, prompt, tokens, start):
    """log p(tokens[t] | prompt + tokens[:t]) for t >= start: one full forward, no KV cache."""
    seq = jnp.asarray((*prompt, *tokens), jnp.int32)[None]
    positions = jnp.arange(seq.shape[1])[None]
    model = engine._model(params)
    logits = model.logits(model.hidden(seq, positions, jnp.ones_like(seq)))[0]
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    n = len(prompt)
    return np.asarray([logp[n + t - 1, tokens[t]] for t in range(start, len(tokens))])


def _run(engine, old, new, request, recompute_kv, swap_after=2):
    groups = []
    loop = SamplerLoop(
        engine,
        old,
        admission=FCFS(),
        reward_fn=lambda r, c: 0.0,
        emit=groups.append,
        recompute_kv=recompute_kv,
    )
    loop.submit([request])
    for i in range(100):
        if i == swap_after:
            loop.set_params(new, version=1)
        if not loop.step():
            break
    assert loop.busy_slots() == 0 and loop.pending() == 0
    return groups, loop


def test_after_a_swap_decode_continues_with_the_new_policys_logprobs(engine, model):
    old = engine.load_params(model)
    new = engine.load_params(create_model(get_preset("tiny", init_std=0.3), seed=1))
    request = _request()
    (unswapped,), _ = _run(engine, old, old, request, recompute_kv=False, swap_after=None)
    (group,), loop = _run(engine, old, new, request, recompute_kv=True)
    assert loop.stats.recomputes == 2  # both samples were running at the swap
    for c, base in zip(group.completions, unswapped.completions, strict=True):
        # Nothing lost or doubled: 12 tokens, 4 before the swap (2 calls x 2 steps) as without it.
        assert len(c.tokens) == len(c.logprobs) == len(c.versions) == 12
        assert c.versions == (0,) * 4 + (1,) * 8
        assert c.tokens[:4] == base.tokens[:4] and c.logprobs[:4] == base.logprobs[:4]
        # Tokens after the swap: the new weights' log-probs of a fresh prefill (float32, 1e-5).
        fresh = _fresh_logprobs(engine, new, request.prompt, c.tokens, start=4)
        np.testing.assert_allclose(np.asarray(c.logprobs[4:]), fresh, atol=1e-5, rtol=0)


def test_without_recompute_the_old_cache_shifts_the_logprobs(engine, model):
    """The PipelineRL default keeps the old-weights KV: the first log-prob after the swap is not
    the new policy's own (this is what recompute_kv changes)."""
    old = engine.load_params(model)
    new = engine.load_params(create_model(get_preset("tiny", init_std=0.3), seed=1))
    request = _request()
    (group,), loop = _run(engine, old, new, request, recompute_kv=False)
    assert loop.stats.recomputes == 0
    c = group.completions[0]
    fresh = _fresh_logprobs(engine, new, request.prompt, c.tokens, start=4)
    assert abs(c.logprobs[4] - fresh[0]) > 1e-4


def test_reprefill_rejects_a_finished_sample(engine, model):
    params, state = engine.load_params(model), engine.init_decode_state()
    request = _request(n_new=3)
    with pytest.raises(ValueError, match="has 3 tokens of max_new_tokens=3; expected fewer"):
        engine.reprefill(params, state, [(0, request, 0, (1, 2, 3))])


class _PublishDuringStep:
    """An engine whose `free` runs a callback: a publish and a submission from another thread that
    land after a step took its params and before it admits (deterministically)."""

    def __init__(self, engine, on_free):
        self._engine, self.on_free = engine, on_free

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def free(self, state, slots):
        state = self._engine.free(state, slots)
        self.on_free()
        return state


def test_a_request_submitted_after_a_publish_never_runs_on_the_older_weights(engine, model):
    old = engine.load_params(model)
    new = engine.load_params(create_model(get_preset("tiny", init_std=0.3), seed=1))
    groups = []
    late = _request(uid=7, group=2, n_new=4)

    def publish_and_submit():
        loop.set_params(new, version=1)
        loop.submit([late])

    wrapped = _PublishDuringStep(engine, publish_and_submit)
    loop = SamplerLoop(
        wrapped, old, admission=FCFS(), reward_fn=lambda r, c: 0.0, emit=groups.append
    )
    loop.submit([_request(uid=3, group=2, n_new=8)])
    loop.step()
    loop.abort([(0, 3)])  # the next step frees its slots: the publish lands inside that step
    loop.run_until_idle(max_steps=50)
    (group,) = groups
    assert group.request.uid == 7
    assert all(c.versions == (1,) * 4 for c in group.completions)
