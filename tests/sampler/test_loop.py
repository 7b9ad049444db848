"""The sampler loop: complete groups only, abort, weight swaps, errors, threads."""

import dataclasses
import threading

import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from rl.admission import FCFS, Frontier
from rl.models import create_model, get_preset
from rl.round_planner import RoundCut
from rl.types import Request, SamplingParams
from sampler.engine import Engine, EngineConfig
from sampler.loop import SamplerLoop


@pytest.fixture(scope="module")
def engine(model):
    return Engine(
        model, EngineConfig(max_slots=4, max_length=48, max_prefill_length=16, steps_per_call=2)
    )


def _req(uid, n_new=6, group=2, temperature=1.0, prompt_len=5):
    prompt = tuple(int(t) for t in np.random.default_rng(uid).integers(0, 256, size=prompt_len))
    return Request(
        uid=uid,
        prompt=prompt,
        group_size=group,
        params=SamplingParams(temperature=temperature, max_new_tokens=n_new),
    )


class Recorder:
    """Reward function and sink that log events in order."""

    def __init__(self):
        self.events, self.groups = [], []

    def reward(self, request, completion):
        self.events.append(("reward", request.uid, completion.sample))
        return float(len(completion.tokens))

    def emit(self, group):
        self.events.append(("emit", group.request.uid))
        self.groups.append(group)


def test_group_emitted_once_after_all_samples_rewarded(engine, model):
    rec = Recorder()
    loop = SamplerLoop(
        engine, engine.load_params(model), admission=FCFS(), reward_fn=rec.reward, emit=rec.emit
    )
    # Samples of one group finish at different steps: 4 slots, groups of 3, so groups straddle calls.
    requests = [_req(i, n_new=3 + 2 * i, group=3) for i in range(4)]
    loop.submit(requests)
    loop.run_until_idle(max_steps=200)
    assert sorted(g.request.uid for g in rec.groups) == [0, 1, 2, 3]
    for g in rec.groups:
        emit_at = rec.events.index(("emit", g.request.uid))
        rewarded = {
            e[2] for e in rec.events[:emit_at] if e[0] == "reward" and e[1] == g.request.uid
        }
        assert rewarded == {0, 1, 2}
        assert g.rewards == tuple(float(len(c.tokens)) for c in g.completions)
        assert all(
            len(c.tokens) == len(c.logprobs) == len(c.versions) == g.request.params.max_new_tokens
            for c in g.completions
        )
    assert loop.stats.prefills == loop.stats.groups_emitted == 4
    assert loop.busy_slots() == 0 and loop.pending() == 0


def test_abort_frees_slots_which_are_reused(engine, model):
    rec = Recorder()
    loop = SamplerLoop(
        engine, engine.load_params(model), admission=FCFS(), reward_fn=rec.reward, emit=rec.emit
    )
    long_a, long_b, waiting = _req(1, n_new=40), _req(2, n_new=40), _req(3, n_new=4)
    loop.submit([long_a, long_b, waiting])
    loop.step()
    assert loop.busy_slots() == 4 and len(loop.admission) == 1  # request 3 waits for slots
    aborted = loop.abort([long_a.key, (0, 99)])
    assert aborted == [long_a] and loop.busy_slots() == 2
    loop.step()  # frees the slots on the device, admits request 3 into them
    assert loop.busy_slots() == 4 and len(loop.admission) == 0
    assert loop.abort([long_b.key]) == [long_b]
    loop.run_until_idle(max_steps=100)
    assert [g.request.uid for g in rec.groups] == [3]  # nothing of an aborted request is emitted
    assert loop.stats.groups_aborted == 2
    # the aborted request can run again from scratch (tail batching regenerates aborted prompts)
    loop.submit([long_a])
    loop.run_until_idle(max_steps=100)
    assert [g.request.uid for g in rec.groups] == [3, 1]


