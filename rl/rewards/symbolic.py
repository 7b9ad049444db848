"""Symbolic answer checks for math answers that are not one number, with math-verify.

`symbolic_equal("\\frac{\\pi}{2}", "\\pi/2")` parses both sides as LaTeX (math-verify's parser,
built on latex2sympy and sympy) and asks whether they are the same mathematical object:
equivalent expressions ("(x+1)^2" and "x^2+2x+1"), radicals, intervals, sets and tuples.

A policy's answer is hostile input: sympy evaluates numbers as it builds them, so a short answer
can hang the parser (`9^{9^{9^{9}}}`, `2^{10^{10}}`) or the check (`(10^9)!`, `(x+1)^{100000}`).
`parse_latex` therefore first builds the expression unevaluated (`sympy.evaluate(False)`) and
bounds what evaluating it may cost (`check_cost`): answers over `MAX_CHARS` characters,
`MAX_NODES` nodes or `MAX_DEPTH` nested brackets, numbers over `MAX_DIGITS` digits (powers,
factorials, binomials, by an upper bound computed in log space) and powers of a symbolic base
over `MAX_SYMBOLIC_EXPONENT` are not parsed, so they equal nothing. Real answers stay well
inside the bounds (`2^{2014}`, `100!`; `x^{2014}` is out of them and scores 0).

math-verify's own timeouts use SIGALRM, which works only on the main thread; rewards run on
worker threads or processes, so they are switched off here and the caller bounds the time as a
second line (`rl.rewards.RewardRunner`: it stops a thread's call or kills a process's).
"""

from __future__ import annotations

import functools
import logging
import math

import math_verify
import sympy

# math-verify warns on every call that its signal timeouts are off; the runner bounds the time.
logging.getLogger("math_verify").setLevel(logging.ERROR)

MAX_CHARS = 1000  # longer "answers" are not parsed
MAX_NODES = 500  # sympy nodes of the unevaluated expression
MAX_DEPTH = 12  # nested brackets: the parser's time grows steeply with depth
MAX_DIGITS = 10_000  # the largest number evaluation may build (10^4 digits take milliseconds)
MAX_SYMBOLIC_EXPONENT = 100  # (x+1)^100 expands in 0.3 s; (x+1)^1000 takes 5 s
_LOG2 = math.log10(2)


class TooCostly(ValueError):
    """An answer whose evaluation would cost more than the bounds allow (names which)."""


def _log10_of_int(n: int) -> float:
    return max(abs(n).bit_length() * _LOG2, 0.0)


def _magnitude(expr: object, nodes: list[int]) -> float | None:
    """An upper bound of log10|value| of a numeric `expr`, or None if it is symbolic.

    Visits every node (counted in `nodes`) and raises TooCostly at the first one whose
    evaluation would exceed the bounds.
    """
    nodes[0] += 1
    if nodes[0] > MAX_NODES:
        raise TooCostly(f"over {MAX_NODES} nodes")
    if isinstance(expr, sympy.MatrixBase):
        for x in expr:
            _magnitude(x, nodes)
        return None
    if isinstance(expr, (tuple, list, set, frozenset)):
        for x in expr:
            _magnitude(x, nodes)
        return None
    if not isinstance(expr, sympy.Basic):
        return None
    if isinstance(expr, sympy.Rational):  # Integer included
        return max(_log10_of_int(expr.p), _log10_of_int(expr.q))
    if isinstance(expr, sympy.Float):
        return math.log10(abs(float(expr))) if expr != 0 and math.isfinite(expr) else 0.0
    if isinstance(expr, sympy.NumberSymbol) or expr in (sympy.I, sympy.E):
        return 1.0
    args = [_magnitude(a, nodes) for a in expr.args]
    numeric = all(a is not None for a in args) and not expr.free_symbols
    if isinstance(expr, sympy.Pow):
        base, exponent = args
        if exponent is None:
            return None  # 2^x: nothing is evaluated
        value = 10.0**exponent if exponent < 300 else math.inf  # bound of |exponent|
        if base is None:
            if value > MAX_SYMBOLIC_EXPONENT:
                raise TooCostly(
                    f"a power of a symbolic base with an exponent over {MAX_SYMBOLIC_EXPONENT}"
                )
            return None
        digits = value * max(base, _LOG2)
        if digits > MAX_DIGITS:
            raise TooCostly(f"a power of over {MAX_DIGITS} digits")
        return digits
    if isinstance(expr, (sympy.factorial, sympy.factorial2, sympy.subfactorial, sympy.gamma)):
        if args[0] is None:
            return None
        n = 10.0 ** args[0] if args[0] < 300 else math.inf
        digits = n * math.log10(max(n, 2.0))
        if digits > MAX_DIGITS:
            raise TooCostly(f"a factorial of over {MAX_DIGITS} digits")
        return digits
    if isinstance(expr, sympy.binomial):
        if args[0] is None:
            return None
        digits = (10.0 ** args[0] if args[0] < 300 else math.inf) * _LOG2
        if digits > MAX_DIGITS:
            raise TooCostly(f"a binomial of over {MAX_DIGITS} digits")
        return digits
    if not numeric:
        return None
    if isinstance(expr, sympy.Add):
        return max(args) + math.log10(len(args))
    if isinstance(expr, sympy.Mul):
        return sum(args)
    return max(args, default=0.0) + 1.0  # sqrt, log, trig...: no larger than their argument


def check_cost(text: str) -> None:
    """Raises TooCostly if evaluating the LaTeX answer `text` could take more than milliseconds.

    The answer is parsed unevaluated (fast: no number is computed) and its tree bounded; an
    answer the parser rejects passes (the real parse rejects it too).
    """
    if len(text) > MAX_CHARS:
        raise TooCostly(f"over {MAX_CHARS} characters")
    depth = deepest = 0
    for c in text:
        depth += (c in "([{") - (c in ")]}")
        deepest = max(deepest, depth)
    if deepest > MAX_DEPTH:
        raise TooCostly(f"brackets nested over {MAX_DEPTH} deep")
    try:
        with sympy.evaluate(False):
            parsed = math_verify.parse(text, parsing_timeout=None)
    except RecursionError:
        raise TooCostly("nested too deeply to parse") from None
    except Exception:
        return
    _magnitude(parsed[:1], [0])


@functools.lru_cache(maxsize=4096)
def parse_latex(text: str) -> tuple:
    """The parsed forms of `text` (a LaTeX answer, "$" delimiters optional); () if unparsable
    or too costly to evaluate (see `check_cost`)."""
    text = text.strip()
    if not text:
        return ()
    if not (text.startswith("$") or text.startswith("\\(") or text.startswith("\\[")):
        text = f"${text}$"
    try:
        check_cost(text)
        return tuple(math_verify.parse(text, parsing_timeout=None))
    except Exception:  # a parser error is "not an answer", never a crash of the reward
        return ()


def symbolic_equal(got: str, answer: str) -> bool:
    """Whether the LaTeX answer `got` is mathematically equal to the reference `answer`.

    Args:
        got: The response's answer, e.g. the content of its last \\boxed{}.
        answer: The reference answer, e.g. "\\frac{\\sqrt{3}}{2}" or "(1, 2)".

    Returns:
        True if both parse within the cost bounds and math-verify finds them equal; False
        otherwise.
    """
    gold, pred = parse_latex(answer), parse_latex(got)
    if not gold or not pred:
        return False
    try:
        return bool(math_verify.verify(list(gold), list(pred), timeout_seconds=None))
    except Exception:
        return False
