"""Batch formation: fifo keeps completion order; ordered releases batch k = its indices, in order."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rl.formation import FORMERS, FifoBatches, OrderedBatches, make_former, register_former
from rl.types import Completion, Group, Request

SETTINGS = settings(max_examples=150, deadline=None)


def _group(index: int, round: int = 0, uid: int | None = None) -> Group:
    uid = index if uid is None else uid
    request = Request(uid=uid, round=round, index=index, prompt=(1,))
    c = Completion(
        uid=uid, round=round, sample=0, prompt=(1,), tokens=(2,), logprobs=(0.0,), versions=(0,),
        finish_reason="stop", reward=0.0,
    )  # fmt: skip
    return Group(request=request, completions=(c,))


def _indices(batches) -> list[list[int]]:
    return [[g.request.index for g in b] for b in batches]


@st.composite
def _rounds(draw, max_groups: int = 40):
    """(size, start, completion order of the round's indices)."""
    n = draw(st.integers(0, max_groups))
    size = draw(st.integers(1, 9))
    start = draw(st.integers(0, 5))
    order = draw(st.permutations(range(start, start + n)))
    return size, start, order


@SETTINGS
@given(_rounds(), st.booleans())
def test_fifo_batches_are_completion_order(round_, declare):
    size, _, order = round_
    former = FifoBatches(size, num_groups=len(order) if declare else None)
    batches = []
    for i in order:
        out = former.add(_group(i))
        assert len(out) <= 1
        batches += out
    last = former.flush()
    if declare:  # the declared round's last batch comes out with its last group
        assert last is None
    elif last is not None:
        batches.append(last)
    assert former.pending == 0 and former.flush() is None
    assert [i for b in _indices(batches) for i in b] == list(order)  # every group once, in order
    assert all(len(b) == size for b in batches[:-1])
    assert not batches or 0 < len(batches[-1]) <= size
    assert len(batches) == -(-len(order) // size)


def test_fifo_rejects_groups_past_the_declared_round():
    former = FifoBatches(2, num_groups=3)
    assert former.add(_group(0)) == [] and former.pending == 1
    assert _indices(former.add(_group(5))) == [[0, 5]]
    assert _indices(former.add(_group(1))) == [[1]]  # the smaller last batch, declared
    with pytest.raises(ValueError, match=r"\(round, uid\)=\(0, 9\).*all 3 groups"):
        former.add(_group(9))


@SETTINGS
@given(_rounds(), st.booleans())
def test_ordered_batches_are_logical_batches_in_order(round_, declare):
    size, start, order = round_
    n = len(order)
    former = OrderedBatches(size, num_groups=n if declare else None, start=start)
    batches, seen = [], set()
    for i in order:
        out = former.add(_group(i))
        seen.add(i)
        batches += out
        # Released as soon as possible: exactly the leading batches that are complete.
        ready = 0
        while True:
            lo, hi = start + ready * size, min(start + (ready + 1) * size, start + n)
            if lo >= start + n or not all(j in seen for j in range(lo, hi)):
                break
            if not declare and hi - lo < size:  # an open round never guesses its end
                break
            ready += 1
        assert len(batches) == ready
        assert former.pending == len(seen) - sum(len(b) for b in batches)
    last = former.flush()
    if last is not None:
        assert not declare
        batches.append(last)
    expected = [list(range(lo, min(lo + size, start + n))) for lo in range(start, start + n, size)]
    assert _indices(batches) == expected  # batch k == indices of batch k, in order, each once
    assert former.pending == 0 and former.flush() is None


def test_ordered_last_batch_smaller_when_declared():
    former = OrderedBatches(4, num_groups=10)
    out = []
    for i in [9, 8, 3, 2, 1, 7, 6, 5, 4]:
        out += former.add(_group(i))
    assert out == [] and former.pending == 9  # index 0 (the frontier) is missing
    out += former.add(_group(0))  # the frontier arrives: all three batches release at once
    assert _indices(out) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert former.next_index == 10 and former.flush() is None


def test_ordered_holds_later_batches_until_earlier_ones_release():
    former = OrderedBatches(2)
    assert former.add(_group(3)) == [] and former.add(_group(2)) == []  # batch 1 complete, held
    assert former.add(_group(0)) == []
    assert _indices(former.add(_group(1))) == [[0, 1], [2, 3]]


def test_ordered_rejects_duplicates_naming_the_index():
    former = OrderedBatches(3, num_groups=6)
    former.add(_group(4))
    with pytest.raises(ValueError, match=r"Duplicate index 4.*\(0, 14\).*\(0, 4\)"):
        former.add(_group(4, uid=14))
    for i in range(3):
        former.add(_group(i))
    with pytest.raises(ValueError, match="index 1, whose batch was already released"):
        former.add(_group(1, uid=11))


def test_ordered_rejects_indices_outside_the_round():
    former = OrderedBatches(2, num_groups=4, start=2)
    with pytest.raises(ValueError, match=r"index 1; expected 2 <= index < 6"):
        former.add(_group(1))
    with pytest.raises(ValueError, match=r"index 6; expected 2 <= index < 6"):
        former.add(_group(6))
    former.add(_group(2))
    with pytest.raises(ValueError, match="from round 1; this former serves round 0"):
        former.add(_group(3, round=1))


def test_ordered_flush_releases_a_gap_free_partial_batch():
    former = OrderedBatches(4)  # open-ended round
    for i in [5, 0, 1, 2, 3, 4]:
        former.add(_group(i))
    assert former.pending == 2 and former.next_index == 4
    assert _indices([former.flush()]) == [[4, 5]]
    assert former.next_index == 8
    with pytest.raises(ValueError, match="already released"):
        former.add(_group(6))  # flushed batch is closed: a late group is an error, not a batch


def test_ordered_flush_refuses_to_skip_missing_groups():
    former = OrderedBatches(4)
    for i in [0, 2, 3, 6]:
        former.add(_group(i))
    with pytest.raises(ValueError, match=r"3 groups missing \(indices \[1, 4, 5\].*index 6"):
        former.flush()


def test_make_former():
    assert isinstance(make_former("fifo", 4), FifoBatches)
    ordered = make_former("ordered", 4, num_groups=6)
    assert isinstance(ordered, OrderedBatches) and ordered.num_groups == 6
    with pytest.raises(ValueError, match=r"'lifo'; expected one of \['fifo', 'ordered'\]"):
        make_former("lifo", 4)  # type: ignore[arg-type]


def test_a_registered_former_is_made_by_name_and_names_are_not_replaced():
    made = []

    @register_former("test_counting")
    def counting(size, num_groups=None):
        made.append((size, num_groups))
        return FifoBatches(size, num_groups)

    try:
        assert isinstance(make_former("test_counting", 2, 4), FifoBatches) and made == [(2, 4)]
        with pytest.raises(ValueError, match="'fifo' is already registered"):
            register_former("fifo")(counting)
    finally:
        del FORMERS["test_counting"]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(size=0), "size must be an int >= 1; received 0"),
        (dict(size=2, num_groups=-1), "num_groups must be None or an int >= 0; received -1"),
        (dict(size=2, start=-3), "start must be an int >= 0; received -3"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        OrderedBatches(**kwargs)
    if "start" not in kwargs:
        with pytest.raises(ValueError, match=match):
            FifoBatches(**kwargs)
