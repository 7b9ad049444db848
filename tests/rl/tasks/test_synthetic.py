"""Tests for rl/tasks/synthetic.py: held-out splits, determinism, reachable countdown targets."""

from __future__ import annotations

import ast
import collections
import json
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rl.tasks.synthetic import addition_records, countdown_records

_OPS = {ast.Add: Fraction.__add__, ast.Sub: Fraction.__sub__, ast.Mult: Fraction.__mul__}


def evaluate(expression: str) -> tuple[Fraction, list[int]]:
    """Exact value of an arithmetic expression (+ - * / and parentheses) and its integer leaves.

    Walks the ast itself (no eval): anything but integer constants and the four operators fails.
    """
    leaves: list[int] = []

    def walk(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            leaves.append(node.value)
            return Fraction(node.value)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            return walk(node.left) / walk(node.right)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.left), walk(node.right))
        raise ValueError(f"unexpected node {ast.dump(node)} in {expression!r}")

    return walk(ast.parse(expression, mode="eval").body), leaves


def test_evaluate_rejects_other_syntax():
    assert evaluate("(3 + 5) * 2 / 4 - 1") == (Fraction(3), [3, 5, 2, 4, 1])
    for bad in ("__import__('os')", "2 ** 3", "x + 1", "1.5 + 1"):
        with pytest.raises(ValueError):
            evaluate(bad)


def _problems(records):
    return {(r["a"], r["b"]) for r in records}


def test_addition_records_are_correct_and_distinct():
    records = addition_records(500, digits=3, seed=1)
    assert [r["id"] for r in records] == list(range(500))
    assert len(_problems(records)) == 500
    for r in records:
        assert 0 <= r["a"] < 1000 and 0 <= r["b"] < 1000
        assert r["question"] == f"{r['a']}+{r['b']}=" and r["answer"] == str(r["a"] + r["b"])
    json.dumps(records)  # records are JSON-serializable


@pytest.mark.parametrize("digits", [2, 5])  # enumerated and sampled problem spaces
def test_addition_heldout_never_overlaps_train(digits):
    train = addition_records(3000, digits=digits, seed=7)
    heldout = addition_records(300, digits=digits, seed=7, split="heldout")
    assert len(heldout) == 300 and not _problems(train) & _problems(heldout)


def test_addition_split_changes_with_seed():
    train = _problems(addition_records(3000, digits=2, seed=7))
    assert _problems(addition_records(300, digits=2, seed=8, split="heldout")) & train


def test_addition_split_partitions_the_problem_space():
    # digits=1: 100 problems; the two splits hold all of them, each once.
    counts = {}
    for split in ("train", "heldout"):
        with pytest.raises(ValueError, match=r"found only (\d+) distinct problems") as e:
            addition_records(101, digits=1, seed=3, split=split)
        counts[split] = int(str(e.value).split("found only ")[1].split()[0])
    assert counts["train"] + counts["heldout"] == 100
    assert 0 < counts["heldout"] < 30  # ~10% held out
    train = addition_records(counts["train"], digits=1, seed=3)
    heldout = addition_records(counts["heldout"], digits=1, seed=3, split="heldout")
    assert _problems(train) | _problems(heldout) == {(a, b) for a in range(10) for b in range(10)}


def test_addition_split_agrees_across_digits():
    heldout_small = _problems(addition_records(50, digits=2, seed=0, split="heldout"))
    train_large = _problems(addition_records(20000, digits=3, seed=0))
    assert not heldout_small & train_large


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**32), fraction=st.floats(0.05, 0.5), digits=st.sampled_from([2, 5]))
def test_addition_deterministic_prefix_and_disjoint(seed, fraction, digits):
    kwargs = {"digits": digits, "seed": seed, "heldout_fraction": fraction}
    heldout = addition_records(60, split="heldout", **kwargs)
    assert addition_records(40, split="heldout", **kwargs) == heldout[:40]
    train = addition_records(2000, **kwargs)
    assert addition_records(2000, **kwargs) == train
    assert not _problems(train) & _problems(heldout)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"digits": 0}, r"digits must be an int in \[1, 9\]; received 0"),
        ({"split": "test"}, r"split must be one of .*received 'test'"),
        ({"heldout_fraction": 1.0}, r"heldout_fraction must be in \(0, 1\); received 1.0"),
        ({"seed": -1}, r"seed must be an int >= 0; received -1"),
    ],
)
def test_addition_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        addition_records(5, **kwargs)


def _countdown_problem(r):
    return tuple(sorted(r["numbers"])), r["target"]


