"""The migration policies (rl/elastic/migration.py): pure decisions on replica snapshots."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rl.elastic.migration import (
    MigrationConfig,
    Move,
    ReplicaView,
    RunningView,
    check_moves,
    make_migration_policy,
)


def view(slots, *groups, queued=False, free=None):
    running = tuple(RunningView(key=(0, uid), sequences=n) for uid, n in groups)
    used = sum(n for _, n in groups)
    return ReplicaView(
        slots=slots, free=slots - used if free is None else free, queued=queued, running=running
    )


def test_off_never_moves():
    policy = make_migration_policy(MigrationConfig(policy="off"))
    assert policy.moves([view(8, (0, 1)), view(8, (1, 1))]) == []


def test_tail_consolidates_onto_the_most_loaded_replica():
    policy = make_migration_policy(
        MigrationConfig(policy="tail", max_running_fraction=0.5), consumer=True
    )
    replicas = [view(8, (0, 2)), view(8, (1, 1), (2, 1)), view(8, (3, 3))]
    moves = policy.moves(replicas)
    check_moves(replicas, moves)
    # replicas 0 and 1 (4 sequences) fit in replica 2's 5 free slots: both empty into it
    assert set(moves) == {Move((0, 0), 0, 2), Move((0, 1), 1, 2), Move((0, 2), 1, 2)}


def test_tail_without_a_consumer_for_freed_replicas_never_moves():
    # one pipeline: a consolidated tail frees replicas for nothing the others would not do
    replicas = [view(8, (0, 2)), view(8, (1, 1), (2, 1)), view(8, (3, 3))]
    tail = MigrationConfig(policy="tail", max_running_fraction=0.5)
    assert make_migration_policy(tail).moves(replicas) == []  # no consumer by default
    assert make_migration_policy(tail, consumer=True).moves(replicas)
    always = make_migration_policy(MigrationConfig(policy="always"), consumer=False)
    assert always.moves(replicas)  # the forcing mode of the exactness tests moves regardless


def test_tail_waits_while_work_is_queued_or_many_run():
    policy = make_migration_policy(
        MigrationConfig(policy="tail", max_running_fraction=0.25), consumer=True
    )
    assert policy.moves([view(8, (0, 1)), view(8, (1, 1), queued=True)]) == []
    assert policy.moves([view(8, (0, 4)), view(8, (1, 1))]) == []  # 5 > 0.25 * 16
    assert policy.moves([view(8, (0, 1)), view(8)]) == []  # one busy replica: nothing to gain


def test_tail_keeps_requests_near_their_end():
    policy = make_migration_policy(
        MigrationConfig(policy="tail", min_tokens_left=10), consumer=True
    )
    near = ReplicaView(
        slots=8, free=7, running=(RunningView(key=(0, 0), sequences=1, tokens_left=3),)
    )
    far = ReplicaView(
        slots=8, free=7, running=(RunningView(key=(0, 1), sequences=1, tokens_left=50),)
    )
    moves = policy.moves([near, far])
    assert moves == [Move((0, 1), 1, 0)]


def test_always_moves_every_movable_request():
    policy = make_migration_policy(MigrationConfig(policy="always"))
    pinned = RunningView(key=(0, 9), sequences=1, movable=False)
    a = ReplicaView(slots=4, free=1, running=(RunningView(key=(0, 0), sequences=2), pinned))
    b = view(4, (1, 1))
    moves = policy.moves([a, b])
    check_moves([a, b], moves)
    assert {m.key for m in moves} == {(0, 0), (0, 1)}


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"policy": "sometimes"}, r"elastic.migration='sometimes'; expected one of"),
        ({"max_running_fraction": 0.0}, r"max_running_fraction must be in \(0, 1\]"),
        ({"min_tokens_left": -1}, r"min_tokens_left must be >= 0; received -1"),
    ],
)
def test_config_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MigrationConfig(**kwargs)


def test_bad_views_and_moves_are_refused():
    with pytest.raises(ValueError, match="free <= slots - running sequences"):
        view(4, (0, 3), free=2)
    with pytest.raises(ValueError, match="not executable"):
        check_moves([view(4, (0, 1)), view(4)], [Move((0, 5), 0, 1)])
    with pytest.raises(ValueError, match="overfill replica 1"):
        check_moves([view(4, (0, 3)), view(4, (1, 2))], [Move((0, 0), 0, 1)])


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from(["tail", "always"]),
    st.lists(
        st.tuples(st.integers(2, 8), st.lists(st.integers(1, 3), max_size=4), st.booleans()),
        min_size=1,
        max_size=4,
    ),
)
def test_moves_are_always_executable(name, spec):
    uid, replicas = 0, []
    for slots, sizes, queued in spec:
        runs = []
        for n in sizes:
            if sum(r.sequences for r in runs) + n <= slots:
                runs.append(RunningView(key=(0, uid), sequences=n, movable=uid % 5 != 4))
                uid += 1
        used = sum(r.sequences for r in runs)
        replicas.append(
            ReplicaView(slots=slots, free=slots - used, queued=queued, running=tuple(runs))
        )
    cfg = MigrationConfig(policy=name, max_running_fraction=1.0)
    moves = make_migration_policy(cfg, consumer=True).moves(replicas)
    check_moves(replicas, moves)
    if name == "tail" and moves:  # a source is emptied whole, and never receives
        srcs = {m.src for m in moves}
        assert not srcs & {m.dst for m in moves}
        for s in srcs:
            assert {m.key for m in moves if m.src == s} == {r.key for r in replicas[s].running}


def paged(slots, pages, free_pages, *runs, page=16, queued=False):
    """A paged replica view; runs: (uid, sequences, kv_pages, tokens_left)."""
    running = tuple(
        RunningView(key=(0, uid), sequences=n, kv_pages=kv, tokens_left=left)
        for uid, n, kv, left in runs
    )
    used = sum(r.sequences for r in running)
    return ReplicaView(
        slots=slots,
        free=slots - used,
        queued=queued,
        running=running,
        pages=pages,
        free_pages=free_pages,
        page=page,
    )


def test_tail_moves_only_where_free_pages_hold_the_kv_and_its_growth():
    """Every replica has free slots; only replica 2 has the pages: the moved request's 30 pages,
    plus grow_tokens = 32 positions (2 pages of 16) for each of its 2 sequences and of the
    destination's own 3 (10 pages)."""
    policy = make_migration_policy(
        MigrationConfig(policy="tail", max_running_fraction=1.0, grow_tokens=32), consumer=True
    )
    replicas = [
        paged(64, 100, 70, (0, 2, 30, 500)),
        paged(64, 100, 39, (1, 3, 60, 500)),  # 39 < 30 + 2 * 2 + 3 * 2: no room to grow
        paged(64, 100, 40, (2, 3, 60, 500)),  # 40 = 30 + 4 + 6
    ]
    moves = policy.moves(replicas)
    check_moves(replicas, moves)
    assert moves == [Move((0, 0), 0, 2)]
    tight = [paged(64, 100, 35, (0, 2, 30, 500)), replicas[1], paged(64, 100, 39, (2, 3, 60, 500))]
    assert policy.moves(tight) == []  # slots everywhere, pages nowhere: nothing moves


