"""Verifiers on tricky inputs, and the reward registry."""

import time
from fractions import Fraction

import pytest

from launch.hostile_answers import HOSTILE
from rl import rewards
from rl.rewards import verifiers as v
from rl.types import Request


@pytest.mark.parametrize(
    "text, expected",
    [
        ("42", Fraction(42)),
        ("-7", Fraction(-7)),
        ("  1,234 ", Fraction(1234)),
        ("1,234,567.5", Fraction(2469135, 2)),
        ("0.50", Fraction(1, 2)),
        ("-.25", Fraction(-1, 4)),
        ("42.", Fraction(42)),
        ("3/4", Fraction(3, 4)),
        ("-2/3", Fraction(-2, 3)),
        ("\\frac{1}{2}", Fraction(1, 2)),
        ("-\\dfrac{3}{4}", Fraction(-3, 4)),
        ("\\frac{-10}{4}", Fraction(-5, 2)),
        ("\\frac12", Fraction(1, 2)),
        ("$42$", Fraction(42)),
        ("$-3/4$", Fraction(-3, 4)),
        ("\\$1{,}000", Fraction(1000)),
        ("\u22125", Fraction(-5)),  # unicode minus
    ],
)
def test_parse_number(text, expected):
    assert v.parse_number(text) == expected


@pytest.mark.parametrize(
    "text", ["", "abc", "50%", "1,23", "1/0", "\\frac{1}{0}", "1e5", "1 2", "x=3", "nan", "--3"]
)
def test_parse_number_none(text):
    assert v.parse_number(text) is None


def test_parse_number_huge_digits_is_none_not_an_error():
    assert v.parse_number("9" * 10_000) is None  # past int()'s digit limit


@pytest.mark.parametrize(
    "text, expected",
    [
        ("The answer is -5.", "-5"),
        ("10-3", "3"),  # the minus is an operator
        ("x = -3", "-3"),
        ("total: 1,234 apples, then 2.5 more", "2.5"),
        ("$1,234,567.89 in all", "1234567.89"),
        ("so 42 is it. Hope that helps!", "42"),
        ("ate 3/4.", "3/4"),
        ("no digits here", None),
    ],
)
def test_extract_last_number(text, expected):
    assert v.extract_last_number(text) == expected


def test_extract_hash_answer():
    assert v.extract_hash_answer("Janet has 3.\n#### 42") == "42"
    assert v.extract_hash_answer("#### 1 \n#### 1,000\nmore text") == "1,000"
    assert v.extract_hash_answer("no marker 42") is None
    assert v.extract_hash_answer("####   ") is None


def test_extract_boxed():
    assert v.extract_boxed("so \\boxed{\\frac{1}{2}}.") == "\\frac{1}{2}"
    assert v.extract_boxed("\\boxed{1} then \\boxed{2} and \\fbox{ 3 }") == "3"
    assert v.extract_boxed("\\boxed{\\{a, {b}\\}} end") == "\\{a, {b}\\}"
    assert v.extract_boxed("\\boxed{2} then \\boxed{3") is None  # the last box is truncated
    assert v.extract_boxed("no box") is None


def test_numbers_equal():
    assert v.numbers_equal("0.50", "1/2")
    assert v.numbers_equal("\\frac{1}{2}", 0.5)
    assert v.numbers_equal("0.3333333", "1/3")  # decimal: within rel_tol
    assert not v.numbers_equal("0.33", "1/3")
    assert not v.numbers_equal(1_000_000, 1_000_001)  # integers are exact
    assert not v.numbers_equal("1/3", "333333/1000000")  # fractions are exact too
    assert v.numbers_equal(Fraction(6), "6")
    assert not v.numbers_equal("abc", "abc")
    assert not v.numbers_equal(None, 1)
    assert not v.numbers_equal(float("nan"), float("nan"))


def test_math_reward():
    assert v.math_reward("so \\boxed{\\frac{1}{2}}.", "0.5") == 1.0
    assert v.math_reward("first \\boxed{3} then \\boxed{4}", 4) == 1.0
    assert v.math_reward("first \\boxed{4} then \\boxed{3}", 4) == 0.0
    assert v.math_reward("\\boxed{x = -2}", "-2") == 1.0
    assert v.math_reward("The answer is 1,234. Done in 5 steps", 1234) == 0.0  # last number: 5
    assert v.math_reward("It is 7, i.e. 1,234.", 1234) == 1.0
    assert v.math_reward("\\boxed{seven} but 7", 7) == 0.0  # a box is never second-guessed
    with pytest.raises(ValueError, match="number or a LaTeX expression; received ' '"):
        v.math_reward("1", " ")
    with pytest.raises(ValueError, match="received None"):
        v.math_reward("1", None)


