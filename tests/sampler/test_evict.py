"""A replica taken back mid-rollout (async borrowing): its loop is emptied (`evict`) and what ran
there goes on in another loop (`resume`), re-prefilled with its tokens so far: nothing lost,
nothing doubled, the same tokens as if it had never moved."""

import numpy as np
import pytest

from rl.admission import FCFS
from rl.types import Request, SamplingParams
from sampler.engine import Engine, EngineConfig
from sampler.loop import SamplerLoop


@pytest.fixture(scope="module")
def engine(model):
    # max_prefill_length 8 < prompt + tokens so far: resumed samples use the max_length bucket
    return Engine(
        model, EngineConfig(max_slots=4, max_length=32, max_prefill_length=8, steps_per_call=2)
    )


def _request(uid, group=2, n_new=12):
    prompt = tuple(int(t) for t in np.random.default_rng(uid).integers(0, 256, size=5))
    return Request(
        uid=uid,
        prompt=prompt,
        group_size=group,
        params=SamplingParams(temperature=1.0, max_new_tokens=n_new),
    )


def _loop(engine, params, groups):
    return SamplerLoop(
        engine, params, admission=FCFS(), reward_fn=lambda r, c: float(r.uid), emit=groups.append
    )


def _by_key(groups):
    return {g.request.key: g for g in groups}


def test_evicted_runs_resume_elsewhere_with_the_same_tokens(engine, model):
    params = engine.load_params(model)
    requests = [_request(uid) for uid in (1, 2, 3)]  # 6 samples on 4 slots: one request waits
    alone = []
    loop = _loop(engine, params, alone)
    loop.submit(requests)
    loop.run_until_idle(max_steps=100)

    first, second = [], []
    lent = _loop(engine, params, first)
    lent.submit(requests)
    for _ in range(3):  # 6 tokens into the first two requests
        lent.step()
    other = _loop(engine, params, second)
    other.submit([_request(9, group=4, n_new=4)])  # holds every slot for 2 calls
    other.step()
    lent.close()
    queued, runs, scoring = lent.evict()
    assert [r.uid for r in queued] == [3] and not scoring
    assert sorted(run.request.uid for run in runs) == [1, 2]
    assert all(len(s.tokens) == 6 for run in runs for s in run.samples)
    assert lent.pending() == 0 and lent.busy_slots() == 0 and lent.stats.evicted_sequences == 4
    other.resume(runs)
    other.submit(queued)
    other.run_until_idle(max_steps=100)
    assert other.stats.resumed_sequences == 4
    moved = _by_key(second)
    assert set(moved) == {(0, 1), (0, 2), (0, 3), (0, 9)} and not first
    for key, g in _by_key(alone).items():
        for c, base in zip(moved[key].completions, g.completions, strict=True):
            assert c.tokens == base.tokens and len(c.versions) == len(c.tokens)
            np.testing.assert_allclose(c.logprobs, base.logprobs, atol=1e-5, rtol=0)
        assert moved[key].rewards == g.rewards


def test_evict_needs_a_stopped_loop_and_an_abort_reaches_a_parked_run(engine, model):
    params = engine.load_params(model)
    groups = []
    running = _loop(engine, params, groups)
    running.start()
    with pytest.raises(RuntimeError, match="close"):
        running.evict()
    running.close()
    lent = _loop(engine, params, groups)
    lent.submit([_request(1)])
    lent.step()
    lent.close()
    _, runs, _ = lent.evict()
    other = _loop(engine, params, groups)
    other.submit([_request(9, group=4, n_new=4)])
    other.step()  # every slot taken: the resumed run waits
    other.resume(runs)
    assert [r.uid for r in other.abort([(0, 1)])] == [1]
    other.run_until_idle(max_steps=100)
    assert [g.request.uid for g in groups] == [9] and other.stats.resumed_sequences == 0
