"""Borrowing in the threaded run: the learner trains on the drained sampler's devices, gives them
back before publishing, and the run equals one without borrowing (tokens bitwise, parameters within
the reduction-order tolerance); the planner picks an open split that the runtime then builds."""

import functools

import jax
import numpy as np
import pytest

from configs import base
from rl.device_split import Split
from rl.runtime.factory import build_driver

TOL = 1e-5  # float32; fsdp over 8 devices instead of 4 reorders the gradient reduction


def tiny_config(borrowing="off", seed=0):
    """sync, a learner of 4 fake devices and 2 sampler replicas of 2."""
    config = base.get_config("smoke")
    config.seed = seed
    config.sft.max_steps = 0
    config.driver.mode, config.driver.batching = "sync", "ordered"
    config.mesh.colocated = False
    config.mesh.learner_devices = 4
    config.mesh.sampler_devices, config.mesh.sampler_replicas = 2, 2
    config.elastic.borrowing = borrowing
    config.elastic.stage_model = "preset:qwen3-1.7b:h100"
    config.elastic.switch_cost_s = 0.0  # any predicted gain moves (the prior, before a measure)
    config.elastic.margin = 0.0
    return config


def run(config, rounds=2):
    runtime, driver = build_driver(config, rounds=rounds)
    try:
        try:
            results = [driver.run_round(r) for r in range(rounds)]
        finally:
            driver.close()
        return results, jax.device_get(runtime.learner.state.params), runtime, driver
    finally:
        runtime.close()


@functools.cache
def static_run(seed):
    return run(tiny_config("off", seed))[:2]


def tokens_of(results):
    return [[(c.uid, c.sample, c.tokens) for g in r.groups for c in g.completions] for r in results]


@pytest.mark.slow  # end-to-end: 2 runs of the threads runtime
@pytest.mark.parametrize("seed", [0, 1])
def test_borrowing_run_equals_static_and_switches_back_each_round(seed):
    static, p_static = static_run(seed)
    borrowed, p_borrowed, runtime, driver = run(tiny_config("learner", seed))
    assert tokens_of(borrowed) == tokens_of(static)
    diff = max(
        float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
        for a, b in zip(jax.tree.leaves(p_static), jax.tree.leaves(p_borrowed), strict=True)
    )
    assert diff <= TOL, diff
    for r in borrowed:  # a decision per round, the move made and its switch measured
        m = r.metrics
        assert m["borrow_learner"] == 1.0 and m["borrow_learner_gain_s"] > 0
        assert m["borrow_learner_measured_s"] > 0
    # the second round's estimate is the first round's measured switch
    assert borrowed[1].metrics["borrow_learner_switch_cost_s"] == pytest.approx(
        borrowed[0].metrics["borrow_learner_measured_s"]
    )
    assert "borrow_learner" not in static[0].metrics
    assert not runtime.learner.borrowing
    names = [s.name for s in driver.timeline.spans("learner")]
    assert names.count("borrow") == names.count("give_back") == 2
    assert runtime.learner.compile_counts()["apply@borrowed"] == 1


@pytest.mark.slow  # the planner's split built as a whole runtime (~15 s cold)
def test_planner_picks_the_open_split_and_the_runtime_builds_it():
    from rl.runtime.compose import Setup
    from rl.runtime.threads import ThreadsRuntime

    config = tiny_config()
    config.mesh.split = "plan"
    config.mesh.learner_devices = config.mesh.sampler_devices = 0
    config.mesh.sampler_replicas = 1  # open: the planner picks the replicas
    runtime = ThreadsRuntime(config, Setup.from_config(config), total_updates=2)
    try:
        plan = runtime.mesh_plan
        assert plan is not None and plan.split.learner_gpus + plan.split.sampler_gpus == 8
        assert len(runtime.learner.mesh.devices.flat) == plan.split.learner_gpus
        assert len(runtime.sampler_devices) == plan.split.sampler_gpus
        assert len(runtime.engines) == plan.split.replicas  # one Engine per planned replica
        assert plan.predicted_round_s == min(s for _, s in plan.rows)
        # buildable: learner fsdp divides 8 rows: 4 + 4, 6 + 2, 7 + 1 sampler + learner
        assert sorted(r for r, _ in plan.rows) == sorted(str(Split(s, 1, 8 - s)) for s in (4, 6, 7))
    finally:
        runtime.close()


