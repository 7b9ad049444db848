"""Pipeline multiplexing in the simulator (rl/sim/multiplex.py): pipelines share replicas and the
learner, never at once, and each trains what it trains alone; one pipeline is its solo run."""

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rl.elastic.migration import MigrationConfig
from rl.elastic.multiplex import MultiplexConfig
from rl.elastic.stage import StageModel
from rl.sim.compare import sim_config
from rl.sim.multiplex import MultiplexSim, compare_multiplexing
from rl.sim.simulator import Simulator
from rl.sim.workload import Workload, WorkloadConfig

MODEL = StageModel(
    decode_a=0.005,
    decode_b=1e-4,
    decode_c=1e-7,
    learner_per_token=4e-5,
    learner_fixed=0.02,
    update_s=0.05,
    micro_batch_rows=8,
    publish_fixed=0.5,
    migrate_fixed=0.01,
)
WORKLOAD = WorkloadConfig(max_new_tokens=512, median_tokens=150)
FIELDS = dict(groups_per_round=12, groups_per_update=2, group_size=4, replicas=4, slots=12)


def configs(mode, n, migration="tail", **kw):
    """n pipelines of `mode`; migration "on_demand": `tail` consolidating only what the pool
    recalls (the multiplexed pool's setting)."""
    mig = (
        MigrationConfig(policy="tail", on_demand=True)
        if migration == "on_demand"
        else MigrationConfig(policy=migration)
    )
    return [sim_config(mode, **(FIELDS | kw), migration=mig, migration_consumer=True)] * n


def workloads(n, **kw):
    return [Workload(dataclasses.replace(WORKLOAD, seed=i, **kw)) for i in range(n)]


def slot_intervals(result, replica, slots):
    lanes = {f"sampler/slot{replica * slots + k}" for k in range(slots)}
    return [(s.start, s.end) for s in result.timeline.spans("sampler/slot") if s.lane in lanes]


def check_pool(res, n, slots):
    """Every pipeline trained its rounds whole; no replica served two pipelines at once."""
    for p in res.pipelines:
        assert all(r["groups_trained"] == FIELDS["groups_per_round"] for r in p.rounds)
        assert p.counters["groups_emitted"] == sum(r["groups_trained"] for r in p.rounds)
    for replica in range(FIELDS["replicas"]):
        spans = sorted(
            (start, end, i)
            for i, p in enumerate(res.pipelines)
            for start, end in slot_intervals(p, replica, slots)
        )
        busy = {}  # pipeline -> its latest end on this replica
        for start, end, i in spans:
            for j, last in busy.items():
                assert j == i or last <= start + 1e-9, (replica, i, j)
            busy[i] = max(busy.get(i, 0.0), end)
    learner = sorted(  # the initial weights (round -1) are placed before any learner work
        (s.start, s.end)
        for p in res.pipelines
        for s in p.timeline.spans("learner") + p.timeline.spans("publish")
        if s.args.get("round") != -1
    )
    for (_, end), (start, _) in zip(learner, learner[1:], strict=False):
        assert end <= start + 1e-9  # one learner operation (or publish) at a time


@pytest.mark.parametrize("mode", ["sync", "cgp+frontier+fifo", "async+frontier+s1"])
def test_one_pipeline_multiplexed_is_its_solo_run(mode):
    cfg = configs(mode, 1, migration="off")[0]
    solo = Simulator(cfg, MODEL, workloads(1)[0]).run(3)
    res = MultiplexSim([cfg], MODEL, workloads(1)).run(3)
    assert res.end_s == solo.end_s
    assert res.pipelines[0].rounds == solo.rounds
    assert res.counters["replica_switches"] == res.counters["learner_switches"] == 0


@pytest.mark.parametrize("mode", ["sync", "cgp+frontier+fifo", "async+frontier+s1"])
@pytest.mark.parametrize("n", [2, 3])
def test_pipelines_share_replicas_and_the_learner_never_at_once(mode, n):
    res = MultiplexSim(configs(mode, n), MODEL, workloads(n)).run(3)
    check_pool(res, n, FIELDS["slots"])
    assert res.counters["learner_switches"] > 0
    if mode != "async+frontier+s1":  # between rounds, replicas move; round modes stay on-policy
        assert res.counters["replica_switches"] > 0
        assert all(r["lag_max"] == 0 for p in res.pipelines for r in p.rounds)