def test_slots_aborted_from_another_thread_mid_step_are_reused_only_once_freed(engine, model):
    """An abort that lands after a step took its slots to free (another replica's round cut, on
    its thread) leaves them to the next step's free: this step's admission must not start a
    request in them, or that free would stop it for good."""
    rec = Recorder()
    loop = SamplerLoop(
        engine, engine.load_params(model), admission=FCFS(), reward_fn=rec.reward, emit=rec.emit
    )
    long_a, long_b, waiting = _req(1, n_new=40), _req(2, n_new=40), _req(3, n_new=4)
    loop.submit([long_a, long_b, waiting])
    loop.step()
    assert loop.busy_slots() == 4 and len(loop.admission) == 1  # request 3 waits for slots
    # at the next step's boundary (its frees done, its admission to come) request 1 is aborted
    loop.on_boundary = lambda: loop.abort([long_a.key])
    loop.step()
    loop.on_boundary = None
    assert loop.busy_slots() == 2 and len(loop.admission) == 1  # 3 waits for the free
    loop.step()  # frees request 1's slots on the device, admits request 3 into them
    assert loop.busy_slots() == 4 and len(loop.admission) == 0
    assert loop.abort([long_b.key]) == [long_b]
    loop.run_until_idle(max_steps=100)
    assert [g.request.uid for g in rec.groups] == [3]
    assert all(len(c.tokens) == 4 for c in rec.groups[0].completions)


def test_weight_swap_applies_from_the_next_step_with_version_tags(engine, model):
    params = engine.load_params(model)
    other = engine.load_params(create_model(get_preset("tiny", init_std=0.3), seed=1))
    request = _req(5, n_new=12, group=1, temperature=0.0)

    def run(swap_after=None):
        rec = Recorder()
        loop = SamplerLoop(engine, params, admission=FCFS(), reward_fn=rec.reward, emit=rec.emit)
        loop.submit([request])
        for i in range(100):
            if i == swap_after:
                loop.set_params(other, version=1)
            if not loop.step():
                break
        return rec.groups[0].completions[0]

    base, swapped = run(), run(swap_after=2)  # 2 calls x 2 steps with version 0
    assert swapped.versions == (0,) * 4 + (1,) * 8
    assert swapped.tokens[:4] == base.tokens[:4]
    assert swapped.tokens[4:] != base.tokens[4:]
    assert base.versions == (0,) * 12


def test_reward_error_surfaces_from_the_thread(engine, model):
    def bad_reward(request, completion):
        raise RuntimeError("verifier exploded")

    loop = SamplerLoop(
        engine,
        engine.load_params(model),
        admission=FCFS(),
        reward_fn=bad_reward,
        emit=lambda g: None,
    )
    loop.start()
    loop.submit([_req(1)])
    with pytest.raises(RuntimeError, match="verifier exploded"):
        loop.drain(timeout=120)
    with pytest.raises(RuntimeError, match="verifier exploded"):
        loop.submit([_req(2)])
    with pytest.raises(RuntimeError, match="verifier exploded"):
        loop.close()


def test_threaded_loop_serves_submissions_from_another_thread(engine, model):
    rec = Recorder()
    lock = threading.Lock()

    def emit(group):
        with lock:
            rec.emit(group)

    loop = SamplerLoop(
        engine, engine.load_params(model), admission=FCFS(), reward_fn=rec.reward, emit=emit
    )
    loop.start()
    submitter = threading.Thread(
        target=lambda: loop.submit([_req(i, n_new=3 + i) for i in range(5)])
    )
    submitter.start()
    submitter.join()
    loop.drain(timeout=120)
    assert sorted(g.request.uid for g in rec.groups) == list(range(5))
    loop.submit([_req(9)])
    loop.drain(timeout=120)
    loop.close()
    assert sorted(g.request.uid for g in rec.groups) == [*range(5), 9]


