"""Answer verifiers for verifiable rewards: pure Python, strings and Fractions, never `eval`.

Numbers are compared as `fractions.Fraction`s, so "0.50" equals "1/2" and "\\frac{1}{2}" exactly;
a tolerance applies only where one side is written as a decimal or is a float. Countdown
expressions are parsed with `ast` and evaluated by a small walker that knows only + - * /.
"""

from __future__ import annotations

import ast
import collections
import math
import numbers as numbers_lib
import re
from collections.abc import Sequence
from fractions import Fraction
from operator import add, mul, sub, truediv

from rl.rewards.symbolic import parse_latex, symbolic_equal

Number = int | float | Fraction

_DECIMAL = r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?|[-+]?\.\d+"
_DECIMAL_RE = re.compile(_DECIMAL)
_SLASH_RE = re.compile(rf"({_DECIMAL})\s*/\s*({_DECIMAL})")
_FRAC_RE = re.compile(r"([-+]?)\\[dt]?frac\s*(?:\{([^{}]*)\}\s*\{([^{}]*)\}|(\d)(\d))")
# The minus of "10-3" is an operator, not a sign: a sign may not follow a word or a closing bracket.
_NUMBER_TOKEN_RE = re.compile(
    r"(?:(?<![\w)\]}])-)?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?(?:/\d+)?"
)
_BOX_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
_ANSWER_TAG_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_MAX_EXPRESSION_CHARS = 200
_MAX_EXPRESSION_NODES = 50
_OPS = {ast.Add: add, ast.Sub: sub, ast.Mult: mul, ast.Div: truediv}
_CHAR_FIXES = str.maketrans({"\u2212": "-", "\u00d7": "*", "\u00f7": "/", "\u2013": "-"})


def parse_number(text: str) -> Fraction | None:
    """Parses one number written as text; None if `text` is not exactly one number.

    Accepts integers, signs, decimals, thousands commas ("1,234"), "a/b" ("-2/3"), LaTeX
    `\\frac{a}{b}` / `\\dfrac` / `\\tfrac` (and `\\frac12`), surrounded by spaces, `$...$`,
    `\\(...\\)` or braces. Percentages, units and scientific notation are not numbers here.

    Args:
        text: The text to parse.

    Returns:
        The exact value, or None.
    """
    if not isinstance(text, str):
        return None
    s = text.translate(_CHAR_FIXES).replace("{,}", ",").replace("\\!", "").replace("\\,", "")
    s = s.strip()
    for left, right in (("$", "$"), ("\\(", "\\)"), ("\\[", "\\]"), ("{", "}")):
        while len(s) >= len(left) + len(right) and s.startswith(left) and s.endswith(right):
            s = s[len(left) : len(s) - len(right)].strip()
    s = s.removeprefix("\\$").removeprefix("$").strip()
    try:
        if m := _FRAC_RE.fullmatch(s):
            num, den = parse_number(m[2] or m[4]), parse_number(m[3] or m[5])
            if num is None or den is None or den == 0:
                return None
            return -num / den if m[1] == "-" else num / den
        if m := _SLASH_RE.fullmatch(s):
            num, den = Fraction(m[1].replace(",", "")), Fraction(m[2].replace(",", ""))
            return None if den == 0 else num / den
        if _DECIMAL_RE.fullmatch(s):
            return Fraction(s.replace(",", ""))
    except ValueError:  # e.g. more digits than int() converts (sys.get_int_max_str_digits)
        return None
    return None


def extract_last_number(text: str) -> str | None:
    """The last number-looking token in `text` ("-3", "1234.5", "3/4"), commas removed; or None."""
    matches = _NUMBER_TOKEN_RE.findall(text)
    return matches[-1].replace(",", "") if matches else None


def extract_hash_answer(text: str) -> str | None:
    """The GSM8K-style answer: the rest of the line after the last "####", stripped; or None."""
    if "####" not in text:
        return None
    answer = text.rsplit("####", 1)[1].strip().split("\n", 1)[0].strip()
    return answer or None


