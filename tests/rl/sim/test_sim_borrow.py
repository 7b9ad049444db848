"""Borrowing in the simulator: the same policy object decides, moves change timing, never which
groups are trained; a switch cost no gain beats leaves the static split's run unchanged."""

import dataclasses

import pytest

from rl.elastic.borrowing import BorrowConfig, BorrowPolicy
from rl.elastic.stage import StageModel
from rl.sim.borrow import SimBorrower
from rl.sim.compare import sim_config, summarize
from rl.sim.simulator import Simulator
from rl.sim.workload import Workload, WorkloadConfig

MODEL = StageModel(  # sampler throughput-bound at 2 replicas x 8 slots; a learner of 2 devices
    decode_a=0.005,
    decode_b=1e-4,
    learner_per_token=2e-5,
    learner_fixed=0.02,
    update_s=0.05,
    micro_batch_rows=8,
    publish_fixed=0.5,
)
WORKLOAD = WorkloadConfig(max_new_tokens=512, median_tokens=150, runaway_fraction=0.0)


def simulate(mode, borrowing, *, seed, cost=0.2, rounds=3):
    cfg = sim_config(
        mode, groups_per_round=12, groups_per_update=2, group_size=4, replicas=2, slots=8
    )
    borrow = None
    if borrowing != "off":
        policy = BorrowPolicy(
            BorrowConfig(borrowing=borrowing, switch_cost_s=cost),
            MODEL,
            model_learner_devices=2,
        )
        borrow = SimBorrower(policy, learner_devices=2)
    workload = Workload(dataclasses.replace(WORKLOAD, seed=seed))
    return Simulator(cfg, MODEL, workload, borrow=borrow).run(rounds), borrow


def trained(result):
    return [(r["groups_trained"], r["kind"]) for r in result.rounds]


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("mode", ["sync", "cgp+frontier+fifo"])
def test_borrowing_changes_timing_not_what_is_trained(mode, seed):
    static, _ = simulate(mode, "off", seed=seed)
    both, borrow = simulate(mode, "both", seed=seed)
    assert trained(both) == trained(static) == [(12.0, "plain")] * 3
    assert both.counters["groups_emitted"] == static.counters["groups_emitted"] == 36
    for r in both.rounds:  # every round decided, with its predicted gain and the switch cost
        assert any(k.startswith("borrow_") and k.endswith("_gain_s") for k in r)
    if mode == "sync":  # sync: the learner idles through the rollout and the sampler after it
        assert borrow.moves["sampler"] == 3 and borrow.moves["learner"] == 3
        assert summarize(both)["groups_per_s"] > summarize(static)["groups_per_s"]
        lends = both.timeline.spans("elastic")
        assert len(lends) == 3 and all(s.args["replicas"] == 2 for s in lends)
    assert len(both.timeline.spans("learner")) >= len(static.timeline.spans("learner"))


def test_a_switch_cost_no_gain_beats_leaves_the_static_run_unchanged():
    static, _ = simulate("sync", "off", seed=0)
    never, borrow = simulate("sync", "both", seed=0, cost=1e6)
    assert borrow.moves == {"learner": 0, "sampler": 0}
    keys = ("round_s", "rollout_to_train_end_s", "trainer_wait_ratio")
    assert [[r[k] for k in keys] for r in never.rounds] == [
        [r[k] for k in keys] for r in static.rounds
    ]
    assert never.rounds[0]["borrow_learner"] == 0.0
    assert never.rounds[0]["borrow_learner_switch_cost_s"] == 1e6
