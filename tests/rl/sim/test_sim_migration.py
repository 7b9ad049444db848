"""The simulator executes the migration policy (rl/elastic/migration.py) as the runtime does."""

import dataclasses

import pytest

from rl.elastic.migration import MigrationConfig
from rl.elastic.stage import StageModel
from rl.sim.compare import sim_config
from rl.sim.simulator import Simulator
from rl.sim.workload import Workload, WorkloadConfig
from rl.timeline import SLOT_PREFIX

GPU_LIKE = StageModel(
    decode_a=0.005,
    decode_b=1e-5,
    decode_c=3e-8,
    prefill_per_token=1e-5,
    learner_per_token=1e-5,
    learner_fixed=0.02,
    update_s=0.07,
    micro_batch_rows=8,
    publish_fixed=1.0,
    migrate_fixed=0.01,
    migrate_per_byte=1 / 450e9,
    kv_bytes_per_token=114688,
)
WORKLOAD = WorkloadConfig(max_new_tokens=2048, median_tokens=300, runaway_fraction=0.2)


def simulate(policy, seed, routing="round_robin", replicas=4, mode="cgp+frontier+ordered"):
    cfg = sim_config(
        mode,
        groups_per_round=16,
        groups_per_update=2,
        group_size=4,
        max_new_tokens=2048,
        slots=16,
        replicas=replicas,
        routing=routing,
        migration=MigrationConfig(policy=policy, max_running_fraction=0.5),
        migration_consumer=True,  # the mechanism, forced on (no consumer in one pipeline)
    )
    sim = Simulator(cfg, GPU_LIKE, Workload(dataclasses.replace(WORKLOAD, seed=seed)))
    return sim.run(3), sim


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("routing", ["round_robin", "shared"])
def test_migration_moves_work_and_loses_nothing(seed, routing):
    static, _ = simulate("off", seed, routing, mode="async+frontier+s1")
    moved, sim = simulate("tail", seed, routing, mode="async+frontier+s1")
    assert sum(r["migrations"] for r in moved.rounds) > 0
    assert all(r["migrations"] == 0 for r in static.rounds)
    for a, b in zip(static.rounds, moved.rounds, strict=True):  # same work, counted once
        assert a["sequences"] == b["sequences"] and a["sampler_tokens"] == b["sampler_tokens"]
        assert a["groups_trained"] == b["groups_trained"]
    assert moved.counters["tokens"] == static.counters["tokens"]
    for rep in sim.sampler.replicas:  # no slot leaked or left reserved
        assert all(s is None for s in rep.seqs) and not rep.reserved and not rep.incoming
    # after a move, the request's sequences continue on the destination
    moves = [s for s in moved.timeline.spans("sampler/migrate")]
    slots = moved.timeline.spans(SLOT_PREFIX)
    for m in moves:
        after = [s for s in slots if s.args["uid"] == m.args["uid"] and s.start >= m.end]
        after = [s for s in after if s.args["round"] == m.args["round"]]
        first = min(s.start for s in after)  # its next segment runs on the destination
        lanes = {int(s.lane[len(SLOT_PREFIX) :]) for s in after if s.start == first}
        assert {lane // 16 for lane in lanes} == {m.args["dst"]}
    # consolidation frees replica time: fewer replica-seconds busy
    assert moved.counters["replica_busy_s"] < static.counters["replica_busy_s"]
