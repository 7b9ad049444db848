"""Answers that hang or exhaust an unguarded math verifier: launch.bench_rewards' hostile
workload, and tests/rl/rewards/test_verifiers.py's cases (a module without flags, so a test can
import it beside a launcher's)."""

# Short answers on which sympy computes for hours or runs out of memory if it evaluates them.
HOSTILE = [
    "9^{9^{9^{9}}}",
    "2^{10^{10}}",
    "(10^{9})!",
    "100000000!",
    "\\binom{10^{9}}{5\\cdot 10^{8}}",
    "(x+1)^{100000}",
    "2^{-10^{10}}",
    "(" * 400 + "1" + ")" * 400,
]
