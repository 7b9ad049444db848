"""The borrowing policy: its predictions from the StageModel, the switch-cost estimate, the rule."""

import dataclasses

import pytest

from rl.elastic.borrowing import NO_DECISION, BorrowConfig, BorrowPolicy, PoolState
from rl.elastic.stage import StageModel

MODEL = StageModel(
    decode_a=0.01, decode_b=0.001, learner_fixed=0.1, learner_per_token=1e-3, update_s=0.5
)
DRAINED = PoolState(
    learner_devices=4,
    sampler_replicas=4,
    slots=8,
    updates_left=2,
    micro_batches_left=4,
    learner_tokens_left=4000,
)


def policy(mode="both", cost=1.0, margin=1.0, l0=4):
    cfg = BorrowConfig(borrowing=mode, switch_cost_s=cost, margin=margin)
    return BorrowPolicy(cfg, MODEL, model_learner_devices=l0)


def test_learner_borrows_a_drained_sampler_when_the_gain_beats_the_switch_cost():
    p = policy(cost=1.0)
    # 4000 tokens x 1 ms on 4 devices = 4 s; on 8: 2 s; fixed and update terms do not scale
    assert p.learner_s(DRAINED, 4) == pytest.approx(0.4 + 4.0 + 1.0)
    d = p.decide(DRAINED)
    assert (d.direction, d.move, d.devices) == ("learner", True, 4)
    assert d.gain_s == pytest.approx(2.0) and d.switch_cost_s == 1.0
    assert d.metrics() == {
        "borrow_learner": 1.0,
        "borrow_learner_gain_s": pytest.approx(2.0),
        "borrow_learner_switch_cost_s": 1.0,
    }
    assert not policy(cost=1.0, margin=2.5).decide(DRAINED).move  # 2 s <= 2.5 x 1 s
    assert policy(mode="sampler").decide(DRAINED) is NO_DECISION
    assert policy(mode="off").decide(DRAINED) is NO_DECISION


def test_the_switch_cost_estimate_is_the_mean_of_measured_switches_after_the_prior():
    p = policy(cost=5.0)
    assert not p.decide(DRAINED).move  # prior 5 s > 2 s gain
    p.record_switch("learner", 1.0)
    p.record_switch("learner", 2.0)
    d = p.decide(DRAINED)
    assert d.switch_cost_s == pytest.approx(1.5) and d.move
    assert p.switch["sampler"].estimate == 5.0  # each direction measures its own
    with pytest.raises(ValueError, match="received -1"):
        p.record_switch("learner", -1.0)
    with pytest.raises(ValueError, match="direction='both'"):
        p.record_switch("both", 1.0)


def test_sampler_borrows_while_the_learner_waits_only_for_a_long_enough_rollout():
    waiting = dataclasses.replace(DRAINED, learner_waiting=True, sequences=64, longest_left=10)
    p = policy(cost=1.0)
    # the b term is exact: each token costs b once, spread over the replicas
    assert p.rollout_s(dataclasses.replace(waiting, tokens_left=64_000), 4) == pytest.approx(
        (64_000 / 32) * 0.01 + 0.001 * 64_000 / 4
    )
    short = p.decide(dataclasses.replace(waiting, tokens_left=640))
    assert short.direction == "sampler" and not short.move  # the learner's work would wait
    long = p.decide(dataclasses.replace(waiting, tokens_left=640_000, longest_left=5000))
    assert long.direction == "sampler" and long.move and long.devices == 4
    roll = p.rollout_s(dataclasses.replace(waiting, tokens_left=640_000, longest_left=5000), 4)
    assert long.gain_s < roll  # never more than the rollout left
    tp4 = dataclasses.replace(waiting, replica_devices=8, tokens_left=640_000, learner_devices=4)
    assert not p.decide(tp4).move and "make no replica" in p.decide(tp4).reason


def test_bad_config_and_state_get_clear_errors():
    with pytest.raises(ValueError, match=r"borrowing='yes'; expected one of \('off'"):
        BorrowConfig(borrowing="yes")
    with pytest.raises(ValueError, match=r"switch_cost_s=-1.0; expected a finite number >= 0"):
        BorrowConfig(switch_cost_s=-1.0)
    with pytest.raises(ValueError, match="PoolState.tokens_left must be finite and >= 0"):
        dataclasses.replace(DRAINED, tokens_left=float("nan"))
    with pytest.raises(ValueError, match="slots must be >= 1; received 4, 4, 1, 0"):
        dataclasses.replace(DRAINED, slots=0)


def test_under_async_the_sampler_borrows_only_with_a_queue_to_take_and_a_wait_to_cover():
    """`ahead` (async): the learner waits for its next batch's groups; extra replicas pay only if
    sequences wait for a slot, and the wait outlasts the switch."""
    policy = BorrowPolicy(
        BorrowConfig(borrowing="both", switch_cost_s=1.0), MODEL, model_learner_devices=4
    )
    waiting = PoolState(
        learner_devices=4,
        sampler_replicas=4,
        slots=8,
        sequences=16,
        tokens_left=16 * 400,
        longest_left=800,
        context=300,
        updates_left=1,
        learner_waiting=True,
        ahead=True,
        queued=64,
    )
    d = policy.decide(waiting)
    wait = policy.rollout_s(waiting, 4)
    assert d.direction == "sampler" and d.move and d.devices == 4
    assert d.gain_s == pytest.approx((wait - 1.0) * 4 / 4)  # the queue fills all 4 extra
    half = policy.decide(dataclasses.replace(waiting, queued=16))  # fills 2 of them
    assert half.gain_s == pytest.approx(d.gain_s / 2)
    assert not policy.decide(dataclasses.replace(waiting, queued=0)).move  # nothing to take
    short = dataclasses.replace(waiting, tokens_left=16 * 5, longest_left=10)
    assert policy.rollout_s(short, 4) < 1.0 and not policy.decide(short).move
