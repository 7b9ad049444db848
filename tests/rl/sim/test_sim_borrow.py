"""Borrowing in the simulator: the same policy object decides, moves change timing, never which
groups are trained; a switch cost no gain beats leaves the static split's run unchanged."""

import dataclasses
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rl.elastic.borrowing import BorrowConfig, BorrowPolicy
from rl.elastic.stage import StageModel
from rl.sim.borrow import SimBorrower
from rl.sim.bounds import predrain_bound
from rl.sim.compare import sim_config, summarize
from rl.sim.simulator import SimConfig, SimResult, Simulator
from rl.sim.workload import Workload, WorkloadConfig
from rl.timeline import Timeline

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


def simulate(mode, borrowing, *, seed, cost=0.2, rounds=3, slots=8):
    cfg = sim_config(
        mode, groups_per_round=12, groups_per_update=2, group_size=4, replicas=2, slots=slots
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
    return Simulator(cfg, MODEL, workload, pool=borrow).run(rounds), borrow


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


@pytest.mark.parametrize("seed", [0, 1])
def test_sync_lending_spreads_a_round_that_fits_over_the_lent_replicas(seed):
    """The lender decides at the round's Submit, as the runtime's does before it routes the round:
    the round's 48 sequences would fit the sampler's 2 x 24 slots, and still spread over the 2
    lent replicas, whose decode steps then read half the KV each (lent after the submission, they
    found nothing queued and only cost the switch: 0.98x)."""
    static, _ = simulate("sync", "off", seed=seed, slots=24)
    lent, borrow = simulate("sync", "sampler", seed=seed, slots=24)
    assert borrow.moves["sampler"] == 3
    assert trained(lent) == trained(static)
    replicas = {
        int(s.lane.removeprefix("sampler/slot")) // 24 for s in lent.timeline.spans("sampler/slot")
    }
    assert replicas == {0, 1, 2, 3}
    assert summarize(lent)["groups_per_s"] > summarize(static)["groups_per_s"]


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


def decoded(result):
    """Tokens decoded, over every slot span (a sample taken back mid-rollout has two)."""
    return sum(s.args["tokens"] for s in result.timeline.spans("sampler/slot"))


@pytest.mark.parametrize("seed", [0, 1])
def test_async_lends_while_the_learner_waits_and_takes_back_without_losing_a_token(seed):
    """BiDiRL's setting: under async the learner's devices decode while it waits for its next
    batch and come back once the batch is complete; the lent replicas' running samples resume
    elsewhere (re-prefilled with the tokens they made), so every group is trained once and no
    decoded token is thrown away."""
    static, _ = simulate("async+frontier+s2", "off", seed=seed, rounds=4)
    lent, borrow = simulate("async+frontier+s2", "sampler", seed=seed, rounds=4)
    assert borrow.moves["sampler"] >= 2
    assert trained(lent) == trained(static) == [(12.0, "plain")] * 4
    assert lent.counters["groups_emitted"] == 48 and lent.counters["aborted_tokens"] == 0
    # the same samples to the same lengths, each token decoded once: none started over
    assert lent.counters["tokens"] == static.counters["tokens"] == decoded(lent)
    evicted = [s for s in lent.timeline.spans("sampler/slot") if s.args.get("evicted")]
    assert evicted, "no lent replica was taken back mid-rollout"
    assert max(r["lag_max"] for r in lent.rounds) <= 2
    lends = lent.timeline.spans("elastic")
    assert len(lends) == borrow.moves["sampler"]


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 10_000), cost=st.floats(0.0, 2.0), staleness=st.integers(0, 3))
def test_async_borrowing_loses_and_doubles_nothing(seed, cost, staleness):
    """Any lengths, any switch cost (so any pattern of lends and take-backs), any bound: every
    group is emitted and trained once, every token decoded once, every token within the bound."""
    mode = f"async+frontier+s{staleness}"
    result, _ = simulate(mode, "both", seed=seed, cost=cost, rounds=3)
    assert trained(result) == [(12.0, "plain")] * 3
    assert result.counters["groups_emitted"] == 36 and result.counters["aborted_tokens"] == 0
    assert decoded(result) == result.counters["tokens"]
    assert max(r["lag_max"] for r in result.rounds) <= staleness


