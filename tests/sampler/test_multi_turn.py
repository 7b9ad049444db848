"""Multi-turn episodes in the sampler: observations appended to the kept KV cache give the tokens
and log-probs of the whole conversation computed afresh; observation tokens are marked; an episode
ends on done, max_turns or its token budget; aborts and cuts between turns free the slot."""

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl.admission import FCFS
from rl.envs import EnvRunner, Turn
from rl.types import Request, SamplingParams
from sampler.engine import Engine, EngineConfig
from sampler.loop import SamplerLoop

STOPS = tuple(range(0, 256, 4))  # a quarter of the vocabulary ends a turn: several turns happen
OBS = (201, 202, 203)


@pytest.fixture(scope="module")
def engine(model):
    return Engine(
        model,
        EngineConfig(
            max_slots=4, max_length=48, max_prefill_length=8, steps_per_call=2, max_stop_tokens=64
        ),
    )


class Echo:
    """Answers each turn with OBS (or the turn's first token repeated, `vary`), reward = the
    turn's length; done after `turns` turns."""

    def __init__(self, turns=3, vary=False, delay=0.0):
        self.turns, self.vary, self.delay = turns, vary, delay

    def step(self, request, transcript):
        time.sleep(self.delay)
        n = len(transcript.turns)
        obs = (transcript.turns[-1][0],) * (n + 1) if self.vary else OBS
        return Turn(observation=obs, reward=float(len(transcript.turns[-1])), done=n >= self.turns)


def request(uid, group=2, n_new=30):
    prompt = tuple(int(t) for t in np.random.default_rng(uid).integers(0, 256, size=5))
    return Request(
        uid=uid,
        prompt=prompt,
        group_size=group,
        params=SamplingParams(temperature=1.0, max_new_tokens=n_new, stop_token_ids=STOPS),
    )


def episode_loop(engine, params, runner, groups):
    """A sampler loop whose samples are episodes in `runner`'s environment, emitting to `groups`."""
    return SamplerLoop(
        engine, params, admission=FCFS(), reward_fn=None, emit=groups.append, environment=runner
    )


def episodes(engine, params, env, requests, max_turns=4):
    groups = []
    with EnvRunner(env, vocab_size=256, max_turns=max_turns) as runner:
        loop = episode_loop(engine, params, runner, groups)
        loop.submit(requests)
        loop.run_until_idle(max_steps=2000)
        assert loop.busy_slots() == 0 and loop.pending() == 0
    return sorted(groups, key=lambda g: g.request.uid), loop


def fresh_logprobs(engine, params, prompt, tokens):
    """log p(tokens[t] | prompt + tokens[:t]) for every t: one full forward, no KV cache (the
    sequence right-padded to max_length: causal, so the padding changes nothing before it)."""
    seq = np.zeros((1, engine.config.max_length), np.int32)
    seq[0, : len(prompt) + len(tokens)] = (*prompt, *tokens)
    logp = np.asarray(_log_softmax(engine, params, seq))
    n = len(prompt)
    return np.asarray([logp[n + t - 1, tokens[t]] for t in range(len(tokens))])


def _log_softmax(engine, params, seq):
    @jax.jit
    def run(params, seq):
        model = engine._model(params)
        positions = jnp.arange(seq.shape[1])[None]
        logits = model.logits(model.hidden(seq, positions, jnp.ones_like(seq)))
        return jax.nn.log_softmax(logits[0].astype(jnp.float32), axis=-1)

    if engine not in _LOGP:
        _LOGP[engine] = run
    return _LOGP[engine](params, seq)


_LOGP = {}


def test_extend_continues_as_a_reprefill_of_the_whole_conversation(engine, model):
    params = engine.load_params(model)
    r = dataclasses.replace(request(7, group=1), params=SamplingParams(max_new_tokens=30))
    state = engine.prefill_insert(params, engine.init_decode_state(), [(r, (2,), (0,))])
    first = []
    for _ in range(2):
        state, out = engine.generate(params, state)
        first += [int(t) for t in jax.device_get(out.tokens[:, 2])]
    kept = engine.extend(params, state, [(2, (first[-1], *OBS[:-1]), OBS[-1])])
    # one decode state at a time (a paged engine's pages are the engine's): kept, then again
    again = lambda: engine.reprefill(
        params, engine.init_decode_state(), [(2, r, 0, (*first, *OBS))]
    )
    outs = []
    for s in (kept, again):
        s = s if not callable(s) else s()
        toks, lps = [], []
        for _ in range(3):
            s, out = engine.generate(params, s)
            out = jax.device_get(out)
            toks += list(out.tokens[:, 2])
            lps += list(out.logprobs[:, 2])
        outs.append((toks, np.asarray(lps)))
    assert outs[0][0] == outs[1][0]
    np.testing.assert_allclose(outs[0][1], outs[1][1], atol=1e-5, rtol=0)
    state = engine.init_decode_state()
    with pytest.raises(ValueError, match="feeds no token"):
        engine.extend(params, state, [(2, (), 5)])
    with pytest.raises(ValueError, match="exceeds max_prefill_length"):
        engine.extend(params, state, [(2, tuple(range(9)), 5)])


