"""Per-sample admission (group_atomic=False): same tokens as group-atomic, nothing lost or doubled,
and the frontier group of group-atomic frontier dispatch done no later than under per-sample fcfs."""

import numpy as np
import pytest

from rl.admission import FCFS, Frontier
from rl.types import Request, SamplingParams
from sampler.engine import Engine, EngineConfig
from sampler.loop import SamplerLoop


@pytest.fixture(scope="module")
def engine(model):
    return Engine(
        model, EngineConfig(max_slots=4, max_length=48, max_prefill_length=16, steps_per_call=2)
    )


def _req(uid, n_new, group=3, round=0):
    prompt = tuple(int(t) for t in np.random.default_rng(uid).integers(0, 256, size=4 + uid % 3))
    return Request(
        uid=uid,
        round=round,
        prompt=prompt,
        group_size=group,
        params=SamplingParams(temperature=1.0, max_new_tokens=n_new),
    )


def _run(engine, model, requests, *, group_atomic, admission=None, abort_after=None):
    groups, calls = [], {}
    loop = SamplerLoop(
        engine,
        engine.load_params(model),
        admission=FCFS() if admission is None else admission,
        reward_fn=lambda r, c: 0.0,
        emit=lambda g: None,
        group_atomic=group_atomic,
    )

    def emit(g):
        groups.append(g)
        calls[g.request.key] = loop.stats.generate_calls

    loop.emit = emit
    loop.submit(requests)
    aborted = []
    if abort_after is not None:
        n, keys = abort_after
        for _ in range(n):
            loop.step()
        aborted = loop.abort(keys)
    loop.run_until_idle(max_steps=500)
    assert loop.busy_slots() == 0 and loop.pending() == 0
    return groups, calls, loop, aborted


def _by_key(groups):
    out = {}
    for g in groups:
        assert g.request.key not in out, f"group {g.request.key} emitted twice"
        out[g.request.key] = g
    return out


def test_per_sample_tokens_equal_group_atomic_bitwise(engine, model):
    # Groups of 3 on 4 slots with mixed lengths: per-sample admission places samples in other
    # slots and starts them at other steps than group-atomic admission does.
    requests = [_req(u, n_new=3 + (5 * u) % 9) for u in range(5)]
    atomic, _, loop_a, _ = _run(engine, model, requests, group_atomic=True)
    single, _, loop_s, _ = _run(engine, model, requests, group_atomic=False)
    a, s = _by_key(atomic), _by_key(single)
    assert sorted(a) == sorted(s) == sorted(r.key for r in requests)
    for key in a:
        assert len(s[key].completions) == 3
        for ca, cs in zip(a[key].completions, s[key].completions, strict=True):
            assert ca.sample == cs.sample
            assert ca.tokens == cs.tokens
            assert ca.logprobs == cs.logprobs  # bitwise: same float32 values
    assert loop_a.stats.prefills == 5 and loop_s.stats.prefills == 15  # one prefill per sample
    assert loop_s.stats.groups_admitted == loop_s.stats.groups_emitted == 5


def test_per_sample_abort_of_a_partly_started_group_loses_nothing_else(engine, model):
    requests = [_req(u, n_new=8) for u in range(4)]
    # After one step: uid 0 runs 3 samples, uid 1 one sample (its others wait for slots).
    groups, _, loop, aborted = _run(
        engine, model, requests, group_atomic=False, abort_after=(1, [(0, 1)])
    )
    assert [r.uid for r in aborted] == [1]
    assert sorted(g.request.uid for g in groups) == [0, 2, 3]
    assert all(len(g.completions) == 3 for g in groups)
    reference, _, _, _ = _run(engine, model, [requests[i] for i in (0, 2, 3)], group_atomic=True)
    ref = _by_key(reference)
    for key, g in _by_key(groups).items():
        assert [c.tokens for c in g.completions] == [c.tokens for c in ref[key].completions]


def test_group_atomic_frontier_finishes_the_frontier_group_no_later_than_per_sample_fcfs(
    engine, model
):
    # Younger work (round 1) arrives before the frontier group (round 0), as under async when the
    # next round's requests are submitted while an update's group still waits. Lengths are fixed
    # (no stop tokens): completion is counted in generate calls, no clock.
    younger = [_req(u, n_new=4 + 6 * (u % 2), group=2, round=1) for u in range(6)]
    frontier = _req(10, n_new=6, group=2, round=0)
    requests = [*younger, frontier]
    _, atomic_calls, _, _ = _run(engine, model, requests, group_atomic=True, admission=Frontier())
    _, single_calls, _, _ = _run(engine, model, requests, group_atomic=False, admission=FCFS())
    assert atomic_calls[frontier.key] <= single_calls[frontier.key]
    assert atomic_calls[frontier.key] < single_calls[frontier.key]  # here strictly earlier


def test_bulk_insert_of_chosen_samples_rejects_bad_indices(engine, model):
    params, state = engine.load_params(model), engine.init_decode_state()
    request = _req(0, n_new=4, group=3)
    prefix = engine.prefill(params, request.prompt)
    with pytest.raises(ValueError, match=r"samples must be distinct and in \[0, 3\).*\[3\]"):
        engine.bulk_insert(prefix, state, [0], request, [3])
    with pytest.raises(ValueError, match=r"got 2 slots for 1 samples \[1\]"):
        engine.bulk_insert(prefix, state, [0, 1], request, [1])
