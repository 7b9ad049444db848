"""The paged KV cache: bitwise the dense engine's tokens and log-probs (any page size, shared group
prompts, preemption forced by a tiny pool), its books always balance, and the Pallas decode
attention decodes the XLA one's greedy tokens."""

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rl.admission import FCFS
from rl.types import Request, SamplingParams
from sampler.engine import Engine, EngineConfig
from sampler.loop import SamplerLoop
from sampler.reference import greedy_nocache

MAX_LENGTH = 64


def _requests(lengths, new, *, group=1, temperature=1.0, seed=0):
    rng = np.random.default_rng(seed)
    return [
        Request(
            uid=i,
            prompt=tuple(int(t) for t in rng.integers(0, 256, size=n)),
            group_size=group,
            params=SamplingParams(temperature=temperature, max_new_tokens=m),
        )
        for i, (n, m) in enumerate(zip(lengths, new, strict=True))
    ]


def _engine(model, *, page=0, pages=0, block=64, slots=8, kernel="xla"):
    config = EngineConfig(
        max_slots=slots,
        max_length=MAX_LENGTH,
        max_prefill_length=32,
        steps_per_call=3,
        attention_block=block,
        page_size=page,
        kv_pages=pages,
        attention_kernel=kernel,
    )
    return Engine(model, config)


def _loop(engine, model, groups):
    """A loop on `engine` with `model`'s weights, emitting into `groups`."""
    return SamplerLoop(
        engine,
        engine.load_params(model),
        admission=FCFS(),
        reward_fn=lambda r, c: 0.0,
        emit=groups.append,
    )


def _run(engine, model, requests, abort_after=None):
    groups = []
    loop = _loop(engine, model, groups)
    loop.submit(requests)
    steps = 0
    while loop.step():
        steps += 1
        if abort_after is not None and steps == abort_after[0]:
            loop.abort(abort_after[1])
        if engine.pool is not None:
            engine.pool.check()
        assert steps < 2000
    return {g.request.key: g.completions for g in groups}


def _same(a, b):
    assert a.keys() == b.keys()
    for key in a:
        for x, y in zip(a[key], b[key], strict=True):
            assert x.tokens == y.tokens, key
            assert np.array_equal(np.asarray(x.logprobs), np.asarray(y.logprobs)), key


LENGTHS, NEW = [3, 9, 17, 30, 1, 12, 25, 8], [30, 7, 20, 30, 15, 5, 34, 26]


