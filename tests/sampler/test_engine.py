"""The slot engine: exact against no-cache decoding and the learner, slot-independent, sharded."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl.admission import FCFS
from rl.models import create_model, get_preset
from rl.types import Request, SamplingParams
from sampler.engine import Engine, EngineConfig
from sampler.loop import SamplerLoop
from sampler.reference import greedy_nocache

LOGP_TOL = 1e-4  # engine vs learner log-probs, float32 (the train/inference mismatch check)


def _prompts(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [tuple(int(t) for t in rng.integers(0, 256, size=n)) for n in lengths]


def _run(engine, params, requests, **loop_kw):
    groups = []
    loop = SamplerLoop(
        engine, params, admission=FCFS(), reward_fn=lambda r, c: 0.0, emit=groups.append, **loop_kw
    )
    loop.submit(requests)
    loop.run_until_idle(max_steps=1000)
    return {g.request.key: g for g in groups}, loop


@pytest.mark.parametrize("block", [0, 16])
def test_greedy_matches_nocache_recompute(model, block):
    engine = Engine(
        model,
        EngineConfig(
            max_slots=4,
            max_length=64,
            max_prefill_length=32,
            steps_per_call=3,
            attention_block=block,
        ),
    )
    lengths, new = [3, 9, 17, 30, 1, 12], [12, 7, 20, 10, 15, 5]
    requests = [
        Request(uid=i, prompt=p, params=SamplingParams(temperature=0.0, max_new_tokens=n))
        for i, (p, n) in enumerate(zip(_prompts(lengths), new, strict=True))
    ]
    groups, loop = _run(engine, engine.load_params(model), requests)
    ref = greedy_nocache(model, [r.prompt for r in requests], new, max_length=64)
    for i, r in enumerate(requests):
        c = groups[r.key].completions[0]
        assert list(c.tokens) == ref[i], f"request {i}"
        assert c.finish_reason == "length" and len(c.tokens) == new[i]
    assert loop.stats.prefills == len(requests)
    counts = engine.compile_counts()
    # The first admission takes 4 prompts (buckets 16 and 32, two each) in two batched calls; the
    # two later ones come alone. Block attention reads 1, 2 or 4 blocks of 16 (64 cache positions);
    # whole-cache attention compiles once.
    assert counts["prefill"] == counts["insert"] == 0
    assert counts["prefill_chunk"] == 2  # one per bucket: 16, 32
    assert counts["insert_chunk"] == 3  # (bucket, slot rung): (16, 2), (32, 2), (16, 1)
    assert counts["generate"] == (3 if block else 1)


def test_logprobs_match_learner_full_forward(model):
    engine = Engine(model, EngineConfig(max_slots=8, max_length=64, max_prefill_length=32))
    params = SamplingParams(temperature=0.7, top_k=20, top_p=0.95, max_new_tokens=16)
    requests = [
        Request(uid=i, prompt=p, group_size=4, params=params)
        for i, p in enumerate(_prompts([5, 21]))
    ]
    groups, _ = _run(engine, engine.load_params(model), requests)
    rows = [(g.request.prompt, c) for g in groups.values() for c in g.completions]
    seqs = [p + c.tokens for p, c in rows]
    t = max(map(len, seqs))
    tokens = np.zeros((len(seqs), t), np.int32)
    for i, s in enumerate(seqs):
        tokens[i, : len(s)] = s
    segs = (tokens != 0) | (np.arange(t)[None] < np.array([len(s) for s in seqs])[:, None])
    lp = model.token_logprobs(
        jnp.asarray(tokens[:, :-1]),
        jnp.broadcast_to(jnp.arange(t - 1), (len(seqs), t - 1)),
        jnp.asarray(segs[:, :-1], jnp.int32),
        jnp.asarray(tokens[:, 1:]),
        temperature=0.7,
    )
    for i, (p, c) in enumerate(rows):
        learner = np.asarray(lp[i, len(p) - 1 : len(p) - 1 + len(c.tokens)])
        np.testing.assert_allclose(np.asarray(c.logprobs), learner, atol=LOGP_TOL, rtol=0)


def test_same_request_same_tokens_in_any_slot_with_any_neighbours(model):
    params = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=12)
    target = Request(uid=7, round=3, prompt=_prompts([6])[0], group_size=2, params=params)
    alone = Engine(
        model, EngineConfig(max_slots=2, max_length=48, max_prefill_length=16, steps_per_call=1)
    )
    ref, _ = _run(alone, alone.load_params(model), [target])
    # Three other requests take the first slots, so the target lands in later slots, starts later,
    # and shares every decode batch with different neighbours; k=4 fused steps instead of 1.
    crowded = Engine(
        model, EngineConfig(max_slots=8, max_length=48, max_prefill_length=16, steps_per_call=4)
    )
    others = [
        Request(uid=i, round=3, prompt=p, group_size=2, params=SamplingParams(max_new_tokens=5 + i))
        for i, p in enumerate(_prompts([3, 11, 8], seed=1))
    ]
    got, _ = _run(crowded, crowded.load_params(model), others + [target])
    for a, b in zip(ref[target.key].completions, got[target.key].completions, strict=True):
        assert a.tokens == b.tokens
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
    samples = [c.tokens for c in got[target.key].completions]
    assert samples[0] != samples[1]  # samples of one group draw different streams


def test_stop_tokens_end_a_sequence_and_are_kept(model):
    engine = Engine(model, EngineConfig(max_slots=2, max_length=48, max_prefill_length=16))
    prompt = _prompts([5])[0]
    free_run = greedy_nocache(model, [prompt], [20], max_length=48)[0]
    stop = free_run[6]
    first = free_run.index(stop)
    r = Request(
        uid=0,
        prompt=prompt,
        params=SamplingParams(temperature=0.0, max_new_tokens=20, stop_token_ids=(stop, 258)),
    )
    groups, _ = _run(engine, engine.load_params(model), [r])
    c = groups[r.key].completions[0]
    assert list(c.tokens) == free_run[: first + 1] and c.finish_reason == "stop"


@pytest.mark.parametrize("page", [0, 16])
def test_sharded_engine_equals_unsharded(model, page):
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "tp"))
    cfg = EngineConfig(
        max_slots=8, max_length=48, max_prefill_length=16, steps_per_call=2, page_size=page
    )
    params = SamplingParams(temperature=1.0, max_new_tokens=10)
    requests = [
        Request(uid=i, prompt=p, group_size=2, params=params)
        for i, p in enumerate(_prompts([4, 9, 13, 2, 7]))
    ]
    plain = Engine(model, cfg)
    ref, _ = _run(plain, plain.load_params(model), requests)
    sharded = Engine(model, cfg, mesh=mesh)
    sparams = sharded.load_params(model)
    assert sparams["layers"][0]["attn"]["q"][...].sharding.spec == jax.sharding.PartitionSpec(
        None, "tp", None
    )
    state = sharded.init_decode_state()
    spec = jax.sharding.PartitionSpec
    if page:  # a page pool (pages, kv heads, head dim, page): heads split, pages replicated
        assert state.cache.k[0].sharding.spec == spec(None, "tp", None, None)
        assert state.cache.table.sharding.spec == spec("data", None)
    else:  # head-major cache (slots, kv heads, head dim, positions)
        assert state.cache.k[0].sharding.spec == spec("data", "tp", None, None)
    got, _ = _run(sharded, sparams, requests)
    for key, g in ref.items():
        for a, b in zip(g.completions, got[key].completions, strict=True):
            assert a.tokens == b.tokens
            np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


def test_requests_that_cannot_run_are_rejected_at_submit(model):
    engine = Engine(
        model, EngineConfig(max_slots=4, max_length=32, max_prefill_length=16, max_stop_tokens=2)
    )
    loop = SamplerLoop(
        engine, engine.load_params(model), admission=FCFS(), reward_fn=lambda r, c: 0.0, emit=print
    )
    short = SamplingParams(max_new_tokens=4)
    cases = [
        (Request(uid=0, prompt=(1,) * 17, params=short), "exceeds max_prefill_length"),
        (
            Request(uid=0, prompt=(1,) * 10, params=SamplingParams(max_new_tokens=30)),
            "exceeds the engine's max_length",
        ),
        (Request(uid=0, prompt=(1,), group_size=5, params=short), "exceeds max_slots"),
        (
            Request(
                uid=0,
                prompt=(1,),
                params=SamplingParams(max_new_tokens=4, stop_token_ids=(1, 2, 3)),
            ),
            "max_stop_tokens=2",
        ),
        (Request(uid=0, prompt=(300,), params=short), r"prompt token ids must be in \[0, 259\)"),
    ]
    for request, msg in cases:
        with pytest.raises(ValueError, match=msg):
            loop.submit([request])
    assert loop.pending() == 0


def test_cache_that_does_not_fit_is_rejected_with_sizes():
    model = create_model(get_preset("tiny"))
    cfg = EngineConfig(
        max_slots=64,
        max_length=1024,
        max_prefill_length=64,
        memory_budget_bytes=2**20,
        page_size=0,
    )
    with pytest.raises(
        ValueError,
        match=r"KV cache does not fit: 64 slots x max_length 1024 .* KiB per position .* "
        "Lower max_slots or max_length",
    ):
        Engine(model, cfg)
    paged = dataclasses.replace(cfg, page_size=16, kv_pages=4096)
    with pytest.raises(ValueError, match=r"4096 pages of 16 positions .* Lower kv_pages"):
        Engine(model, paged)
    assert (
        Engine(
            model, cfg.__class__(max_slots=2, max_length=64, max_prefill_length=64, page_size=0)
        ).cache_bytes_per_slot
        == 2 * 2 * 64 * 2 * 16 * 4
    )


def test_bulk_insert_rejects_bad_slots_and_mismatched_prefix(model):
    engine = Engine(model, EngineConfig(max_slots=4, max_length=32, max_prefill_length=16))
    params, state = engine.load_params(model), engine.init_decode_state()
    request = Request(
        uid=0, prompt=(1, 2, 3), group_size=2, params=SamplingParams(max_new_tokens=4)
    )
    prefix = engine.prefill(params, request.prompt)
    for slots in ([0, 0], [3, 4], [-1, 0]):
        with pytest.raises(ValueError, match="slots must be distinct"):
            engine.bulk_insert(prefix, state, slots, request)
    with pytest.raises(ValueError, match="the prefix holds 2 tokens"):
        engine.bulk_insert(engine.prefill(params, (1, 2)), state, [0, 1], request)
    with pytest.raises(ValueError, match="seed must be in"):
        EngineConfig(seed=-1)


@pytest.mark.parametrize("block", [0, 16])
def test_batched_prefill_and_live_blocks_leave_a_request_bitwise_unchanged(model, block):
    # Alone, the target is prefilled by itself (and with blocks of 16, attention reads one block);
    # crowded, it is prefilled in one call with three prompts of its bucket and neighbours decode
    # beside it (a long response makes block attention read 4 blocks). Its tokens and log-probs
    # must be the same floats.
    cfg = EngineConfig(max_slots=8, max_length=64, max_prefill_length=16, attention_block=block)
    params = SamplingParams(temperature=1.0, max_new_tokens=8)
    target = Request(uid=5, prompt=_prompts([7])[0], group_size=2, params=params)
    engine = Engine(model, cfg)
    weights = engine.load_params(model)
    alone, _ = _run(engine, weights, [target])
    others = [
        Request(uid=i, prompt=p, params=SamplingParams(temperature=1.0, max_new_tokens=40))
        for i, p in enumerate(_prompts([12, 3, 9], seed=2))
    ]
    crowded, _ = _run(engine, weights, others + [target])
    # block 16: 1, 2 and 4 blocks were used; block 0: the whole cache, one program
    assert engine.compile_counts()["generate"] == (3 if block else 1)
    for a, b in zip(alone[target.key].completions, crowded[target.key].completions, strict=True):
        assert a.tokens == b.tokens
        assert a.logprobs == b.logprobs  # bitwise


@pytest.mark.parametrize(
    "remat",
    ["full", pytest.param("dots", marks=pytest.mark.slow)],  # ~13 s cold each
)
def test_an_engine_of_a_remat_model_decodes_as_without_remat(model, remat):
    # The GPU recipes train with remat; the engine built from that model must still decode (nnx
    # remat cannot trace inside the decode scan) and draw exactly what a plain model draws.
    from flax import nnx

    params = nnx.state(model)
    remat_model = create_model(get_preset("tiny", init_std=0.3, remat=remat), seed=0)
    cfg = EngineConfig(max_slots=4, max_length=64, max_prefill_length=32, steps_per_call=4)
    requests = [
        Request(
            uid=i,
            round=0,
            index=i,
            prompt=p,
            group_size=2,
            params=SamplingParams(max_new_tokens=12),
        )
        for i, p in enumerate(_prompts([5, 9, 17]))
    ]
    plain, _ = _run(Engine(model, cfg), params, requests)
    rematted, _ = _run(Engine(remat_model, cfg), params, requests)
    assert plain.keys() == rematted.keys()
    for key, g in plain.items():
        assert [c.tokens for c in g.completions] == [c.tokens for c in rematted[key].completions]
        assert [c.logprobs for c in g.completions] == [
            c.logprobs for c in rematted[key].completions
        ]