def test_episode_tokens_are_the_whole_conversation_policys(engine, model):
    """Every policy token's log-prob is that of one fresh forward over prompt + turns +
    observations (the KV kept across turns is right); observations are marked and carry no
    log-prob; the reward is the sum of the turns' rewards."""
    params = engine.load_params(model)
    groups, loop = episodes(engine, params, Echo(), [request(u) for u in range(3)])
    multi = 0
    for g in groups:
        for c in g.completions:
            mask = np.asarray(c.observation_mask or (False,) * len(c.tokens), bool)
            assert len(mask) == len(c.tokens) == len(c.logprobs) == len(c.versions)
            turns = len(c.turn_rewards)
            assert 1 <= turns <= 3 and c.reward == sum(c.turn_rewards)
            assert mask.sum() == len(OBS) * (turns - 1)
            multi += turns > 1
            fresh = fresh_logprobs(engine, params, g.request.prompt, c.tokens)
            np.testing.assert_allclose(
                np.asarray(c.logprobs)[~mask], fresh[~mask], atol=1e-5, rtol=0
            )
            assert np.all(np.asarray(c.logprobs)[mask] == 0.0)
            assert all(c.tokens[i] in OBS for i in np.flatnonzero(mask))
    assert multi >= 3  # most episodes took several turns
    assert loop.stats.observation_tokens == sum(
        sum(c.observation_mask) for g in groups for c in g.completions
    )
    assert loop.stats.tokens + loop.stats.observation_tokens == sum(
        len(c.tokens) for g in groups for c in g.completions
    )


def test_tokens_do_not_depend_on_when_the_environment_answers(engine, model):
    params = engine.load_params(model)
    reqs = [request(u) for u in range(4)]
    fast, _ = episodes(engine, params, Echo(vary=True), reqs)
    slow, _ = episodes(engine, params, Echo(vary=True, delay=0.02), reqs)
    key = lambda gs: [
        (c.uid, c.sample, c.tokens, c.turn_rewards) for g in gs for c in g.completions
    ]
    assert key(fast) == key(slow)


def test_an_episode_ends_at_max_turns_and_within_its_token_budget(engine, model):
    params = engine.load_params(model)
    groups, _ = episodes(
        engine, params, Echo(turns=99), [request(u, n_new=14) for u in range(3)], max_turns=2
    )
    for g in groups:
        for c in g.completions:
            assert len(c.turn_rewards) <= 2 and len(c.tokens) <= 14


class Hostile:
    def __init__(self):
        self.calls = 0

    def step(self, request, transcript):
        self.calls += 1
        if request.uid == 0:
            raise RuntimeError("tool crashed")
        if request.uid == 1:
            return Turn(observation=(999,), done=False)  # outside the vocabulary
        return "not a turn"


def test_a_failing_environment_ends_the_episode_with_no_reward(engine, model):
    params = engine.load_params(model)
    env = Hostile()
    groups, _ = episodes(engine, params, env, [request(u) for u in range(3)])
    for g in groups:
        for c in g.completions:
            assert c.turn_rewards == (0.0,) and c.reward == 0.0 and not c.observation_mask


def test_abort_between_turns_frees_the_slot(engine, model):
    """Aborted with turns at the environment (each answer takes 0.3 s): nothing is emitted,
    every slot is free, and the late answers change nothing."""
    params = engine.load_params(model)
    groups = []
    with EnvRunner(Echo(delay=0.3), vocab_size=256, max_turns=4) as runner:
        loop = episode_loop(engine, params, runner, groups)
        r = request(3, group=4)
        loop.submit([r])
        for _ in range(8):  # 16 tokens a sample: turns have ended (a quarter of tokens stop)
            loop.step()
        assert loop.stats.tokens < 4 * 16  # some samples are waiting for their environment
        assert [x.key for x in loop.abort([r.key])] == [r.key]
        loop.run_until_idle(max_steps=200)
        time.sleep(0.4)
        assert not loop.step()
        assert loop.busy_slots() == 0 and loop.pending() == 0 and groups == []