@pytest.mark.parametrize(  # the quick tier keeps the default block (64); ~30 s each cold
    "page,block",
    [
        pytest.param(4, 16, marks=pytest.mark.slow),
        pytest.param(16, 16, marks=pytest.mark.slow),
        pytest.param(8, 0, marks=pytest.mark.slow),  # the whole cache every step
        (8, 64),
    ],
)
def test_paged_is_bitwise_dense_with_shared_prompts_and_preemption(model, page, block):
    requests = _requests(LENGTHS, NEW, group=2)
    ample = _engine(model, page=page, block=block)
    # the dense cache read in blocks of the same size (0: the whole cache)
    dense = _run(_engine(model, block=ample.config.decode_block), model, requests)
    _same(_run(ample, model, requests), dense)
    assert ample.pool.preemptions == 0 and ample.pool.shared_pages > 0
    # a pool of two sequences' pages: most of the time someone waits swapped out
    tiny = _engine(model, page=page, block=block, pages=2 * MAX_LENGTH // page)
    _same(_run(tiny, model, requests), dense)
    assert tiny.pool.preemptions > 0
    assert tiny.pool.free == tiny.pool.pages and not tiny.pool.order and not tiny.pool.swapped


def test_paged_greedy_matches_nocache_recompute(model):
    requests = _requests(LENGTHS, NEW, temperature=0.0, seed=1)
    engine = _engine(model, page=8, pages=20, slots=4)
    out = _run(engine, model, requests)
    ref = greedy_nocache(model, [r.prompt for r in requests], NEW, max_length=MAX_LENGTH)
    for i, r in enumerate(requests):
        assert list(out[r.key][0].tokens) == ref[i], f"request {i}"


def test_a_group_prompt_is_stored_once(model):
    engine = _engine(model, page=8)
    state = engine.init_decode_state()
    (request,) = _requests([30], [8], group=8)
    state = engine.prefill_insert(engine.load_params(model), state, [(request, range(8), None)])
    pool = engine.pool
    shared = (len(request.prompt) - 1) // 8  # pages wholly before the last prompt position
    assert pool.used == shared + 8  # the shared pages once, then a page of its own per sample
    assert (pool.table[:8, :shared] == pool.table[0, :shared]).all()
    assert (pool.refs[pool.table[0, :shared]] == 8).all()
    assert len(set(pool.table[:8, shared].tolist())) == 8
    engine.free(state, range(8))
    assert pool.free == pool.pages
    pool.check()


def test_a_group_the_pool_cannot_start_is_refused_at_submit(model):
    engine = _engine(model, page=8, pages=MAX_LENGTH // 8)  # one sequence's pages: 8
    loop = SamplerLoop(
        engine,
        engine.load_params(model),
        admission=FCFS(),
        reward_fn=lambda r, c: 0.0,
        emit=lambda g: None,
    )
    (fits,) = _requests([30], [4], group=4)  # 3 shared pages + 4 of their own: 7
    loop.submit([fits])
    too_many = dataclasses.replace(fits, uid=1, group_size=6)  # 3 + 6 = 9
    with pytest.raises(ValueError, match="start on 9 KV pages; the pool has 8"):
        loop.submit([too_many])


def test_paged_config_errors_name_the_setting(model):
    # a paged cache's attention blocks are whole pages: 24 positions read as 32
    config = EngineConfig(max_length=64, max_prefill_length=32, page_size=16, attention_block=24)
    assert config.decode_block == 32
    with pytest.raises(ValueError, match="cannot hold one sequence"):
        EngineConfig(max_length=64, max_prefill_length=32, page_size=16, kv_pages=3)
    with pytest.raises(ValueError, match="needs page_size"):
        EngineConfig(max_length=64, max_prefill_length=32, page_size=0, kv_pages=3)


@pytest.fixture(scope="module")
def tight(model):
    """One engine for every example (its programs compile once): a pool of 10 pages of 8, one
    max_length sequence and two pages more."""
    return _engine(model, page=8, pages=MAX_LENGTH // 8 + 2)


@pytest.mark.slow  # about 40 s: a dozen runs through a tight pool
@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data(), group=st.integers(1, 3))
def test_every_request_finishes_once_and_no_page_leaks(model, tight, data, group):
    n = data.draw(st.integers(1, 6))
    lengths = data.draw(st.lists(st.integers(1, 32), min_size=n, max_size=n))
    new = data.draw(st.lists(st.integers(1, 32), min_size=n, max_size=n))
    requests = _requests(lengths, new, group=group, seed=n)
    aborted = data.draw(st.sets(st.sampled_from([r.key for r in requests]), max_size=2))
    when = data.draw(st.integers(1, 6))
    out = _run(tight, model, requests, abort_after=(when, aborted))
    for r in requests:
        if r.key in out:
            assert len(out[r.key]) == group
            assert all(len(c.tokens) <= r.params.max_new_tokens for c in out[r.key])
        else:
            assert r.key in aborted
    pool = tight.pool
    assert pool.free == pool.pages and not pool.order and not pool.swapped
    assert not pool.refs.any()


def test_a_second_decode_state_on_the_engine_leaves_the_running_one_intact(model):
    # Held-out evaluation runs a loop of its own on the first replica's engine while an async
    # rollout runs ahead on it; the evaluation's loop took over the engine's page pool, and the
    # running loop decoded from pages it no longer owned (async runs lost their determinism).
    engine = _engine(model, page=8)
    want = _run(engine, model, _requests(LENGTHS, NEW))
    groups = []
    running = _loop(engine, model, groups)
    running.submit(_requests(LENGTHS, NEW))
    for _ in range(3):
        running.step()
    evaluated = _run(engine.fork(), model, _requests([5, 11], [9, 13], seed=1))
    while running.step():
        pass
    _same({g.request.key: g.completions for g in groups}, want)
    assert evaluated == _run(_engine(model, page=8), model, _requests([5, 11], [9, 13], seed=1))


@pytest.mark.slow  # ~25 s on a 2-core CPU: three engines, the Pallas ones in interpret mode
@pytest.mark.parametrize("kernel,atol", [("pallas", 1e-4), ("pallas_tpu", 0.1)])
def test_a_pallas_engine_decodes_the_xla_engines_greedy_tokens(model, kernel, atol):
    requests = _requests([3, 17, 9, 30], [12, 10, 20, 6], temperature=0.0, seed=3)
    runs = {
        k: _run(_engine(model, page=8, block=16, slots=4, kernel=k), model, requests)
        for k in ("xla", kernel)
    }
    assert runs["xla"].keys() == runs[kernel].keys()
    for key, completions in runs["xla"].items():
        for x, y in zip(completions, runs[kernel][key], strict=True):
            assert x.tokens == y.tokens, key
            # float32 log-probs: "pallas" sums in another order; "pallas_tpu" (TPU interpret
            # mode) also rounds its matmuls' inputs to bfloat16
            np.testing.assert_allclose(x.logprobs, y.logprobs, atol=atol, rtol=0)
