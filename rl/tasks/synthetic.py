"""Synthetic problem generators (addition, countdown) with a held-out split fixed by the seed.

Each generator returns JSON-serializable records `{"id", "question", "answer", ...task fields}`
with ids 0..n-1 in order. A problem's split is a pure function of the problem itself and the seed:
`_unit_hash(task, seed, *problem) < heldout_fraction` puts it in "heldout", anything else is
"train". So, for one seed (and one heldout_fraction), a train problem never appears in the held-out
set, whatever n, digits or count was asked for and in whichever process it is generated; a new
seed draws a new split. Within one call the problems are distinct, and a call with a larger n
returns the records of a smaller one as a prefix.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from fractions import Fraction
from typing import Any, Literal

import numpy as np

Split = Literal["train", "heldout"]
SPLITS = ("train", "heldout")
_ENUMERATE_LIMIT = 1 << 20  # problem spaces up to this size are enumerated, larger ones sampled


def _unit_hash(*parts: Any) -> float:
    """A uniform number in [0, 1) from `parts`, stable across processes and Python versions."""
    digest = hashlib.blake2b(repr(parts).encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64


def _check_common(where: str, n: int, seed: int, split: str, heldout_fraction: float) -> None:
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"{where}: n must be an int >= 0; received {n!r}.")
    if not isinstance(seed, int) or seed < 0:
        raise ValueError(f"{where}: seed must be an int >= 0; received {seed!r}.")
    if split not in SPLITS:
        raise ValueError(f"{where}: split must be one of {SPLITS}; received {split!r}.")
    if not 0.0 < heldout_fraction < 1.0:
        raise ValueError(
            f"{where}: heldout_fraction must be in (0, 1); received {heldout_fraction!r}."
        )


def _take(
    where: str,
    n: int,
    draws: Iterator[tuple[Any, dict[str, Any]]],
    in_split: Callable[[Any], bool],
    max_attempts: int,
) -> list[dict[str, Any]]:
    """The first n distinct in-split problems of `draws`, numbered 0..n-1."""
    seen: set[Any] = set()
    records: list[dict[str, Any]] = []
    attempts = 0
    for key, record in draws:
        if len(records) == n or attempts == max_attempts:
            break
        attempts += 1
        if key not in seen and in_split(key):
            seen.add(key)
            records.append({"id": len(records), **record})
    if len(records) < n:
        raise ValueError(
            f"{where}: found only {len(records)} distinct problems of the split in {attempts} "
            f"draws; expected n={n}. Ask for fewer, or widen the problem space."
        )
    return records


def addition_records(
    n: int,
    *,
    digits: int = 3,
    seed: int = 0,
    split: Split = "train",
    heldout_fraction: float = 0.1,
    pad: bool = False,
    reverse: bool = False,
    reverse_operands: bool = False,
) -> list[dict[str, Any]]:
    """Returns n distinct problems "a+b=" -> "a+b", with a, b uniform in [0, 10**digits).

    The split of (a, b) depends only on (seed, a, b), so it also agrees across `digits`.

    Args:
        n: How many records.
        digits: Operands have 1..digits digits, in [1, 9].
        seed: Fixes both the problem order and the split.
        split: "train" or "heldout".
        heldout_fraction: The share of all problems that is held out, in (0, 1).
        pad: Zero-pad the operands to `digits` and the sum to `digits + 1` digits
            ("007+095=" -> "0102"): every digit sits at a fixed position.
        reverse: Write the answer least-significant digit first ("123+459=" -> "285"; padded
            "0582" -> "2850"), the order in which a left-to-right decoder can compute each digit
            from the operands and its own previous carry (Lee et al. 2023, "Teaching Arithmetic
            to Small Transformers").
        reverse_operands: Write the operands least-significant digit first too (padded
            "007+095=" -> "700+590="). With both reversed, each answer digit sits at the same
            distance from the two operand digits it adds, whatever its index: what relative
            position encodings (RoPE) find without learning absolute positions. None of these
            options changes the problems or the split.

    Returns:
        Records {"id", "question": "a+b=", "answer", "a", "b"}; answer is str(a + b) (padded
        and reversed as asked): score it with the "exact" or "digits" reward.
    """
    where = "addition_records"
    _check_common(where, n, seed, split, heldout_fraction)
    if not isinstance(digits, int) or not 1 <= digits <= 9:
        raise ValueError(f"{where}: digits must be an int in [1, 9]; received {digits!r}.")
    hi = 10**digits
    want_heldout = split == "heldout"

    def in_split(key: Any) -> bool:
        return (_unit_hash("addition", seed, *key) < heldout_fraction) == want_heldout

    def record(a: int, b: int) -> tuple[Any, dict[str, Any]]:
        x, y = (f"{a:0{digits}d}", f"{b:0{digits}d}") if pad else (str(a), str(b))
        if reverse_operands:
            x, y = x[::-1], y[::-1]
        question = f"{x}+{y}="
        answer = f"{a + b:0{digits + 1}d}" if pad else str(a + b)
        answer = answer[::-1] if reverse else answer
        return (a, b), {"question": question, "answer": answer, "a": a, "b": b}

    def enumerated() -> Iterator[tuple[Any, dict[str, Any]]]:
        for k in np.random.default_rng(seed).permutation(hi * hi):
            yield record(*divmod(int(k), hi))

    def sampled() -> Iterator[tuple[Any, dict[str, Any]]]:
        rng = np.random.default_rng(seed)
        while True:
            for a, b in rng.integers(0, hi, size=(1024, 2)).tolist():
                yield record(a, b)

    if hi * hi <= _ENUMERATE_LIMIT:
        return _take(where, n, enumerated(), in_split, max_attempts=hi * hi)
    share = heldout_fraction if want_heldout else 1.0 - heldout_fraction
    return _take(where, n, sampled(), in_split, max_attempts=int(1000 + 100 * n / share))


def _countdown_draw(
    rng: np.random.Generator, count: int, max_number: int, max_target: int | None
) -> tuple[list[int], int, str] | None:
    """Random numbers, a random expression using each once, and its (positive integer) value.

    Two pool items are combined with an operator that keeps the value a positive integer (+ and *
    always, a - b when a > b, a / b when b divides a) and, if `max_target` is set, <= max_target;
    returns None if no operator qualifies.
    """
    numbers = rng.integers(1, max_number + 1, size=count).tolist()
    pool: list[tuple[Fraction, str]] = [(Fraction(x), str(x)) for x in numbers]
    while len(pool) > 1:
        i = int(rng.integers(len(pool)))
        j = int(rng.integers(len(pool) - 1))
        j += j >= i
        (x, x_text), (y, y_text) = pool[i], pool[j]
        values = {"+": x + y, "*": x * y, "-": x - y, "/": x / y}
        ops = [
            op
            for op, v in values.items()
            if v > 0 and v.denominator == 1 and (max_target is None or v <= max_target)
        ]
        if not ops:
            return None
        op = ops[int(rng.integers(len(ops)))]
        left = x_text if x_text.isdigit() else f"({x_text})"
        right = y_text if y_text.isdigit() else f"({y_text})"
        pool = [p for k, p in enumerate(pool) if k not in (i, j)] + [
            (values[op], f"{left} {op} {right}")
        ]
    target, expression = pool[0]
    return numbers, int(target), expression


COUNTDOWN_STYLES = ("words", "compact")


def countdown_question(numbers: list[int], target: int, style: str = "words") -> str:
    """The prompt text of a countdown problem.

    "words" is the wording of TinyZero's countdown task (for pretrained models); "compact" is
    "3 5 2 -> 16:" (for models trained from scratch, where the 150 constant characters of the
    wording would be most of every sequence's compute).
    """
    if style == "compact":
        return f"{' '.join(map(str, numbers))} -> {target}:"
    if style != "words":
        raise ValueError(f"countdown style={style!r}; expected one of {COUNTDOWN_STYLES}.")
    return (
        f"Using the numbers {numbers}, create an equation that equals {target}. You can use basic "
        "arithmetic operations (+, -, *, /) and each number can only be used once."
    )


def countdown_records(
    n: int,
    *,
    count: int = 4,
    max_number: int = 100,
    max_target: int | None = None,
    seed: int = 0,
    split: Split = "train",
    heldout_fraction: float = 0.1,
    style: str = "words",
) -> list[dict[str, Any]]:
    """Returns n distinct countdown problems: reach "target" using each of "numbers" once.

    Targets are reachable by construction: a random expression over all the numbers is built and
    evaluated (every intermediate value a positive integer) and becomes the reference "answer".
    A problem is (sorted numbers, target): its split ignores the order the numbers are shown in.

    Args:
        n: How many records.
        count: How many numbers per problem, >= 2.
        max_number: Numbers are uniform in [1, max_number].
        max_target: If set, every intermediate value and the target are <= max_target.
        seed: Fixes both the problem order and the split.
        split: "train" or "heldout".
        heldout_fraction: The share of all problems that is held out, in (0, 1).
        style: The question's wording (`countdown_question`); "compact" also writes the reference
            expression without spaces ("(3+5)*2-1"). Neither changes the problems or the split.

    Returns:
        Records {"id", "question", "answer": a reference expression such as "(3 + 5) * 2 - 1",
        "numbers": list of ints, "target": int}.
    """
    where = "countdown_records"
    _check_common(where, n, seed, split, heldout_fraction)
    if not isinstance(count, int) or count < 2:
        raise ValueError(f"{where}: count must be an int >= 2; received {count!r}.")
    if not isinstance(max_number, int) or max_number < 1:
        raise ValueError(f"{where}: max_number must be an int >= 1; received {max_number!r}.")
    if max_target is not None and max_target < 1:
        raise ValueError(f"{where}: max_target must be None or >= 1; received {max_target!r}.")
    countdown_question([1], 1, style)  # checks the style before any drawing
    want_heldout = split == "heldout"

    def in_split(key: Any) -> bool:  # key None: a draw rejected by max_target
        if key is None:
            return False
        return (_unit_hash("countdown", seed, *key) < heldout_fraction) == want_heldout

    def draws() -> Iterator[tuple[Any, dict[str, Any]]]:
        rng = np.random.default_rng(seed)
        while True:
            draw = _countdown_draw(rng, count, max_number, max_target)
            if draw is None:
                yield None, {}  # counts as an attempt; never in a split
                continue
            numbers, target, expression = draw
            record = {
                "question": countdown_question(numbers, target, style),
                "answer": expression.replace(" ", "") if style == "compact" else expression,
                "numbers": numbers,
                "target": target,
            }
            yield (tuple(sorted(numbers)), target), record

    share = heldout_fraction if want_heldout else 1.0 - heldout_fraction
    return _take(where, n, draws(), in_split, max_attempts=int(1000 + 200 * n / share))