def test_math_reward_symbolic():
    """Answers that are not one number are checked with math-verify, not dropped."""
    # fractions and LaTeX \frac, against a numeric reference (the box is not one number)
    assert v.math_reward("\\boxed{\\frac{6}{4}}", "3/2") == 1.0
    assert v.math_reward("\\boxed{\\sqrt{4}}", 2) == 1.0
    assert v.math_reward("\\boxed{\\sqrt{5}}", 2) == 0.0
    # non-numeric references: radicals, pi, expressions, intervals, tuples, sets
    assert v.math_reward("so \\boxed{\\frac{\\pi}{2}}", "\\pi/2") == 1.0
    assert v.math_reward("\\boxed{2\\sqrt{2}}", "\\sqrt{8}") == 1.0
    assert v.math_reward("\\boxed{\\dfrac{\\sqrt{3}}{2}}", "\\frac{\\sqrt3}{2}") == 1.0
    assert v.math_reward("\\boxed{(x+1)^2}", "x^2+2x+1") == 1.0
    assert v.math_reward("\\boxed{x^2+2x+2}", "x^2+2x+1") == 0.0
    assert v.math_reward("\\boxed{y = 2\\sqrt{2}}", "2\\sqrt{2}") == 1.0
    assert v.math_reward("\\boxed{[1, 2)}", "[1,2)") == 1.0
    assert v.math_reward("\\boxed{(1, 2]}", "[1,2)") == 0.0
    assert v.math_reward("\\boxed{\\{2, 1\\}}", "\\{1,2\\}") == 1.0
    assert v.math_reward("\\boxed{\\frac{\\pi}{3}}", "\\pi/2") == 0.0
    # no box: only numbers are read from free text, so a symbolic reference scores 0
    assert v.math_reward("the answer is pi/2", "\\pi/2") == 0.0
    assert v.math_reward("\\boxed{}", "\\sqrt{2}") == 0.0


@pytest.mark.parametrize("answer", HOSTILE)
def test_math_reward_bounds_what_a_hostile_answer_costs(answer):
    # Each takes under 0.25 s on a 2-core CPU; unbounded, the worst of them would never end. The
    # bound only tells those apart (a loaded machine stays far below it); what each answer costs
    # is measured by `python -m launch.bench_rewards`.
    for reference in ("2", "x^2+1"):
        t = time.perf_counter()
        assert v.math_reward(f"\\boxed{{{answer}}}", reference) == 0.0
        assert time.perf_counter() - t < 30.0


def test_math_reward_keeps_large_real_answers():
    assert v.math_reward("\\boxed{2^{2014}}", "2^{2014}") == 1.0
    assert v.math_reward("\\boxed{2^{2014}}", "2^{2015}") == 0.0
    assert v.math_reward("\\boxed{100!}", "100!") == 1.0
    assert v.math_reward("\\boxed{(x+1)^{3}}", "x^3+3x^2+3x+1") == 1.0


def test_gsm8k_reward():
    assert v.gsm8k_reward("3 + 4 = 7\n#### 7", "7") == 1.0
    assert v.gsm8k_reward("#### 1,000 dollars.\nExtra 5", "Steps...\n#### 1000") == 1.0
    assert v.gsm8k_reward("we get -12 in the end", -12) == 1.0
    assert v.gsm8k_reward("#### 8", 7) == 0.0