def test_tail_growth_margin_is_capped_by_tokens_left():
    """A request 3 tokens from its cap needs one page of growth per sequence, not grow_tokens."""
    policy = make_migration_policy(
        MigrationConfig(policy="tail", max_running_fraction=1.0, grow_tokens=1024), consumer=True
    )
    replicas = [paged(64, 100, 90, (0, 1, 10, 3)), paged(64, 100, 60, (1, 2, 30, 3))]
    # 10 pages + 1 page of growth for the moved sequence, 2 for the destination's own: 13 <= 60
    assert policy.moves(replicas) == [Move((0, 0), 0, 1)]
    far = [paged(64, 100, 90, (0, 1, 10, 1024)), paged(64, 100, 60, (1, 2, 30, 1024))]
    assert policy.moves(far) == []  # 10 + 3 * 64 pages of growth > 60


def test_tail_trigger_counts_pages_on_paged_replicas():
    """Few sequences (4 of 128 slots) but most pages in use: the pool, not the slots, limits."""
    policy = make_migration_policy(
        MigrationConfig(policy="tail", max_running_fraction=0.25, grow_tokens=0), consumer=True
    )
    full = [paged(64, 100, 30, (0, 1, 70, None)), paged(64, 100, 90, (1, 3, 10, None))]
    assert policy.moves(full) == []  # 80 of 200 pages in use > 25%
    light = [paged(64, 100, 80, (0, 1, 20, None)), paged(64, 100, 90, (1, 3, 10, None))]
    assert policy.moves(light) == [Move((0, 0), 0, 1)]  # 30 of 200 pages; moves 20 into 90 free