def test_params_on_the_loop_are_not_donated(engine, model):
    params = engine.load_params(model)
    loop = SamplerLoop(
        engine, params, admission=FCFS(), reward_fn=lambda r, c: 0.0, emit=lambda g: None
    )
    loop.submit([_req(1)])
    loop.run_until_idle(max_steps=50)
    assert not any(x.is_deleted() for x in __import__("jax").tree.leaves(nnx.state(params)))


@settings(max_examples=12, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 30), min_size=2, max_size=7),
    target=st.integers(1, 6),
    admission=st.sampled_from([FCFS, Frontier]),
)
def test_round_cut_emits_the_first_target_groups_and_frees_the_rest(
    engine, model, lengths, target, admission
):
    """Random lengths: exactly `target` groups of the round come out, the first to complete; the
    others are aborted at once (waiting or running), their slots free for the next round."""
    target = min(target, len(lengths))
    rec = Recorder()
    loop = SamplerLoop(
        engine,
        engine.load_params(model),
        admission=admission(),
        reward_fn=rec.reward,
        emit=rec.emit,
    )
    requests = [
        dataclasses.replace(_req(uid, n_new=n), round=3, index=uid) for uid, n in enumerate(lengths)
    ]
    cut = RoundCut(target)
    loop.submit(requests, cut=cut)
    loop.run_until_idle(max_steps=500)
    assert [g.request.uid for g in rec.groups] == [k[1] for k in cut.kept]
    assert len(rec.groups) == target
    assert loop.pending() == 0 and loop.busy_slots() == 0
    s = loop.stats
    assert s.groups_emitted == target and s.groups_aborted + s.groups_cut == len(lengths) - target
    # the freed slots serve the next round in full
    loop.submit([dataclasses.replace(_req(10, n_new=2, group=4), round=4)])
    loop.run_until_idle(max_steps=50)
    assert rec.groups[-1].request.uid == 10 and loop.busy_slots() == 0


def test_response_overprovisioning_keeps_the_first_g_to_finish(model):
    engine = Engine(
        model,
        EngineConfig(
            max_slots=4, max_length=48, max_prefill_length=16, steps_per_call=2, max_stop_tokens=64
        ),
    )
    rec = Recorder()
    loop = SamplerLoop(
        engine, engine.load_params(model), admission=FCFS(), reward_fn=rec.reward, emit=rec.emit
    )
    stops = tuple(range(0, 256, 4))  # samples stop at random lengths
    params = SamplingParams(temperature=1.0, max_new_tokens=40, stop_token_ids=stops)
    request = dataclasses.replace(_req(0, group=4), keep=2, params=params)
    loop.submit([request])
    loop.run_until_idle(max_steps=100)
    (group,) = rec.groups
    samples = [c.sample for c in group.completions]
    assert len(samples) == 2 and samples == sorted(samples) and set(samples) <= {0, 1, 2, 3}
    assert loop.busy_slots() == 0 and loop.pending() == 0
    s = loop.stats
    longest_kept = max(len(c.tokens) for c in group.completions)
    assert s.samples_cut >= 1  # this seed: one sample still running (one more finished late)
    assert s.cut_sample_tokens >= s.samples_cut * (longest_kept - 2)  # ran at least as long


def test_a_group_refused_by_the_closed_queue_during_shutdown_is_dropped(engine, model):
    """Async work running ahead can finish while the run closes: after request_stop, the closed
    queue's refusal is no error; before it, the refusal surfaces as one."""
    from rl.queue import QueueClosed

    for stopping in (True, False):
        in_emit, go = threading.Event(), threading.Event()

        def emit(group, in_emit=in_emit, go=go):
            in_emit.set()
            go.wait(timeout=60)
            raise QueueClosed("Cannot put group: the queue is closed.")

        loop = SamplerLoop(
            engine,
            engine.load_params(model),
            admission=FCFS(),
            reward_fn=lambda r, c: 1.0,
            emit=emit,
        )
        loop.start()
        loop.submit([_req(1)])
        assert in_emit.wait(timeout=120)
        if stopping:
            loop.request_stop()
            go.set()
            loop.close()  # no error
        else:
            go.set()
            with pytest.raises(QueueClosed):
                loop.drain(timeout=120)
            with pytest.raises(QueueClosed):
                loop.close()