@pytest.mark.parametrize(
    "text, numbers, target, expected",
    [
        ("(100 - 4) / 2", [100, 4, 2], 48, 1.0),
        ("Let me think.\n<answer>(100-4)/2 = 48</answer>\n", [2, 100, 4], 48, 1.0),
        ("(6/4)*4", [6, 4, 4], 6, 1.0),  # non-integer intermediate result, exact via Fractions
        ("3 \u00d7 4", [3, 4], 12, 1.0),
        ("-3 + 5", [3, 5], 2, 1.0),
        ("4 + 4", [4, 2], 8, 0.0),  # 4 reused
        ("4 + 6", [4, 2], 10, 0.0),  # 6 not given
        ("5 / (2 - 2)", [5, 2, 2], 0, 0.0),  # division by zero
        ("2**99999", [2, 99999], 0, 0.0),  # power refused before any arithmetic
        ("9**9**9**9", [9, 9, 9, 9], 0, 0.0),
        ("2.5 * 2", [2, 5], 5, 0.0),  # floats refused
        ("True + 4", [4], 5, 0.0),
        ("__import__('os').getpid()", [1], 1, 0.0),
        ("abs(-5)", [5], 5, 0.0),
        ("-(3 + 5)", [3, 5], -8, 0.0),  # unary minus only on a literal
        ("(1 + 2", [1, 2], 3, 0.0),  # syntax error
        ("", [1], 1, 0.0),
        ("8", [8, 3], 8, 1.0),
        ("+".join(["1"] * 10), [1] * 10, 10, 1.0),  # 29 nodes: within the limit
    ],
)
def test_countdown_reward(text, numbers, target, expected):
    assert v.countdown_reward(text, numbers, target) == expected


def test_countdown_use_all():
    assert v.countdown_reward("8", [8, 3], 8, use_all=True) == 0.0
    assert v.countdown_reward("8 * 3", [8, 3], 24, use_all=True) == 1.0


def test_countdown_refuses_oversized_expressions_quickly():
    start = time.monotonic()
    assert v.countdown_reward("+".join(["1"] * 26), [1] * 26, 26) == 0.0  # 51 chars, >50 nodes
    assert v.countdown_reward("1" + "+0" * 120, [1] + [0] * 120, 1) == 0.0  # > 200 chars
    assert v.countdown_reward("(" * 5000 + "1" + ")" * 5000, [1], 1) == 0.0
    assert v.countdown_reward("9" * 150 + "*" + "9" * 40, [9], 0) == 0.0
    assert time.monotonic() - start < 5.0  # a loose bound: these must not compute anything


def test_countdown_rejects_bad_puzzles():
    with pytest.raises(ValueError, match="received numbers='12', target=3"):
        v.countdown_reward("1+2", "12", 3)
    with pytest.raises(ValueError, match="target=3.0"):
        v.countdown_reward("1+2", [1, 2], 3.0)


def test_format_reward():
    pattern = r"<think>.*</think>\s*<answer>.*</answer>"
    assert v.format_reward("<think>a\nb</think>\n<answer>3</answer>", pattern) == 1.0
    assert v.format_reward("<answer>3</answer>", pattern) == 0.0
    assert v.format_reward("<think></think><answer>3</answer> trailing", pattern) == 0.0


def _request(**meta) -> Request:
    return Request(uid=7, round=1, prompt=(1, 2), meta=meta)


def test_registered_rewards():
    assert {"math", "gsm8k", "countdown", "exact"} <= set(rewards.REWARDS)
    assert rewards.get_reward("math")(_request(answer="1/2"), "\\boxed{0.5}") == 1.0
    assert rewards.get_reward("gsm8k")(_request(answer="... #### 72"), "#### 72") == 1.0
    countdown = rewards.get_reward("countdown")
    assert countdown(_request(numbers=[100, 4, 2], target=48), "(100-4)/2") == 1.0
    assert countdown(_request(numbers=[8, 3], target=8, use_all=True), "8") == 0.0
    assert rewards.get_reward("exact")(_request(answer=42), "  42\n") == 1.0
    assert rewards.get_reward("exact")(_request(answer=42), "42.0") == 0.0


def test_registry_errors():
    with pytest.raises(ValueError, match=r"Unknown reward 'nope'; expected one of \[.*'countdown'"):
        rewards.get_reward("nope")
    with pytest.raises(ValueError, match=r"meta\['answer'\]; received meta keys \['target'\]"):
        rewards.get_reward("math")(_request(target=1), "1")
    with pytest.raises(ValueError, match="already registered"):
        rewards.register_reward("math")(lambda request, text: 0.0)


def test_register_reward():
    @rewards.register_reward("test_length")
    def length(request: Request, completion_text: str) -> float:
        return float(len(completion_text))

    try:
        assert rewards.get_reward("test_length")(_request(), "abc") == 3.0
    finally:
        del rewards.REWARDS["test_length"]


def test_digits_reward_gives_per_position_credit_and_one_only_when_exact():
    digits = rewards.get_reward("digits")
    assert digits(_request(answer="2010"), " 2010\n") == 1.0
    assert digits(_request(answer="2010"), "2011") == 0.75
    assert digits(_request(answer="2010"), "201") == 0.0  # a wrong length earns nothing
    assert digits(_request(answer="2010"), "") == 0.0
