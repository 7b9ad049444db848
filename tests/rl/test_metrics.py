"""round_metrics on hand-computed timelines."""

import math

import pytest

from rl.metrics import publish_metrics, round_metrics
from rl.timeline import Timeline

TOL = dict(rel=1e-12, abs=1e-12)  # pure float arithmetic on small exact values


def _round0_timeline() -> Timeline:
    """Round 0 starts at t=10 on 2 slots; round 1's spans come after and must be ignored.

    slot0: [10, 14] 40 tok, [14, 18] 40 tok        busy 8
    slot1: [10, 12] 20 tok, idle, [13, 20] 70 tok  busy 9    -> rollout ends at 20
    learner: update 0 [12.5, 14] (60 tok) holding micro_step [12.5, 13.5] (60 tok);
             micro_steps of step 1 [18.5, 19.5] (40 tok), [20, 21] (70 tok); update 1 [20.5, 22]
             with no tokens arg -> union [12.5,14] + [18.5,19.5] + [20,22] = 4.5 s busy, 170 tok
    """
    tl = Timeline()
    slot = lambda i, a, b, tok, r=0: tl.span(f"sampler/slot{i}", "seq", a, b, round=r, tokens=tok)
    slot(0, 10, 14, 40)
    slot(0, 14, 18, 40)
    slot(1, 10, 12, 20)
    slot(1, 13, 20, 70)
    tl.span("sampler/prefill", "prefill", 10, 10.5, round=0)
    tl.instant("sampler/groups", "group", 18, round=0, uid=0)
    tl.span("learner", "update", 12.5, 14, step=0, round=0, tokens=60)
    tl.span("learner", "micro_step", 12.5, 13.5, step=0, round=0, tokens=60)
    tl.span("learner", "micro_step", 18.5, 19.5, step=1, round=0, tokens=40)
    tl.span("learner", "micro_step", 20, 21, step=1, round=0, tokens=70)
    tl.span("learner", "update", 20.5, 22, step=1, round=0)
    tl.span("publish", "publish", 22, 22.5, version=1, round=0)
    slot(0, 23, 30, 999, r=1)  # round 1
    tl.span("learner", "micro_step", 25, 26, step=2, round=1, tokens=999)
    tl.span("learner", "update", 25, 27, step=2, round=1, tokens=999)
    return tl


def test_round_metrics_match_hand_computed_values():
    m = round_metrics(_round0_timeline(), round=0, rollout_start=10.0, num_slots=2)
    expected = {
        "rollout_s": 10.0,  # 20 - 10
        "rollout_to_train_end_s": 12.0,  # 22 - 10
        "first_dispatch_s": 2.5,  # 12.5 - 10
        "trainer_compute_s": 4.5,  # the merged learner spans
        "trainer_wait_s": 7.5,  # 12 - 4.5
        "trainer_wait_ratio": 0.625,  # 7.5 / 12
        "slot_occupancy": 0.85,  # (8 + 9) / (2 * 10)
        "sampler_tokens_per_s": 17.0,  # (40 + 40 + 20 + 70) / 10
        "learner_tokens_per_s": 170 / 4.5,  # 60 (update 0) + 40 + 70 (micro steps of step 1)
        "sequences": 4.0,
        "updates": 2.0,
        "sampler_tokens": 170.0,
        "learner_tokens": 170.0,
    }
    assert m.keys() == expected.keys()
    for key, value in expected.items():
        assert m[key] == pytest.approx(value, **TOL), key


def test_round_metrics_second_round():
    m = round_metrics(_round0_timeline(), round=1, rollout_start=22.5, num_slots=2)
    assert m["rollout_s"] == pytest.approx(7.5, **TOL)
    assert m["rollout_to_train_end_s"] == pytest.approx(4.5, **TOL)
    assert m["trainer_wait_ratio"] == pytest.approx(2.5 / 4.5, **TOL)
    assert m["slot_occupancy"] == pytest.approx(7.0 / 15.0, **TOL)
    assert m["learner_tokens"] == 999.0  # the update's tokens; its micro step is not added