@pytest.mark.slow  # end-to-end: 2 runs of the threads runtime
def test_sampler_borrows_the_learners_devices_and_the_run_is_unchanged():
    def config(borrowing):  # 8 groups of 4: more than the sampler's own 2 x 8 slots hold
        c = tiny_config(borrowing)
        c.driver.groups_per_round = 8
        return c

    static, p_static, _, _ = run(config("off"))
    lent, p_lent, runtime, driver = run(config("sampler"))
    assert tokens_of(lent) == tokens_of(static)
    for a, b in zip(jax.tree.leaves(p_static), jax.tree.leaves(p_lent), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # the learner never moved
    for r in lent:
        assert r.metrics["borrow_sampler"] == 1.0 and r.metrics["borrow_sampler_measured_s"] > 0
    spans = driver.timeline.spans("elastic")
    assert [s.args["replicas"] for s in spans] == [2, 2]  # 4 learner devices / 2 per replica
    assert sorted(driver.sampler.loops) == [0, 1]  # the extra replicas left after each round
    slot_lanes = {s.lane for s in driver.timeline.spans("sampler/slot")}
    assert len(slot_lanes) > 2 * 8  # the extra replicas decoded too


def async_config(borrowing, seed=0):
    """async (s = 3, U = 2), 8 groups a round on 2 replicas x 8 slots: a window of 32 samples,
    twice the slots, so requests queue while the learner waits for its next batch."""
    config = tiny_config(borrowing, seed)
    config.driver.mode, config.driver.max_staleness = "async", 3
    config.driver.groups_per_round, config.driver.groups_per_update = 8, 2
    config.sampling.max_new_tokens = 40
    config.engine.max_length = 64
    return config


def versions_of(results):
    return [c.versions for r in results for g in r.groups for c in g.completions]


@pytest.mark.slow  # end-to-end: 2 runs of the threads runtime
@pytest.mark.parametrize("migration", ["off", "always"])
def test_async_lends_the_learners_devices_and_takes_them_back_mid_rollout(migration):
    """BiDiRL's setting: under async the learner's devices decode while it waits for its next
    batch and are taken back once it is complete, samples running there resuming on the
    sampler's own replicas (with migration forced at every step too): every group is trained
    once, every token within the bound, versions in order along each sequence."""
    rounds = 3
    static, _, _, _ = run(async_config("off"), rounds)
    config = async_config("sampler")
    config.elastic.migration = migration
    lent, _, runtime, driver = run(config, rounds)
    keys = lambda results: sorted(g.request.key for r in results for g in r.groups)
    assert keys(lent) == keys(static) and len(keys(lent)) == 8 * rounds
    assert len(driver.timeline.spans("elastic")) >= 1  # lent at least once
    stats = driver.sampler.stats
    assert stats.resumed_sequences == stats.evicted_sequences  # every one taken back resumed
    assert stats.groups_emitted == 8 * rounds
    versions = versions_of(lent)
    assert all(list(v) == sorted(v) for v in versions)  # the versions that drew each token
    assert any(len(set(v)) > 1 for v in versions)  # sequences that really mix versions
    assert max(r.metrics["lag_max"] for r in lent) <= 3
    decided = [r.metrics for r in lent if "borrow_sampler" in r.metrics]
    assert decided and any(m["borrow_sampler"] == 1.0 for m in decided)
    lent_lanes = [s for s in driver.timeline.spans("sampler/slot") if s.args["replica"] >= 2]
    assert sum(s.args["tokens"] for s in lent_lanes) > 0  # the lent replicas decoded
    assert sorted(driver.sampler.loops) == [0, 1]  # and went back


@pytest.mark.slow  # end-to-end: 2 runs of the threads runtime
def test_async_learner_borrows_the_drained_sampler_and_the_run_is_unchanged():
    """s = 0: each update's groups are submitted only after the previous publish, so the sampler
    has drained when the learner trains: it borrows the sampler's devices for every update and
    gives them back before each publish; tokens equal the unborrowed run's bitwise."""

    def config(borrowing):
        c = async_config(borrowing)
        c.driver.max_staleness = 0
        return c

    rounds = 2
    static, p_static, _, _ = run(config("off"), rounds)
    borrowed, p_borrowed, runtime, driver = run(config("learner"), rounds)
    assert tokens_of(borrowed) == tokens_of(static)
    diff = max(
        float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
        for a, b in zip(jax.tree.leaves(p_static), jax.tree.leaves(p_borrowed), strict=True)
    )
    assert diff <= TOL, diff
    names = [s.name for s in driver.timeline.spans("learner")]
    updates = 8 * rounds // 2
    assert names.count("borrow") == names.count("give_back") == updates  # one per update
    assert all(r.metrics["borrow_learner"] == 1.0 for r in borrowed)
    assert not runtime.learner.borrowing
    assert max(r.metrics["lag_max"] for r in borrowed) == 0


@pytest.mark.slow  # end-to-end: a run of the threads runtime
def test_async_borrows_in_both_directions_within_the_bound():
    """BiDiRL's setting both ways: the learner's devices decode while it waits for its next
    batch, and the learner takes the sampler's once the bound has drained it (here the run's last
    updates; tests/learner/test_borrow.py switches between two micro-batches of one Add): every
    group is trained once, within the bound, versions in order."""
    rounds = 3
    both, _, runtime, driver = run(async_config("both"), rounds)
    keys = sorted(g.request.key for r in both for g in r.groups)
    assert len(keys) == len(set(keys)) == 8 * rounds
    versions = versions_of(both)
    assert all(list(v) == sorted(v) for v in versions)
    assert max(r.metrics["lag_max"] for r in both) <= 3
    names = [s.name for s in driver.timeline.spans("learner")]
    assert names.count("borrow") == names.count("give_back") >= 1  # the drained last updates
    assert not runtime.learner.borrowing
    assert sorted(driver.sampler.loops) == [0, 1]  # lent replicas went back
    stats = driver.sampler.stats
    assert stats.resumed_sequences == stats.evicted_sequences