def test_dense_replicas_are_limited_by_slots_alone():
    policy = make_migration_policy(
        MigrationConfig(policy="tail", max_running_fraction=0.5), consumer=True
    )
    run = RunningView(key=(0, 0), sequences=2, kv_pages=999)  # pages mean nothing to dense
    dense = ReplicaView(slots=8, free=6, running=(run,))
    assert dense.need(run, 512) == 0 and not dense.paged
    assert policy.moves([dense, view(8, (1, 3))]) == [Move((0, 0), 0, 1)]


def test_always_and_check_moves_respect_free_pages():
    always = make_migration_policy(MigrationConfig(policy="always"))
    a = paged(8, 100, 50, (0, 1, 20, None))
    short = paged(8, 100, 19, (1, 1, 20, None))  # 19 < 20: 0's KV does not fit here
    assert always.moves([a, short]) == [Move((0, 1), 1, 0)]
    with pytest.raises(ValueError, match="overfill replica 1 .* 19 free KV pages"):
        check_moves([a, short], [Move((0, 0), 0, 1)])


def test_bad_page_views_are_refused():
    with pytest.raises(ValueError, match="free_pages <= pages"):
        ReplicaView(slots=4, free=4, pages=10, free_pages=11, page=16)
    with pytest.raises(ValueError, match="page > 0 exactly when paged"):
        ReplicaView(slots=4, free=4, pages=10, free_pages=5)
    with pytest.raises(ValueError, match="kv_pages >= 0"):
        RunningView(key=(0, 0), sequences=1, kv_pages=-1)
    with pytest.raises(ValueError, match="grow_tokens must be >= 0; received -1"):
        MigrationConfig(grow_tokens=-1)


def test_on_demand_tail_spreads_onto_an_idle_replica():
    """A replica idles (one that joined from another pipeline): it takes up to half of the
    most-loaded replica's sequences, the requests with the most tokens left first."""
    on_demand = MigrationConfig(policy="tail", on_demand=True)
    policy = make_migration_policy(on_demand, consumer=True)
    runs = tuple(
        RunningView(key=(0, uid), sequences=2, tokens_left=left)
        for uid, left in enumerate([10, 400, 50, 300])
    )
    busy = ReplicaView(slots=8, free=0, running=runs)
    replicas = [busy, view(8, (9, 6)), view(8)]
    moves = policy.moves(replicas)
    check_moves(replicas, moves)
    assert moves == [Move((0, 1), 0, 2), Move((0, 3), 0, 2)]  # 4 of 8, the longest
    assert policy.moves([busy, view(8, (9, 6)), view(8, queued=True)]) == []  # its queue first
    plain = make_migration_policy(MigrationConfig(policy="tail"), consumer=True)
    assert plain.moves(replicas) == []  # plain `tail` only consolidates a tail


def test_a_leaving_replica_is_emptied_whatever_the_round_stage():
    """A recalled replica (ReplicaView.leaving) moves every movable request to the staying
    replicas with room, most free slots first; on_demand never consolidates by itself."""
    on_demand = MigrationConfig(policy="tail", on_demand=True, max_running_fraction=1.0)
    policy = make_migration_policy(on_demand, consumer=True)
    leaving = ReplicaView(
        slots=8,
        free=0,
        leaving=True,
        running=(RunningView(key=(0, 0), sequences=3), RunningView(key=(0, 1), sequences=2)),
    )
    replicas = [leaving, view(8, (2, 6)), view(8, (3, 3))]
    moves = policy.moves(replicas)
    check_moves(replicas, moves)
    assert moves == [Move((0, 0), 0, 2), Move((0, 1), 0, 1)]
    # the same tail without a recall: a plain `tail` consolidates it, on_demand does not
    few = [view(8, (0, 1)), view(8, (1, 2))]
    plain = MigrationConfig(policy="tail", max_running_fraction=1.0)
    assert make_migration_policy(plain, consumer=True).moves(few)
    assert policy.moves(few) == []