def test_round_metrics_do_not_depend_on_spans_that_ended_before_the_round():
    def timeline(history: bool) -> Timeline:
        tl = Timeline()
        if history:  # round 0, all of it over before round 1 starts at t=10
            tl.span("sampler/slot0", "seq", 0, 4, round=0, tokens=5)
            tl.span("learner", "update", 4, 8, step=0, round=0, tokens=5)
        tl.span("learner", "update", 9, 11, step=1, round=0, tokens=5)  # runs across t=10
        tl.span("sampler/slot0", "seq", 10, 14, round=1, tokens=8)
        tl.span("learner", "update", 14, 16, step=2, round=1, tokens=8)
        return tl

    m = round_metrics(timeline(history=True), round=1, rollout_start=10.0, num_slots=1)
    assert m == round_metrics(timeline(history=False), round=1, rollout_start=10.0, num_slots=1)
    assert m["trainer_compute_s"] == pytest.approx(3.0, **TOL)  # [10, 11] and [14, 16]
    assert m["trainer_wait_ratio"] == pytest.approx(3.0 / 6.0, **TOL)


def test_wait_ratio_counts_the_learner_lane_busy_with_another_round():
    tl = Timeline()
    tl.span("sampler/slot0", "seq", 0, 4, round=1, tokens=8)
    tl.span("learner", "update", 0, 2, step=0, round=0, tokens=5)  # still training round 0
    tl.span("learner", "update", 5, 6, step=1, round=1, tokens=7)
    m = round_metrics(tl, round=1, rollout_start=0.0, num_slots=1)
    assert m["trainer_wait_ratio"] == pytest.approx(3.0 / 6.0, **TOL)  # busy [0,2] and [5,6]
    assert m["first_dispatch_s"] == 5.0 and m["learner_tokens_per_s"] == 7.0


def test_micro_steps_without_step_belong_to_the_next_update():
    tl = Timeline()  # micro_step then update, one after the other, both carrying the batch tokens
    tl.span("sampler/slot0", "seq", 0, 2, round=0, tokens=8)
    tl.span("learner", "micro_step", 1, 2, round=0, tokens=30)
    tl.span("learner", "update", 2, 3, round=0, step=1, tokens=30)
    tl.span("learner", "micro_step", 3, 4, round=0, tokens=20)
    tl.span("learner", "update", 4, 5, round=0, step=2, tokens=20)
    tl.span("learner", "micro_step", 5, 6, round=0, tokens=10)  # its update has not run yet
    m = round_metrics(tl, round=0, rollout_start=0.0, num_slots=1)
    assert m["learner_tokens"] == 60.0 and m["learner_tokens_per_s"] == pytest.approx(12.0, **TOL)
    assert m["trainer_wait_ratio"] == pytest.approx(1.0 / 5.0, **TOL)  # window [0, 5], busy [1, 5]


def test_round_metrics_missing_update_is_nan_and_bad_input_raises():
    tl = Timeline()
    tl.span("sampler/slot0", "seq", 1, 3, round=0, tokens=4)
    m = round_metrics(tl, round=0, rollout_start=1.0, num_slots=2)
    assert m["slot_occupancy"] == 0.5 and m["sampler_tokens_per_s"] == 2.0
    for key in ("rollout_to_train_end_s", "trainer_wait_ratio", "first_dispatch_s"):
        assert math.isnan(m[key]), key
    with pytest.raises(ValueError, match=r"round=5.*rounds present: \[0\]"):
        round_metrics(tl, round=5, rollout_start=0.0, num_slots=2)
    tl.span("sampler/slot1", "seq", 1, 2, round=0)
    with pytest.raises(ValueError, match="2 sampler slot lanes; expected at most num_slots=1"):
        round_metrics(tl, round=0, rollout_start=0.0, num_slots=1)


def test_publish_metrics_sum_the_rounds_publishes_only():
    tl = Timeline()
    tl.span("publish", "v1", 1.0, 1.5, version=1, round=0, bytes=3 * 2**20)
    tl.span("publish", "v2", 2.0, 2.25, version=2, round=0, bytes=2**19)
    tl.span("publish", "v3", 4.0, 5.0, version=3, round=1, bytes=2**20)
    got = publish_metrics(tl, round=0, rollout_start=0.0)
    assert got == pytest.approx({"publish_s": 0.75, "publish_mb": 3.5}, **TOL)
    assert publish_metrics(tl, round=2, rollout_start=0.0) == {"publish_s": 0.0, "publish_mb": 0.0}
