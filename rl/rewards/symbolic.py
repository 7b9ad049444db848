"""Symbolic answer checks for math answers that are not one number, with math-verify.

`symbolic_equal("\\frac{\\pi}{2}", "\\pi/2")` parses both sides as LaTeX (math-verify's parser,
built on latex2sympy and sympy) and asks whether they are the same mathematical object:
equivalent expressions ("(x+1)^2" and "x^2+2x+1"), radicals, intervals, sets and tuples.

math-verify's own timeouts use SIGALRM, which works only on the main thread; rewards run on
worker threads or processes, so they are switched off here and the caller bounds the time
(`rl.rewards.RewardRunner` does, and with `backend="process"` kills a call that hangs).
"""

from __future__ import annotations

import functools
import logging

import math_verify

# math-verify warns on every call that its signal timeouts are off; the runner bounds the time.
logging.getLogger("math_verify").setLevel(logging.ERROR)


@functools.lru_cache(maxsize=4096)
def parse_latex(text: str) -> tuple:
    """The parsed forms of `text` (a LaTeX answer, "$" delimiters optional); () if unparsable."""
    text = text.strip()
    if not text:
        return ()
    if not (text.startswith("$") or text.startswith("\\(") or text.startswith("\\[")):
        text = f"${text}$"
    try:
        return tuple(math_verify.parse(text, parsing_timeout=None))
    except Exception:  # a parser error is "not an answer", never a crash of the reward
        return ()


def symbolic_equal(got: str, answer: str) -> bool:
    """Whether the LaTeX answer `got` is mathematically equal to the reference `answer`.

    Args:
        got: The response's answer, e.g. the content of its last \\boxed{}.
        answer: The reference answer, e.g. "\\frac{\\sqrt{3}}{2}" or "(1, 2)".

    Returns:
        True if both parse and math-verify finds them equal; False otherwise.
    """
    gold, pred = parse_latex(answer), parse_latex(got)
    if not gold or not pred:
        return False
    try:
        return bool(math_verify.verify(list(gold), list(pred), timeout_seconds=None))
    except Exception:
        return False
