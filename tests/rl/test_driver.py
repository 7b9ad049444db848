"""The driver: pipelining changes timing, never the math; no group lost; errors stop both sides."""

import dataclasses
import itertools
import json
import time

import jax
import numpy as np
import pytest

from learner.config import LearnerConfig, OptimizerConfig
from learner.learner import Learner
from learner.mesh import MeshConfig, make_meshes
from learner.publish import DevicePutSync
from rl.driver import Driver, DriverConfig
from rl.envs import EnvRunner, Turn
from rl.models import create_model, get_preset
from rl.round_planner import TailConfig
from rl.runtime.threads import threaded_driver
from rl.types import Prompt, SamplingParams
from sampler.engine import Engine, EngineConfig

SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=6)


def prompts(seed=0):
    rng = np.random.default_rng(seed)
    for uid in itertools.count():
        yield Prompt(
            uid=uid, tokens=tuple(int(t) for t in rng.integers(0, 256, int(rng.integers(3, 9))))
        )


def parity_reward(request, completion):
    return float(completion.tokens[0] % 2)


def build(
    mode="cgp",  # sync | cgp | async
    batching="ordered",
    admission="frontier",
    R=4,
    U=2,
    G=2,
    queue_size=0,
    reward_fn=parity_reward,
    learner_cls=Learner,
    seed=0,
    tail=None,
    epoch_size=0,
    max_new_tokens=6,
    micro_batch_rows=0,
    driver_cls=Driver,
    max_staleness=0,
    group_atomic=True,
    recompute_kv=False,
    dynamic_sampling=False,
    max_oversample=3.0,
    environment=None,
    stop_token_ids=(),
):
    lm, sm = make_meshes(MeshConfig(learner_devices=1, sampler_devices=1))
    model = create_model(get_preset("tiny", init_std=0.3), seed=seed)
    learner = learner_cls(
        model,
        LearnerConfig(
            optimizer=OptimizerConfig(lr=1e-2), micro_batch_rows=micro_batch_rows or U * G
        ),
        mesh=lm,
    )
    engine = Engine(
        model,
        EngineConfig(
            max_slots=4,
            max_length=32,
            max_prefill_length=16,
            steps_per_call=2,
            max_stop_tokens=max(4, len(stop_token_ids)),
        ),
        mesh=sm,
    )
    cfg = DriverConfig(
        mode=mode,
        admission=admission,
        batching=batching,
        groups_per_round=R,
        groups_per_update=U,
        group_size=G,
        sampling=dataclasses.replace(
            SAMPLING, max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids
        ),
        queue_size=queue_size,
        tail=tail or TailConfig(),
        epoch_size=epoch_size,
        max_staleness=max_staleness,
        group_atomic=group_atomic,
        recompute_kv=recompute_kv,
        dynamic_sampling=dynamic_sampling,
        max_oversample=max_oversample,
    )
    return threaded_driver(
        cfg,
        driver_cls=driver_cls,
        engine=engine,
        learner=learner,
        weight_sync=DevicePutSync(learner.params, sm),
        prompts=prompts(seed),
        reward_fn=reward_fn,
        environment=environment,
    )


def run(driver, rounds=3):
    try:
        return [driver.run_round(r) for r in range(rounds)]
    finally:
        driver.close()


def tokens_of(results):
    return [
        [(g.request.uid, c.sample, c.tokens) for g in r.groups for c in g.completions]
        for r in results
    ]