def test_a_blocked_reward_stops_no_decode_step_and_emission_keeps_completion_order(engine, model):
    """Rewards submitted to a RewardRunner: while group 0's reward call is blocked, the loop
    keeps decoding group 1 to the end and holds it back; once released, both are emitted in the
    order they completed, with the rewards an inline call gives."""
    from rl.rewards import RewardRunner

    release = threading.Event()

    def reward(request, text):
        if request.uid == 0:
            release.wait(30.0)
        return float(len(text))

    inline, emitted = Recorder(), []
    runner = RewardRunner(reward, decode=lambda t: "x" * len(t), timeout_s=60.0, workers=2)
    params = engine.load_params(model)
    requests = [_req(0, n_new=2, group=2), _req(1, n_new=9, group=2)]
    try:
        loop = SamplerLoop(engine, params, admission=FCFS(), reward_fn=runner, emit=emitted.append)
        loop.submit(requests)
        calls = 0
        while loop.busy_slots() or loop.stats.generate_calls == 0:
            loop.step()
            calls += 1
            assert calls < 50
        # group 0 finished at the first call; group 1 decoded 8 more tokens (4 calls) meanwhile
        assert loop.stats.generate_calls == 5 and emitted == []
        assert loop.pending() == 2  # both complete, their rewards outstanding
        threading.Timer(0.2, release.set).start()
        # Nothing to decode: a step waits for group 0's rewards and emits it; group 1's rewards
        # queue behind group 0's on the 2 workers, so a later step may be the one to emit it.
        steps = 1
        while loop.step():
            steps += 1
            assert steps < 50
        assert loop.stats.generate_calls == 5  # the waiting steps decoded nothing
    finally:
        release.set()
        runner.close()
    assert [g.request.uid for g in emitted] == [0, 1] and loop.pending() == 0
    reference = SamplerLoop(engine, params, admission=FCFS(), reward_fn=inline.reward,
                            emit=inline.emit)  # fmt: skip
    reference.submit(requests)
    reference.run_until_idle(max_steps=50)
    assert [(g.request.uid, g.completions) for g in emitted] == [
        (g.request.uid, g.completions) for g in inline.groups
    ]


def test_view_gives_a_paged_engines_pages_and_a_dense_one_none(model):
    """loop.view() for the migration policy: a paged engine's pool, its free pages and each
    running request's KV in pages (its live positions); a dense engine's view is slots only."""
    cfg = dict(max_slots=4, max_length=48, max_prefill_length=16, steps_per_call=2)
    for page in (0, 8):
        engine = Engine(model, EngineConfig(**cfg, page_size=page, kv_pages=24 if page else 0))
        loop = SamplerLoop(
            engine,
            engine.load_params(model),
            admission=FCFS(),
            reward_fn=lambda r, c: 0.0,
            emit=lambda g: None,
        )
        loop.submit([_req(0, n_new=20, prompt_len=9), _req(1, n_new=20, prompt_len=3)])
        loop.step()
        loop.step()
        view = loop.view()
        assert view.sequences == 4 and {r.key for r in view.running} == {(0, 0), (0, 1)}
        if not page:
            assert (view.pages, view.free_pages, view.page) == (0, 0, 0)
            assert all(r.kv_pages == 0 for r in view.running)
            continue
        pool = engine.pool
        assert (view.pages, view.page) == (24, 8) and view.free_pages == pool.free
        runs = {run.request.key: run for _, run, _ in loop._table.running()}
        for r in view.running:
            run = runs[r.key]
            want = sum(pool.pages_for(len(run.request.prompt) + len(s.tokens)) for s in run.samples)
            assert r.kv_pages == want > 0
