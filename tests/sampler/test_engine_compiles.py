"""The engine's compile budget: `Engine.precompile` compiles every program a run calls on it, from
shapes its config fixes (prompt buckets x slot rungs, live-block rungs, migration's rows x lengths),
so nothing compiles after start whatever the admissions, aborts, swaps and migrations. The model
runs in one program per prompt bucket (a chunk's prefill) and per live-block rung (generate); the
slot rungs multiply only the insert, a scatter."""

import numpy as np

from learner.publish import published_shapes
from rl.admission import FCFS
from rl.types import Request, SamplingParams
from sampler.engine import Engine, EngineConfig
from sampler.loop import SamplerLoop


def test_engine_compiles_nothing_after_start_over_varied_admissions(model):
    """Per-sample admission of random prompt lengths and group sizes, aborts, a weight swap with
    recompute_kv (re-prefills past max_prefill_length) and a migration between two engines: every
    program is compiled by precompile, and there are (bucket x slot rung) + the rest of them."""
    cfg = EngineConfig(max_slots=4, max_length=40, max_prefill_length=16, steps_per_call=2)
    assert cfg.slot_rungs() == (1, 2, 4) and cfg.reprefill_buckets() == (16, 40)
    engines = [Engine(model, cfg) for _ in range(2)]
    params = engines[0].load_params(model)
    for engine in engines:
        engine.precompile(published_shapes(params), recompute=True, migrate_rows=2)
        engine.compiles.start()
    programs = sum(engines[0].compile_counts().values())
    # init, free, generate, a chunk's prefill x 2 buckets, its insert x 2 buckets x 3 rungs,
    # export + import x 2 rows x 2 lengths
    assert programs == 3 + 2 + 6 + 8
    rng = np.random.default_rng(0)
    requests = [
        Request(
            uid=i,
            prompt=tuple(int(t) for t in rng.integers(0, 256, int(rng.integers(1, 17)))),
            group_size=int(rng.integers(1, 4)),
            params=SamplingParams(max_new_tokens=int(rng.integers(4, 24))),
        )
        for i in range(9)
    ]
    loop = SamplerLoop(
        engines[0],
        params,
        admission=FCFS(),
        reward_fn=lambda r, c: 0.0,
        emit=lambda g: None,
        group_atomic=False,
        recompute_kv=True,
    )
    loop.submit(requests)
    for step in range(200):
        if step == 3:
            loop.set_params(params, version=1)  # a swap: running samples re-prefill
        if step == 5:
            loop.abort([(0, requests[-1].uid)])
        if not loop.step():
            break
    # migration: two running slots out of one engine into the other's free slots
    state = engines[0].init_decode_state()
    state = engines[0].prefill_insert(params, state, [(requests[0], [0, 3], [0, 1])])
    state, _ = engines[0].generate(params, state)
    moved = engines[0].export_slots(state, [0, 3])
    engines[0].free(state, [0, 3])
    other = engines[1].import_slots(engines[1].init_decode_state(), moved, [1, 2])
    engines[1].generate(params, other)
    for engine in engines:
        late = engine.compiles.after_start()
        assert all(v == 0 for v in late.values()), late
        assert sum(engine.compile_counts().values()) == programs


def test_a_short_page_pool_swaps_on_programs_compiled_at_start(model):
    """A pool below every slot's max_length (`EngineConfig.swaps`) precompiles one-row export and
    import for its swaps, and preempting compiles nothing more; a pool that holds every slot at
    max_length cannot run short and compiles no swap program."""
    full = EngineConfig(max_slots=4, max_length=40, max_prefill_length=16, page_size=8)
    assert not full.swaps
    cfg = EngineConfig(max_slots=4, max_length=40, max_prefill_length=16, page_size=8, kv_pages=10)
    assert cfg.swaps
    counts = {}
    for name, config in (("full", full), ("short", cfg)):
        engine = Engine(model, config)
        params = engine.load_params(model)
        engine.precompile(published_shapes(params))
        engine.compiles.start()
        counts[name] = engine.compile_counts()
    swap = {"export": 2, "import": 2}  # one row x the two length rungs of 40 positions
    extra = {k: v - counts["full"][k] for k, v in counts["short"].items()}
    assert {k: v for k, v in extra.items() if v} == swap
    rng = np.random.default_rng(1)
    requests = [
        Request(
            uid=i,
            prompt=tuple(int(t) for t in rng.integers(0, 256, 12)),
            group_size=2,
            params=SamplingParams(max_new_tokens=24),
        )
        for i in range(3)
    ]
    loop = SamplerLoop(
        engine, params, admission=FCFS(), reward_fn=lambda r, c: 0.0, emit=lambda g: None
    )
    loop.submit(requests)
    while loop.step():
        pass
    assert engine.pool.preemptions > 0
    late = engine.compiles.after_start()
    assert all(v == 0 for v in late.values()), late