def extract_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` / `\\fbox{...}`; None if none or it is unclosed."""
    starts = [m.end() for m in _BOX_RE.finditer(text)]
    if not starts:
        return None
    depth = 1
    for i in range(starts[-1], len(text)):
        depth += (text[i] == "{") - (text[i] == "}")
        if depth == 0:
            return text[starts[-1] : i].strip()
    return None


def _as_value(x: str | Number | None) -> tuple[Fraction | None, bool]:
    """(exact value, whether it was written inexactly: a float or a decimal string)."""
    if isinstance(x, Fraction):
        return x, False
    if isinstance(x, numbers_lib.Integral) and not isinstance(x, bool):
        return Fraction(int(x)), False
    if isinstance(x, numbers_lib.Real) and not isinstance(x, bool):
        return (Fraction(repr(float(x))), True) if math.isfinite(x) else (None, True)
    if isinstance(x, str):
        return parse_number(x), "." in x
    return None, False


def numbers_equal(a: str | Number | None, b: str | Number | None, *, rel_tol: float = 1e-6) -> bool:
    """Whether `a` and `b` are the same number.

    Strings are parsed with `parse_number` (an unparsable side is never equal). Integers and
    fractions compare exactly; where either side is a float or a decimal string, values within
    `rel_tol` of the larger magnitude also count as equal ("0.3333333" vs "1/3").
    """
    (x, x_inexact), (y, y_inexact) = _as_value(a), _as_value(b)
    if x is None or y is None:
        return False
    tol = Fraction(repr(float(rel_tol))) if x_inexact or y_inexact else 0
    return abs(x - y) <= tol * max(abs(x), abs(y))


def math_reward(response_text: str, answer: str | Number) -> float:
    """1.0 if the last `\\boxed{}` answer (or, with no box, the last number) equals `answer`.

    A numeric `answer` is compared as a number (exact fractions, see `numbers_equal`); a box
    that is not one number ("\\sqrt{4}") is then checked symbolically. An `answer` that is not
    one number ("\\frac{\\pi}{2}", "(1, 2)", "x^2+1") is compared symbolically with the box's
    content (`rl.rewards.symbolic.symbolic_equal`, math-verify); a response with no box scores
    0.0 against it. A box's content may be "x = ..."; the part after the last "=" is compared.
    An unparsable box scores 0.0 (there is no fallback to other numbers once a box is given).

    Args:
        response_text: The decoded response.
        answer: The reference answer, e.g. 42, "3/4", "\\frac{3}{4}" or "2\\sqrt{2}".

    Returns:
        1.0 or 0.0.

    Raises:
        ValueError: If `answer` is neither a number nor a parsable LaTeX expression.
    """
    # Imported here: sympy and the LaTeX parser take a second, which numeric tasks never need.

    boxed = extract_boxed(response_text)
    if _as_value(answer)[0] is None:
        if not isinstance(answer, str) or not parse_latex(answer):
            raise ValueError(
                f"math_reward: the answer must be a number or a LaTeX expression; received "
                f"{answer!r}."
            )
        if boxed is None:
            return 0.0
        return (
            1.0
            if symbolic_equal(boxed, answer) or symbolic_equal(boxed.rsplit("=", 1)[-1], answer)
            else 0.0
        )
    got = boxed.rsplit("=", 1)[-1] if boxed is not None else extract_last_number(response_text)
    if boxed is not None and parse_number(got) is None:
        return 1.0 if symbolic_equal(got, str(answer)) else 0.0
    return 1.0 if numbers_equal(got, answer) else 0.0


def gsm8k_reward(response_text: str, answer: str | Number) -> float:
    """1.0 if the number after the response's last "####" (else its last number) equals `answer`.

    `answer` may be a full GSM8K solution ("...#### 72"); its "####" answer is then used.

    Raises:
        ValueError: If `answer` is not a number.
    """
    if isinstance(answer, str) and "####" in answer:
        answer = extract_hash_answer(answer) or ""
    if _as_value(answer)[0] is None:
        raise ValueError(f"gsm8k_reward: the answer must be a number; received {answer!r}.")
    hashed = extract_hash_answer(response_text) or ""
    got = extract_last_number(hashed) or extract_last_number(response_text)
    return 1.0 if numbers_equal(got, answer) else 0.0


def _countdown_value(node: ast.AST, used: list[int]) -> Fraction:
    """Evaluates an allowed expression node exactly; raises ValueError on anything else."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        used.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        if isinstance(node.operand, ast.Constant):
            return -_countdown_value(node.operand, used)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _countdown_value(node.left, used), _countdown_value(node.right, used)
        if isinstance(node.op, ast.Div) and right == 0:
            raise ValueError("division by zero")
        return _OPS[type(node.op)](left, right)
    raise ValueError(f"not allowed in a Countdown expression: {ast.dump(node)[:80]}")


def countdown_expression(response_text: str) -> str:
    """The expression a Countdown response answers with: the last `<answer>...</answer>` if any,
    else the last non-empty line; only the part before an "=" ("(6/4)*4 = 6" -> "(6/4)*4")."""
    tagged = _ANSWER_TAG_RE.findall(response_text)
    lines = [ln for ln in (tagged[-1] if tagged else response_text).splitlines() if ln.strip()]
    text = lines[-1] if lines else ""
    return text.translate(_CHAR_FIXES).split("=", 1)[0].strip().rstrip(".").strip()


def countdown_reward(
    response_text: str, numbers: Sequence[int], target: int, *, use_all: bool = False
) -> float:
    """1.0 if the response's expression (`countdown_expression`) evaluates exactly to `target`.

    Allowed: int literals, + - * / and parentheses, unary minus on a literal. Each literal must
    be one of `numbers`, used at most as often as given (exactly, with `use_all`). Division is
    exact (Fractions), so (6/4)*4 == 6. Anything else (powers, names, calls, floats), division by
    zero, or an expression over 200 characters or 50 AST nodes scores 0.0, before any arithmetic.

    Args:
        response_text: The decoded response.
        numbers: The numbers the puzzle gives.
        target: The number to reach.
        use_all: Whether every given number must be used.

    Returns:
        1.0 or 0.0.

    Raises:
        ValueError: If `numbers` or `target` are not integers.
    """
    listed = not isinstance(numbers, str) and hasattr(numbers, "__iter__")
    given_list = list(numbers) if listed else [None]  # None: not an int, reported below
    if not (all(map(_is_int, given_list)) and _is_int(target)):
        raise ValueError(
            f"countdown_reward: expected a list of int numbers and an int target; received "
            f"numbers={numbers!r}, target={target!r}."
        )
    expression = countdown_expression(response_text)
    if not expression or len(expression) > _MAX_EXPRESSION_CHARS:
        return 0.0
    try:
        tree = ast.parse(expression, mode="eval")
        if sum(1 for _ in ast.walk(tree)) > _MAX_EXPRESSION_NODES:
            return 0.0
        used: list[int] = []
        value = _countdown_value(tree.body, used)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return 0.0
    given, counts = collections.Counter(int(n) for n in given_list), collections.Counter(used)
    if any(counts[n] > given[n] for n in counts) or (use_all and counts != given):
        return 0.0
    return 1.0 if value == int(target) else 0.0


def _is_int(x: object) -> bool:
    return isinstance(x, numbers_lib.Integral) and not isinstance(x, bool)


def format_reward(response_text: str, pattern: str, *, flags: int = re.DOTALL) -> float:
    """1.0 if the whole response matches the regex `pattern` (`re.fullmatch`), else 0.0."""
    return 1.0 if re.fullmatch(pattern, response_text, flags) else 0.0
