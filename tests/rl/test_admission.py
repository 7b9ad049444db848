"""Admission policies: fcfs keeps submission order, frontier keeps logical (round, index) order;
both admit only whole groups that fit and never let a later group jump the head."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rl.admission import FCFS, POLICIES, Frontier, ShuffledFCFS, make_policy, register_admission
from rl.types import Request

SETTINGS = settings(max_examples=100, deadline=None)


def _req(uid: int, index: int | None = None, round: int = 0, g: int = 1) -> Request:
    return Request(uid=uid, round=round, index=uid if index is None else index, prompt=(1,),
                   group_size=g)  # fmt: skip


def _drain(policy, free_slots: int = 1 << 20) -> list[tuple[int, int]]:
    out = []
    while (r := policy.next(free_slots)) is not None:
        out.append(r.key)
    return out


# A round submitted longest-prompt-first, then an earlier round's resubmitted prompt.
OUT_OF_ORDER = [_req(3, round=1), _req(0, round=1), _req(2, round=1), _req(1, round=1),
                _req(7, index=5, round=0)]  # fmt: skip


def test_fcfs_follows_submission_order():
    policy = FCFS()
    policy.submit(OUT_OF_ORDER)
    assert _drain(policy) == [r.key for r in OUT_OF_ORDER]


def test_frontier_follows_logical_order():
    policy = Frontier()
    policy.submit(OUT_OF_ORDER[:3])
    policy.submit(OUT_OF_ORDER[3:])
    assert len(policy) == 5
    assert _drain(policy) == [(0, 7), (1, 0), (1, 1), (1, 2), (1, 3)]
    assert len(policy) == 0 and policy.next(8) is None


def test_frontier_ties_keep_submission_order():
    policy = Frontier()  # indices left at their default: frontier degrades to fcfs
    policy.submit([Request(uid=u, prompt=(1,)) for u in [5, 2, 9]])
    assert _drain(policy) == [(0, 5), (0, 2), (0, 9)]


@SETTINGS
@given(
    st.lists(st.integers(1, 4), max_size=12),
    st.lists(st.integers(0, 6), min_size=1, max_size=40),
    st.integers(1, 3),
)
def test_frontier_equals_fcfs_for_submissions_in_logical_order(sizes, free_seq, chunks):
    reqs = [_req(u, round=u // 5, index=u % 5, g=g) for u, g in enumerate(sizes)]
    policies = [FCFS(), Frontier()]
    for p in policies:
        for c in range(chunks):  # submitted over several calls, still in logical order
            p.submit(reqs[c * len(reqs) // chunks : (c + 1) * len(reqs) // chunks])
    for free in free_seq:
        got = [p.next(free) for p in policies]
        assert got[0] == got[1]
        assert got[0] is None or got[0].group_size <= free
    assert _drain(policies[0]) == _drain(policies[1])


@pytest.mark.parametrize("cls", [FCFS, Frontier])
def test_head_of_line_never_jumped_and_never_overfilled(cls):
    policy = cls()
    policy.submit([_req(0, g=4), _req(1, g=1), _req(2, g=2)])
    assert policy.next(0) is None and policy.next(3) is None  # head needs 4: slots kept for it
    assert len(policy) == 3
    assert policy.next(4).uid == 0
    assert policy.next(1).uid == 1
    assert policy.next(1) is None and policy.next(2).uid == 2


def test_frontier_keeps_slots_for_a_late_submitted_frontier_group():
    policy = Frontier()
    policy.submit([_req(10, index=4, g=1), _req(11, index=5, g=1)])
    assert policy.next(2).uid == 10
    policy.submit([_req(3, index=1, g=2)])  # the frontier group shows up (e.g. resubmitted)
    assert policy.next(1) is None  # 11 fits in 1 slot but must not jump the frontier
    assert policy.next(2).uid == 3 and policy.next(1).uid == 11


@pytest.mark.parametrize("cls", [FCFS, Frontier])
def test_remove(cls):
    policy = cls()
    policy.submit([_req(0, g=4), _req(1), _req(2)])
    assert policy.remove((0, 0)).uid == 0  # the blocking head is aborted: the next may start
    assert policy.remove((0, 0)) is None and policy.remove((5, 5)) is None
    assert policy.next(1).uid == 1 and len(policy) == 1
    policy.submit([_req(0, g=4)])  # a removed key may come back
    assert _drain(policy) == ([(0, 2), (0, 0)] if cls is FCFS else [(0, 0), (0, 2)])


def test_frontier_stays_correct_through_many_removals():
    policy = Frontier()
    policy.submit([_req(u, index=999 - u) for u in range(1000)])
    for u in range(0, 1000, 3):
        if u % 2:
            assert policy.remove((0, u)).uid == u
    kept = sorted((u for u in range(1000) if not (u % 3 == 0 and u % 2)), reverse=True)
    assert len(policy) == len(kept)
    assert [k[1] for k in _drain(policy)] == kept


@pytest.mark.parametrize("cls", [FCFS, Frontier])
def test_duplicate_keys_rejected(cls):
    policy = cls()
    policy.submit([_req(1)])
    with pytest.raises(ValueError, match=r"\(round, uid\)=\(0, 1\) is already waiting"):
        policy.submit([_req(1, index=7)])
    with pytest.raises(ValueError, match=r"\(0, 2\) is already waiting"):
        policy.submit([_req(2), _req(3), _req(2)])
    assert len(policy) == 1  # a bad submission changes nothing
    policy.submit([_req(1, round=1)])  # the same uid in another round is another request
    assert len(policy) == 2


def test_make_policy():
    assert {"fcfs", "frontier", "shuffled"} <= set(POLICIES)
    assert isinstance(make_policy("fcfs"), FCFS)
    assert isinstance(make_policy("frontier"), Frontier)
    assert isinstance(make_policy("shuffled"), ShuffledFCFS)
    with pytest.raises(ValueError, match=r"'lifo'; expected one of \[.*'fcfs', 'frontier'"):
        make_policy("lifo")


def test_a_registered_policy_is_made_by_name_and_names_are_not_replaced():
    @register_admission("test_lifo_policy")
    class Lifo(FCFS):
        pass

    try:
        assert isinstance(make_policy("test_lifo_policy"), Lifo)
        with pytest.raises(ValueError, match="'fcfs' is already registered"):
            register_admission("fcfs")(Lifo)
    finally:
        del POLICIES["test_lifo_policy"]
