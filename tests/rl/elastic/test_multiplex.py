"""rl.elastic.multiplex: where an idle replica goes and whose learner work runs next."""

import math

import pytest

from rl.elastic.multiplex import MultiplexConfig, MultiplexPolicy, PipelineView, ReplicaSeat


def view(**kw):
    base = dict(replicas=1, free_slots=0, queued=0, between_rounds=False)
    return PipelineView(**(base | kw))


LOOKAHEAD = MultiplexPolicy(MultiplexConfig(), switch_s=1.0)
GREEDY = MultiplexPolicy(MultiplexConfig(policy="greedy"), switch_s=1.0)


def test_an_idle_replica_goes_only_where_demand_is_unmet():
    views = [
        view(between_rounds=True),  # the owner: nothing to sample
        view(replicas=1, queued=30, free_slots=30, rollout_since=1.0),  # its own slots cover it
        view(replicas=2, queued=100, free_slots=0, rollout_since=5.0),
    ]
    assert LOOKAHEAD.replica_for(views, owner=0) == 2
    assert LOOKAHEAD.replica_for(views[:2], owner=0) is None  # no unmet demand


def test_a_replica_stays_with_an_owner_that_still_needs_it_or_whose_round_comes_first():
    hungry = view(replicas=0, queued=64)
    assert LOOKAHEAD.replica_for([view(queued=10), hungry], owner=0) is None
    soon = view(between_rounds=True, learner_s=1.5, waiting_since=3.0)  # publish within 2 switches
    assert LOOKAHEAD.replica_for([soon, hungry], owner=0) is None
    assert GREEDY.replica_for([soon, hungry], owner=0) == 1  # no look-ahead
    later = view(between_rounds=True, learner_s=30.0, waiting_since=3.0)
    assert LOOKAHEAD.replica_for([later, hungry], owner=0) == 1
    finished = view(between_rounds=True)  # no learner work: no round follows
    assert LOOKAHEAD.replica_for([finished, hungry], owner=0) == 1


def test_the_learner_serves_waiting_rollouts_first_the_one_whose_work_would_end_first():
    views = [
        view(learner_s=5.0, waiting_since=1.0),  # mid-rollout (cgp): streaming work
        view(between_rounds=True, learner_s=50.0, waiting_since=2.0),
        view(between_rounds=True, learner_s=20.0, waiting_since=3.0),
        view(between_rounds=True),  # nothing queued
    ]
    assert LOOKAHEAD.learner_for(views, last=None) == 2
    assert GREEDY.learner_for(views, last=None) == 0  # the oldest work
    streaming = [views[0], view(learner_s=1.0, waiting_since=0.5)]
    assert LOOKAHEAD.learner_for(streaming, last=None) == 1
    assert LOOKAHEAD.learner_for([views[3]], last=None) is None
    sticky = MultiplexPolicy(MultiplexConfig(learner_switch_s=2.0), switch_s=1.0)
    assert sticky.learner_for(views, last=1) == 1  # a switch costs: the last one keeps it


def test_a_long_wait_outranks_shorter_newer_work_so_no_pipeline_starves():
    old = view(between_rounds=True, learner_s=99.0, waiting_since=250.0)
    new = view(between_rounds=True, learner_s=80.0, waiting_since=400.0)
    assert LOOKAHEAD.learner_for([old, new], last=None) == 0  # 349 < 480: it would end first
    fresh = view(between_rounds=True, learner_s=80.0, waiting_since=260.0)
    assert LOOKAHEAD.learner_for([old, fresh], last=None) == 1  # 340 < 349: shorter wins


def test_a_replica_goes_to_the_oldest_rollout_with_unmet_demand():
    views = [
        view(between_rounds=True),
        view(replicas=2, queued=100, rollout_since=30.0),
        view(replicas=0, queued=10, rollout_since=10.0),
    ]
    assert LOOKAHEAD.replica_for(views, owner=0) == 2


def test_unmet_demand_and_bad_configs():
    assert view(queued=10, free_slots=4).unmet == 6 and view(queued=3, free_slots=8).unmet == 0
    with pytest.raises(ValueError, match="policy"):
        MultiplexConfig(policy="fair")
    with pytest.raises(ValueError, match="learner_switch_s"):
        MultiplexConfig(learner_switch_s=-1.0)
    with pytest.raises(ValueError, match="switch_s"):
        MultiplexPolicy(MultiplexConfig(), switch_s=math.nan)


def test_a_replica_nobody_waits_for_spreads_the_densest_rollout():
    policy = MultiplexPolicy(MultiplexConfig(spread_min=10), switch_s=1.0)
    owner = view(between_rounds=True)
    dense = view(replicas=2, running=60)  # 20 per replica with one more: it spreads
    sparse = view(replicas=2, running=20)  # 6.7 per replica with one more: too few
    assert policy.replica_for([owner, sparse, dense], owner=0) == 2
    assert policy.replica_for([owner, sparse], owner=0) is None
    assert GREEDY.replica_for([owner, sparse, dense], owner=0) is None  # no look-ahead, no spread
    off = MultiplexPolicy(MultiplexConfig(spread_min=0), switch_s=1.0)
    assert off.replica_for([owner, sparse, dense], owner=0) is None
    # the owner's own rollout spreads onto it: it stays
    mine = view(replicas=2, running=40)
    assert policy.replica_for([mine, sparse, dense], owner=0) is None
    # unmet demand comes first
    hungry = view(replicas=0, queued=8, rollout_since=2.0)
    assert policy.replica_for([owner, dense, hungry], owner=0) == 2


def seat(index, pipeline, running, free, **kw):
    return ReplicaSeat(index=index, pipeline=pipeline, running=running, free=free, **kw)


def test_a_waiting_queue_recalls_the_emptiest_replica_of_a_rollout_that_can_absorb_it():
    hungry = view(replicas=1, queued=16, free_slots=0)
    busy = view(replicas=3, running=20, free_slots=30)
    seats = [
        seat(0, 0, running=8, free=0),  # the hungry pipeline's own
        seat(1, 1, running=12, free=4),
        seat(2, 1, running=5, free=11),  # fewest running, and the others' 4 + 9 free hold them
        seat(3, 1, running=3, free=9, home=True),  # fewer still, but a home never moves
    ]
    assert LOOKAHEAD.recall([hungry, busy], seats) == 2
    assert GREEDY.recall([hungry, busy], seats) is None  # no look-ahead, no recall
    assert LOOKAHEAD.recall([view(queued=4, free_slots=4), busy], seats) is None  # slots suffice
    # one replica already on its way to the one queue that waits: nothing more is recalled
    leaving = [*seats[:2], seat(2, 1, running=5, free=11, leaving=True), seats[3]]
    assert LOOKAHEAD.recall([hungry, busy], leaving) is None
    # the others cannot take what runs there: it stays
    full = [seats[0], seat(1, 1, running=16, free=0), seat(2, 1, running=5, free=11)]
    full.append(seat(3, 1, running=3, free=0, home=True))
    assert LOOKAHEAD.recall([hungry, busy], full) is None
    # a rollout on one replica keeps it
    alone = [seats[0], seat(1, 1, running=5, free=11)]
    assert LOOKAHEAD.recall([hungry, view(running=5)], alone) is None