SLOW_LEARNER = dataclasses.replace(MODEL, learner_per_token=4e-4)  # the learner is the bottleneck


@pytest.mark.parametrize("seed", [0, 1])
def test_async_learner_borrows_the_sampler_the_bound_drained(seed):
    """Under async with a slow learner the sampler runs s updates ahead and drains (the bound
    holds the next requests until a publish): the learner borrows its devices for the update in
    flight (between micro-batches) and gives them back at the publish. Same groups, within the
    bound, sooner."""

    def run(borrowing):
        cfg = sim_config(
            "async+frontier+s1",
            groups_per_round=12,
            groups_per_update=2,
            group_size=4,
            replicas=2,
            slots=8,
        )
        borrow = None
        if borrowing != "off":
            policy = BorrowPolicy(
                BorrowConfig(borrowing=borrowing, switch_cost_s=0.05),
                SLOW_LEARNER,
                model_learner_devices=2,
            )
            borrow = SimBorrower(policy, learner_devices=2)
        workload = Workload(dataclasses.replace(WORKLOAD, seed=seed))
        return Simulator(cfg, SLOW_LEARNER, workload, pool=borrow).run(4), borrow

    static, _ = run("off")
    borrowed, borrow = run("learner")
    assert borrow.moves["learner"] >= 4 and borrow.moves["sampler"] == 0
    assert trained(borrowed) == trained(static) == [(12.0, "plain")] * 4
    assert borrowed.counters["tokens"] == static.counters["tokens"] == decoded(borrowed)
    assert max(r["lag_max"] for r in borrowed.rounds) <= 1
    assert summarize(borrowed)["groups_per_s"] > 1.05 * summarize(static)["groups_per_s"]


def _one_round(mode, learner_spans):
    """A round on 2 replicas: replica 0 idles at 10 s, replica 1 (the drain) at 20 s; the
    round's publish ends at 27 s."""
    timeline = Timeline()
    timeline.span("sampler/prefill", "prefill", 0.0, 0.5, round=0, uid=0)
    timeline.span("sampler/slot0", "0/0", 0.5, 10.0, round=0, uid=0)  # replica 0's slot 0
    timeline.span("sampler/slot4", "1/0", 0.5, 20.0, round=0, uid=1)  # replica 1's slot 0
    for start, end in learner_spans:
        timeline.span("learner", "micro_step", start, end, round=0)
    timeline.span("publish", "v1", 26.0, 27.0, version=1, round=0)
    batching = "ordered" if mode == "async" else "fifo"
    config = SimConfig(mode=mode, batching=batching, replicas=2, slots=4, group_size=4)
    return SimResult(config, [{}], timeline, {}, 27.0)


def test_the_predrain_bound_counts_what_idle_replicas_could_take_off_the_drained_learner():
    # the learner works 12-26 s: 8 s of it while replica 0 idles, 6 s after the drain. Lending
    # that replica (L = 2 -> 3 devices) saves 8 x 1/3 s of learner work, which after the drain
    # (on 2 + 2 devices) is 8/3 x 2/4 s of wall time, under the 6 x 2/4 s left there: the
    # round's 27 s could be 27 - 4/3.
    cgp = _one_round("cgp", [(12.0, 26.0)])
    assert predrain_bound(cgp, learner_devices=2) == pytest.approx(27 / (27 - 4 / 3))
    # capped by what is left after the drain: 1 s there, at most 1 x 2/4 s saved
    short = _one_round("cgp", [(12.0, 21.0)])
    assert predrain_bound(short, learner_devices=2) == pytest.approx(27 / (27 - 0.5))
    # nothing runs on the learner before the drain (sync): nothing to gain
    assert predrain_bound(_one_round("sync", [(20.0, 26.0)]), learner_devices=2) == 1.0
    assert math.isnan(predrain_bound(_one_round("async", [(12.0, 26.0)]), learner_devices=2))