@pytest.mark.parametrize(
    "U",
    [pytest.param(4, marks=pytest.mark.slow), 2],
    ids=["S=1", "S=2"],  # ~14 s cold each
)
def test_cgp_ordered_equals_sync(U):
    sync_driver, cgp_driver = build("sync", U=U), build("cgp", "ordered", U=U)
    sync, cgp = run(sync_driver), run(cgp_driver)
    assert tokens_of(sync) == tokens_of(cgp)
    assert [r.version for r in cgp] == [0, 1, 2]
    for a, b in zip(
        jax.tree.leaves(sync_driver.learner.params),
        jax.tree.leaves(cgp_driver.learner.params),
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for r in cgp:  # every token of round r was sampled by policy version r
        assert {v for g in r.groups for c in g.completions for v in c.versions} == {r.round}


class Relay:
    """A deterministic environment: each turn is answered with its first token and a 7, rewarded
    by that token's parity; done after 3 turns."""

    def step(self, request, transcript):
        turn = transcript.turns[-1]
        n = len(transcript.turns)
        return Turn(observation=(turn[0], 7), reward=float(turn[0] % 2), done=n >= 3)


@pytest.mark.slow  # ~25 s cold
def test_cgp_ordered_equals_sync_for_multi_turn_episodes():
    """Multi-turn episodes (observations appended between turns, environment answers arriving
    whenever they do) keep complete-group pipelining exact: the tokens and parameters of sync."""
    kw = dict(max_new_tokens=12, stop_token_ids=tuple(range(0, 256, 5)))
    with EnvRunner(Relay(), vocab_size=256, max_turns=3) as env:
        sync_driver = build("sync", environment=env, **kw)
        cgp_driver = build("cgp", "ordered", environment=env, **kw)
        sync, cgp = run(sync_driver), run(cgp_driver)
    assert tokens_of(sync) == tokens_of(cgp)
    completions = [c for r in cgp for g in r.groups for c in g.completions]
    assert sum(len(c.turn_rewards) > 1 for c in completions) >= len(completions) // 4
    assert [r.version for r in cgp] == [0, 1, 2]
    for a, b in zip(
        jax.tree.leaves(sync_driver.learner.params),
        jax.tree.leaves(cgp_driver.learner.params),
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_per_sample_admission_trains_the_same_tokens_and_params_as_group_atomic():
    """group_atomic=False starts samples one by one in other slots and steps (G = 3 on 4 slots);
    on-policy rounds then train the same tokens into the same parameters."""
    atomic, single = build("cgp", G=3), build("cgp", G=3, group_atomic=False)
    a, s = run(atomic, rounds=2), run(single, rounds=2)
    assert tokens_of(a) == tokens_of(s)
    assert single.sampler.stats.prefills == 2 * 4 * 3  # one prefill per sample
    for x, y in zip(
        jax.tree.leaves(atomic.learner.params), jax.tree.leaves(single.learner.params), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    with pytest.raises(ValueError, match="group_atomic must be a bool; received 'no'"):
        DriverConfig(group_atomic="no")


def test_async_without_staleness_equals_cgp_ordered_and_sync_bitwise():
    """async s=0 publishes after every update and submits the next update's groups after it; with
    U = R (one update per round) that is the on-policy round schedule: same tokens, same params."""
    drivers = [build("sync", U=4), build("cgp", "ordered", U=4), build("async", U=4)]
    results = [run(d) for d in drivers]
    assert tokens_of(results[0]) == tokens_of(results[1]) == tokens_of(results[2])
    assert [r.version for r in results[2]] == [0, 1, 2]
    for d in drivers[1:]:
        for a, b in zip(
            jax.tree.leaves(drivers[0].learner.params),
            jax.tree.leaves(d.learner.params),
            strict=True,
        ):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for r in results[2]:
        assert {v for g in r.groups for c in g.completions for v in c.versions} == {r.round}
        assert r.metrics["lag_max"] == 0.0


def test_async_with_staleness_trains_every_prompt_once_within_the_bound():
    driver = build("async", U=2, max_staleness=2)
    results = run(driver, rounds=3)
    assert sorted(g.request.uid for r in results for g in r.groups) == list(range(12))
    assert driver.version == 6  # a publish after every update
    for r in results:
        assert [g.request.index for g in r.groups] == [0, 1, 2, 3]  # logical order
        assert 0.0 <= r.metrics["lag_mean"] <= r.metrics["lag_max"] <= 2.0
        # every metric of the learner and its loss reaches the round's (logged) metrics
        logged = {"ess", "logprob_diff_abs", "logprob_kl", "clip_frac_low", "clip_frac_high"}
        assert logged <= set(r.metrics) and 0.0 < r.metrics["ess"] <= 1.0 + 1e-6


@pytest.mark.parametrize("group_atomic", [True, False], ids=["group", "per-sample"])
def test_async_with_recompute_kv_trains_every_prompt_once_within_the_bound(group_atomic):
    """recompute_kv re-prefills running samples at each swap (when a swap meets some is timing):
    nothing lost or doubled, every token's version within the bound."""
    driver = build("async", U=2, max_staleness=1, recompute_kv=True, group_atomic=group_atomic)
    results = run(driver, rounds=2)
    assert sorted(g.request.uid for r in results for g in r.groups) == list(range(8))
    for r in results:
        assert 0.0 <= r.metrics["lag_mean"] <= r.metrics["lag_max"] <= 1.0
        for g in r.groups:
            for c in g.completions:
                assert len(c.tokens) == len(c.logprobs) == len(c.versions) == 6
                assert list(c.versions) == sorted(c.versions)  # versions only move forward
    with pytest.raises(
        ValueError, match="recompute_kv=True needs mode='async'; received mode='cgp'"
    ):
        DriverConfig(mode="cgp", recompute_kv=True)


def test_async_checkpoint_rounds_leave_nothing_in_flight_and_a_resume_continues_exactly():
    """barrier_every=2: after round 1 nothing is in flight and exactly rounds 0-1's prompts are
    drawn, so a driver rebuilt from (params, version, data position) trains round 2 as the
    uninterrupted one does (s = 0: the tokens are deterministic)."""
    full = _with_barrier(max_staleness=2)
    try:
        full.run_round(0)
        assert full.planner.state_dict()["drawn"] == 8  # round 0 is no barrier: round 1 started
        full.run_round(1)
        assert full.sampler.pending() == 0 and full.queue.qsize() == 0
        assert full.planner.state_dict()["drawn"] == 8  # rounds 0 and 1, nothing more
    finally:
        full.close()

    a = _with_barrier(max_staleness=0)
    results = run(a, rounds=3)
    b = _with_barrier(max_staleness=0)
    run(b, rounds=2)
    c = _with_barrier(max_staleness=0, version=b.version, skip=8)
    c.learner.state = b.learner.state  # what a checkpoint restores: params, optimizer, step
    c.sampler.set_params(c._publish(b.version, round=-1), b.version)
    resumed = c.run_round(2)
    c.close()
    assert tokens_of([resumed]) == tokens_of(results[2:])
    for x, y in zip(
        jax.tree.leaves(a.learner.params), jax.tree.leaves(c.learner.params), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_async_no_bubble_checkpoints_keep_sampling_and_a_resume_trains_each_prompt_once():
    """keep_sampling: at the checkpoint after round 1 round 2 is already drawn and sampling (no
    bubble) but untrained; a driver rebuilt from (params, version, data position, in-flight
    prompts) samples those again first and trains round 2 on the same prompts, once."""
    full = _with_barrier(max_staleness=2, keep_sampling=True)
    try:
        full.run_round(0)
        full.run_round(1)
        in_flight = full.schedule.in_flight()
        assert [p.uid for p in in_flight] == [8, 9, 10, 11]  # round 2: drawn, not trained
        assert full.learner.step == 4  # rounds 0 and 1 only: the learner waited at the barrier
        assert full.planner.state_dict()["drawn"] == 12
        version, state = full.version, full.learner.state
    finally:
        full.close()
    resumed = _with_barrier(max_staleness=2, keep_sampling=True, version=version, skip=12)
    try:
        resumed.learner.state = state
        resumed.sampler.set_params(resumed._publish(version, round=-1), version)
        resumed.planner.load_state_dict(full.planner.state_dict())
        resumed.planner.replay(in_flight)
        result = resumed.run_round(2)
    finally:
        resumed.close()
    assert [g.request.uid for g in result.groups] == [8, 9, 10, 11]
    assert resumed.learner.step == 6
    exact = _with_barrier(max_staleness=2)
    try:
        exact.run_round(0)
        exact.run_round(1)
        assert exact.schedule.in_flight() == []  # exact: nothing drawn past the barrier
    finally:
        exact.close()


def _with_barrier(max_staleness, version=0, skip=0, keep_sampling=False):
    """An async driver with barrier_every=2 (build's pieces; the prompt source can skip ahead)."""

    class Barrier(Driver):
        def __init__(self, cfg, **kw):
            kw["prompts"] = itertools.islice(kw["prompts"], skip, None)
            super().__init__(
                cfg,
                **kw,
                version=version,
                rounds=3,
                barrier_every=2,
                keep_sampling=keep_sampling,
            )

    return build("async", U=2, max_staleness=max_staleness, driver_cls=Barrier)


def flat_on_even_uids(request, completion):
    """Even prompts: every sample rewarded alike (zero variance); odd: parity of the first token."""
    return 0.5 if request.uid % 2 == 0 else parity_reward(request, completion)


def test_dynamic_sampling_refills_rounds_of_zero_variance_groups_and_keeps_training():
    kw = dict(G=4, reward_fn=flat_on_even_uids, dynamic_sampling=True, max_oversample=4.0)
    sync_driver, cgp_driver = build("sync", **kw), build("cgp", "ordered", **kw)
    sync, cgp = run(sync_driver), run(cgp_driver)
    assert tokens_of(sync) == tokens_of(cgp)  # refills change which groups, not the math
    for a, b in zip(
        jax.tree.leaves(sync_driver.learner.params),
        jax.tree.leaves(cgp_driver.learner.params),
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    discarded = 0
    for r in cgp:
        assert all(len(set(g.rewards)) > 1 for g in r.groups)  # only informative groups train
        assert r.metrics["groups_trained"] == len(r.groups) == 4  # refilled to R
        assert r.metrics["prompts_drawn"] == 4 + r.metrics["groups_discarded"]
        assert r.metrics["groups_discarded"] >= 2  # every even prompt of the first four
        assert len(r.updates) == 2 and all(m["groups"] == 2 for m in r.updates)
        discarded += r.metrics["groups_discarded"]
    assert cgp_driver.learner.step == 6
    trained = [g.request.uid for r in cgp for g in r.groups]
    assert len(set(trained)) == 12 and all(uid % 2 == 1 for uid in trained)
    assert max(trained) < sum(r.metrics["prompts_drawn"] for r in cgp) == 12 + discarded


def test_cgp_fifo_trains_the_same_groups_as_sync():
    sync, fifo = run(build("sync")), run(build("cgp", "fifo", admission="fcfs"))
    for a, b in zip(sync, fifo, strict=True):
        key = lambda g: (g.request.uid, tuple(c.tokens for c in g.completions))
        assert sorted(map(key, a.groups)) == sorted(map(key, b.groups))


class SlowLearner(Learner):
    def add_groups(self, groups):
        time.sleep(0.3)
        super().add_groups(groups)


def test_slow_learner_with_backpressure_loses_and_doubles_nothing():
    driver = build("cgp", "fifo", R=6, U=1, queue_size=1, learner_cls=SlowLearner)
    results = run(driver, rounds=2)
    for r, res in enumerate(results):
        assert sorted(g.request.uid for g in res.groups) == list(range(6 * r, 6 * r + 6))
    assert driver.queue.max_depth <= 1 and driver.queue.puts == driver.queue.gets == 12


class Boom(Exception):
    pass


class FailingLearner(Learner):
    def update(self):
        if self.step == 1:
            raise Boom("learner fell over at update 1")
        return super().update()


def test_learner_failure_stops_both_sides_with_the_original_error():
    driver = build("cgp", learner_cls=FailingLearner)
    with pytest.raises(Boom, match="learner fell over"):
        run(driver)
    assert not driver.sampler.loops[0]._thread.is_alive()
    assert driver.learner.step == 1


def test_sampler_failure_stops_the_round_promptly():
    calls = []

    def reward(request, completion):
        calls.append(request.uid)
        if len(calls) == 3:
            raise Boom("verifier crashed")
        return 0.0

    driver = build("cgp", reward_fn=reward)
    start = time.monotonic()
    with pytest.raises(Boom, match="verifier crashed"):
        run(driver)
    assert time.monotonic() - start < 60
    assert driver.learner.step <= 1


def test_timeline_written_with_sampler_and_learner_lanes(tmp_path):
    driver = build("cgp")
    results = run(driver, rounds=1)
    m = results[0].metrics
    assert 0 < m["first_dispatch_s"] <= m["rollout_to_train_end_s"]
    assert 0.0 <= m["trainer_wait_ratio"] <= 1.0
    driver.timeline.write_chrome_trace(tmp_path / "trace.json")
    driver.timeline.write_gantt_png(tmp_path / "gantt.png")
    trace = json.loads((tmp_path / "trace.json").read_text())
    names = {
        e["args"]["name"]
        for e in trace["traceEvents"]
        if e.get("ph") == "M" and e["name"] == "thread_name"
    }
    assert any(n.startswith("sampler/slot") for n in names) and "learner" in names
    assert (tmp_path / "gantt.png").stat().st_size > 10_000


@pytest.mark.parametrize(
    "mode,batching,U", [("sync", "ordered", 2), ("cgp", "ordered", 2), ("cgp", "fifo", 4)]
)
def test_tail_batching_trains_every_prompt_of_the_epoch_exactly_once(mode, batching, U):
    """Short rounds launch 6 prompts and train the first 4 complete; the 2 cut ones wait in the
    long queue; long rounds run 4 of them; the epoch of 14 prompts ends with a flush round."""
    tail = TailConfig(enabled=True, eta=1.5, long_max_new_tokens=10)
    driver = build(mode, batching, R=4, U=U, G=2, tail=tail, epoch_size=14)
    results = []
    try:
        for r in range(20):
            results.append(driver.run_round(r))
            if driver.planner.epoch_complete:
                break
    finally:
        driver.close()
    assert driver.planner.epoch_complete
    trained = [g.request.uid for res in results for g in res.groups]
    assert sorted(trained) == list(range(14))
    kinds = [res.kind for res in results]
    assert kinds[0] == "short" and "long" in kinds and kinds[-1] == "flush", kinds
    for res in results:
        n = len(res.groups)
        assert n == 4 or res.kind == "flush"
        assert len(res.updates) == -(-n // U)  # U = R: the stream trainer's one deferred update
        assert res.metrics["groups_trained"] == n
        caps = {g.request.params.max_new_tokens for g in res.groups}
        assert caps == ({10} if res.kind in ("long", "flush") else {6})
        if res.kind == "short":
            assert res.metrics["aborted_prompts"] == 2
    assert driver.sampler.pending() == 0 and driver.sampler.busy_slots() == 0


class OneLongGroup(Driver):
    """Index 0 of every round answers with 24 tokens, the others with 2."""

    def _requests(self, plan):
        return [
            dataclasses.replace(
                r, params=dataclasses.replace(r.params, max_new_tokens=24 if r.index == 0 else 2)
            )
            for r in super()._requests(plan)
        ]


def test_stream_trainer_accumulates_during_rollout_and_updates_once():
    """S = 1 (U = R) with fifo batches: each group's gradients are accumulated as it arrives (one
    micro-batch per group here), while the long group still decodes; one update after the round."""
    driver = build(
        "cgp", "fifo", R=4, U=4, G=2, micro_batch_rows=2, max_new_tokens=24, driver_cls=OneLongGroup
    )
    (result,) = run(driver, rounds=1)
    assert len(result.updates) == 1 and len(result.groups) == 4
    spans = driver.timeline.spans()
    micro = sorted(s.start for s in spans if s.name == "micro_step" and s.args.get("round") == 0)
    slot_ends = [
        s.end for s in spans if s.lane.startswith("sampler/slot") and s.args.get("round") == 0
    ]
    assert len(micro) == 4  # one accumulation per arriving group
    assert micro[0] < max(slot_ends)  # training began before the rollout ended


def _slow_parity(request, text):
    """parity_reward's value from a verifier that takes 1-8 ms, varying by prompt and sample."""
    time.sleep(0.001 * (1 + (request.uid * 7 + len(text) * 3) % 8))
    return float(text[0] % 2)


@pytest.mark.parametrize(
    "mode,batching,tail",
    [
        ("cgp", "fifo", None),
        ("cgp", "ordered", TailConfig(enabled=True, eta=1.5, long_max_new_tokens=10)),
    ],
    ids=["fifo", "ordered-tail"],
)
def test_rewards_off_the_decode_thread_train_the_same_groups_in_the_same_order(
    mode, batching, tail
):
    """A RewardRunner scores finished samples on worker threads while decoding goes on, its calls
    returning out of order; the groups (and their order), tokens, rewards and trained parameters
    are those of the inline reward, bitwise."""
    from rl.rewards import RewardRunner

    runner = RewardRunner(_slow_parity, decode=tuple, timeout_s=30.0, workers=3)
    inline = build(mode, batching, U=2, tail=tail, epoch_size=14 if tail else 0)
    offloaded = build(mode, batching, U=2, tail=tail, epoch_size=14 if tail else 0,
                      reward_fn=runner)  # fmt: skip
    try:
        a, b = run(inline, rounds=4), run(offloaded, rounds=4)
    finally:
        runner.close()
    assert runner.calls > 0 and runner.timeouts == runner.errors == 0
    assert offloaded.sampler.loops[0]._submit_reward is not None  # the off-thread path ran

    def trained(results):
        return [
            [(g.request.uid, c.sample, c.tokens, c.reward) for g in r.groups for c in g.completions]
            for r in results
        ]

    assert trained(a) == trained(b)
    assert [r.kind for r in a] == [r.kind for r in b]
    for x, y in zip(
        jax.tree.leaves(inline.learner.params),
        jax.tree.leaves(offloaded.learner.params),
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