def test_each_pipeline_trains_what_it_trains_alone():
    solo = [
        Simulator(cfg, MODEL, w).run(3)
        for cfg, w in zip(configs("sync", 2), workloads(2), strict=True)
    ]
    res = MultiplexSim(configs("sync", 2), MODEL, workloads(2)).run(3)
    for alone, p in zip(solo, res.pipelines, strict=True):
        keys = ("groups_trained", "groups_launched", "version", "kind")
        assert [[r[k] for k in keys] for r in p.rounds] == [
            [r[k] for k in keys] for r in alone.rounds
        ]
        assert p.counters["tokens"] == alone.counters["tokens"]
        assert p.end_s >= alone.end_s - 1e-9  # sharing never makes one faster than alone


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    n=st.integers(2, 3),
    mode=st.sampled_from(["sync", "cgp+frontier+fifo", "async+frontier+s1", "sync+tail"]),
    policy=st.sampled_from(["lookahead", "greedy"]),
    switch_s=st.sampled_from([0.0, 0.3, 2.0]),
    learner_switch_s=st.sampled_from([0.0, 0.2]),
    migration=st.sampled_from(["off", "tail", "always", "on_demand"]),
    spread_min=st.sampled_from([0, 2, 64]),
)
def test_random_lengths_and_decisions_finish_every_request_once_and_leave_the_pool_clean(
    seed, n, mode, policy, switch_s, learner_switch_s, migration, spread_min
):
    mux = MultiplexConfig(
        policy=policy,
        switch_s=switch_s,
        learner_switch_s=learner_switch_s,
        spread_min=spread_min,
    )
    sim = MultiplexSim(
        configs(mode, n, migration=migration),
        MODEL,
        [Workload(dataclasses.replace(WORKLOAD, seed=seed + i)) for i in range(n)],
        mux,
    )
    res = sim.run(2)
    check_pool(res, n, FIELDS["slots"])
    for p in res.pipelines:
        keys = [(e.args["round"], e.args["uid"]) for e in p.timeline.instants("sampler/groups")]
        assert len(keys) == len(set(keys)) == p.counters["groups_emitted"]  # each once
    assert not sim.arriving and not sim.learner_held
    for i, s in enumerate(sim.sims):  # nothing left running, held or owned twice
        assert s.sampler.outstanding == 0 and s.learner.idle
        for rep in s.sampler.replicas:
            assert rep.vacant and rep.parked == (sim.owner[rep.index] != i)
            assert not rep.leaving  # every recall ended: moved, or kept once nobody waited


def test_multiplexing_beats_a_static_partition_and_back_to_back_within_its_bound():
    row = compare_multiplexing(
        "sync",
        MODEL,
        [dataclasses.replace(WORKLOAD, seed=i) for i in range(2)],
        rounds=3,
        **FIELDS,
    )
    assert row["groups"] == 2 * 3 * FIELDS["groups_per_round"]
    assert 1.0 < row["vs_static"] <= row["bound_vs_static"] + 1e-9
    assert row["vs_back_to_back"] > 1.0


def test_the_pool_gantt_puts_each_replica_and_the_learner_on_one_row(tmp_path):
    res = MultiplexSim(configs("sync", 2), MODEL, workloads(2)).run(2)
    pool = res.pool_timeline()
    lanes = {s.lane for s in pool.spans()}
    assert lanes <= {"learner"} | {f"pool/replica{i}" for i in range(FIELDS["replicas"])}
    sequences = [s for s in pool.spans("pool/replica") if s.name != "switch"]
    assert {s.args["pipeline"] for s in sequences} == {0, 1}
    assert any(s.name == "switch" for s in pool.spans("pool/replica"))
    learner = sorted((s.start, s.end) for s in pool.spans("learner"))
    assert all(a[1] <= b[0] + 1e-9 for a, b in zip(learner, learner[1:], strict=False))
    res.write_gantt_png(str(tmp_path / "pool.png"), "2 x sync")
    assert (tmp_path / "pool.png").stat().st_size > 0


def test_bad_pools_are_refused_with_what_was_expected():
    with pytest.raises(ValueError, match="routing"):
        MultiplexSim(configs("sync", 2, routing="round_robin"), MODEL, workloads(2))
    with pytest.raises(ValueError, match="contention"):
        MultiplexSim(configs("sync", 2), MODEL.replace(contention=0.5), workloads(2))
    with pytest.raises(ValueError, match="one workload per pipeline"):
        MultiplexSim(configs("sync", 2), MODEL, workloads(1))
    with pytest.raises(ValueError, match="pipelines <= replicas"):
        compare_multiplexing("sync", MODEL, [WORKLOAD] * 5, rounds=1, **FIELDS)


def test_replicas_spread_onto_a_busy_rollout_and_are_recalled_for_a_waiting_one():
    """A replica nobody's queue needs joins the densest rollout (its migration moves running
    requests there); when another pipeline's queue waits, the pool recalls one and its
    sequences move to their rollout's other replicas. Same groups, every request once."""
    mux = MultiplexConfig(switch_s=0.1, spread_min=2)
    sim = MultiplexSim(configs("sync", 3, migration="on_demand"), MODEL, workloads(3), mux)
    res = sim.run(3)
    check_pool(res, 3, FIELDS["slots"])
    assert res.counters["recalls"] > 0 and res.counters["replica_switches"] > 0
    moved = sum(p.counters["migrations"] for p in res.pipelines)
    assert moved > 0  # spreads and evacuations are migrations
    for i, p in enumerate(res.pipelines):
        alone = Simulator(configs("sync", 1)[0], MODEL, workloads(3)[i]).run(3)
        assert p.counters["tokens"] == alone.counters["tokens"]