@pytest.mark.parametrize(
    "count, max_number, max_target", [(4, 100, None), (3, 20, 50), (2, 30, 60)]
)
def test_countdown_targets_are_reachable(count, max_number, max_target):
    records = countdown_records(200, count=count, max_number=max_number, max_target=max_target)
    for r in records:
        value, leaves = evaluate(r["answer"])
        assert value == r["target"], r
        assert collections.Counter(leaves) == collections.Counter(r["numbers"]), r
        assert len(r["numbers"]) == count and all(1 <= x <= max_number for x in r["numbers"])
        assert isinstance(r["target"], int) and r["target"] > 0
        assert max_target is None or r["target"] <= max_target
        assert str(r["numbers"]) in r["question"] and f"equals {r['target']}." in r["question"]
    assert len({_countdown_problem(r) for r in records}) == 200
    json.dumps(records)


def test_countdown_heldout_never_overlaps_train_and_is_deterministic():
    kwargs = {"count": 3, "max_number": 30, "max_target": 100, "seed": 5}
    train = countdown_records(1000, **kwargs)
    heldout = countdown_records(200, split="heldout", **kwargs)
    assert not {_countdown_problem(r) for r in train} & {_countdown_problem(r) for r in heldout}
    assert countdown_records(1000, **kwargs) == train
    assert countdown_records(150, split="heldout", **kwargs) == heldout[:150]
    assert countdown_records(200, **{**kwargs, "seed": 6}) != train[:200]


def test_countdown_bad_arguments_and_exhausted_space():
    with pytest.raises(ValueError, match=r"count must be an int >= 2; received 1"):
        countdown_records(3, count=1)
    with pytest.raises(ValueError, match=r"max_target must be None or >= 1; received 0"):
        countdown_records(3, max_target=0)
    with pytest.raises(ValueError, match=r"found only \d+ distinct problems .* expected n=20"):
        countdown_records(20, count=2, max_number=2)  # at most 3 * 4 distinct problems


def test_addition_padded_and_reversed_format_keeps_the_problems_and_split():
    plain = addition_records(300, digits=3, seed=2)
    fancy = addition_records(300, digits=3, seed=2, pad=True, reverse=True)
    assert [(r["a"], r["b"]) for r in plain] == [(r["a"], r["b"]) for r in fancy]
    for r in fancy:
        a, b = r["a"], r["b"]
        assert r["question"] == f"{a:03d}+{b:03d}=" and len(r["question"]) == 8
        assert r["answer"] == f"{a + b:04d}"[::-1] and int(r["answer"][::-1]) == a + b
    held = addition_records(50, digits=3, seed=2, split="heldout", pad=True)
    assert {(r["a"], r["b"]) for r in held}.isdisjoint((r["a"], r["b"]) for r in fancy)


def test_addition_with_reversed_operands_puts_each_column_at_fixed_offsets():
    fancy = addition_records(300, digits=3, seed=2, pad=True, reverse=True, reverse_operands=True)
    plain = addition_records(300, digits=3, seed=2)
    assert [(r["a"], r["b"]) for r in plain] == [(r["a"], r["b"]) for r in fancy]
    for r in fancy:
        a, b = r["a"], r["b"]
        assert r["question"] == f"{a:03d}"[::-1] + "+" + f"{b:03d}"[::-1] + "="
        q, ans = r["question"], r["answer"]
        # answer digit i is predicted from position len(q) - 1 + i; it adds the digits at i and 4 + i
        for i in range(3):
            assert (int(q[i]) + int(q[4 + i]) + _carry(a, b, i)) % 10 == int(ans[i])
    unpadded = addition_records(20, digits=3, seed=2, reverse_operands=True)
    assert all(r["question"] == f"{str(r['a'])[::-1]}+{str(r['b'])[::-1]}=" for r in unpadded)


def _carry(a: int, b: int, i: int) -> int:
    """The carry into column i (0 = units) of a + b."""
    m = 10**i
    return (a % m + b % m) // m


def test_countdown_compact_style_keeps_the_problems_and_split():
    kw = dict(count=3, max_number=20, max_target=100, seed=1)
    words = countdown_records(200, **kw)
    compact = countdown_records(200, style="compact", **kw)
    assert [(r["numbers"], r["target"]) for r in words] == [
        (r["numbers"], r["target"]) for r in compact
    ]
    for w, c in zip(words, compact, strict=True):
        assert c["question"] == " ".join(map(str, c["numbers"])) + f" -> {c['target']}:"
        assert c["answer"] == w["answer"].replace(" ", "")
        value, leaves = evaluate(c["answer"])
        assert value == c["target"] and sorted(leaves) == sorted(c["numbers"])
    with pytest.raises(ValueError, match=r"style='terse'; expected one of \('words', 'compact'\)"):
        countdown_records(3, style="terse")
