"""Reward calls/s of the math verifier with and without hostile answers, per runner backend.

    python -m launch.bench_rewards [--calls 400 --workers 4 --timeout_s 2 --hostile 0,0.1,0.5]

A policy's answer is hostile input: a short `\\boxed{9^{9^{9^{9}}}}` would hang sympy if it were
evaluated (rl/rewards/symbolic.py bounds what it may evaluate). Per backend of the reward runner
(`thread`, the default, and `process`) and per fraction of hostile answers, `--calls` responses
(real answers: numbers, fractions, radicals, intervals, expressions; hostile ones: power towers,
huge factorials and binomials, huge symbolic powers, deep nesting) are scored by the registered
`math` reward through rl.rewards.RewardRunner, all submitted at once. The table gives calls/s, the
ratio to the clean workload of the same backend (measured in the same process), the timeouts,
the calls still stuck after the runner closed, and whether every real answer scored as expected.
"""

from __future__ import annotations

import time

from absl import app, flags

from rl.rewards import RewardRunner, get_reward
from rl.types import Completion, Request


def real(i: int, offset: int = 0) -> tuple[str, str, float]:
    """The i-th real (response, reference answer, expected score): numbers, fractions, radicals,
    intervals, expressions, big powers, right and wrong, each with its own numbers (so no
    parse is a cache hit)."""
    k = offset + i + 1
    kinds = [
        (f"so \\boxed{{\\frac{{{k}}}{{{k + 1}}}}}", f"{k}/{k + 1}", 1.0),
        (f"\\boxed{{{k}\\sqrt{{2}}}}", f"\\sqrt{{{2 * k * k}}}", 1.0),
        (f"\\boxed{{[{k}, {k + 1})}}", f"[{k},{k + 1})", 1.0),
        (f"The answer is {k}.", f"{k}", 1.0),
        (f"\\boxed{{x^2+{2 * k}x+{k * k}}}", f"(x+{k})^2", 1.0),
        (f"\\boxed{{\\frac{{\\pi}}{{{k + 2}}}}}", f"\\pi/{k + 1}", 0.0),
        (f"\\boxed{{2^{{{2000 + k % 100}}}}}", f"2^{{{2000 + k % 100}}}", 1.0),
        (f"\\boxed{{{k}}}", f"{k + 1}", 0.0),
    ]
    return kinds[i % len(kinds)]


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

_CALLS = flags.DEFINE_integer("calls", 400, "Reward calls per backend and hostile fraction.")
_WORKERS = flags.DEFINE_integer("workers", 4, "Calls run at once (task.reward_workers).")
_TIMEOUT = flags.DEFINE_float("timeout_s", 2.0, "Per-call timeout (task.reward_timeout_s).")
_HOSTILE = flags.DEFINE_list("hostile", ["0", "0.1", "0.5"], "Fractions of hostile answers.")
_BACKENDS = flags.DEFINE_list("backends", ["thread", "process"], "Runner backends.")


def workload(calls: int, hostile: float, offset: int) -> list[tuple[str, str, float]]:
    """`calls` (response, answer, expected) triples, a `hostile` fraction of them hostile; the
    numbers in them start at `offset` (each row its own, so sympy's caches do not carry over)."""
    out, owed, h = [], 0.0, 0
    for i in range(calls):
        owed += hostile
        if owed >= 1.0:  # a hostile answer (each its own: "+ i"), against a real reference
            owed, h = owed - 1.0, h + 1
            answer = real(i, offset)[1]
            out.append((f"\\boxed{{{HOSTILE[h % len(HOSTILE)]}+{offset + i}}}", answer, 0.0))
        else:
            out.append(real(i, offset))
    return out


def _completion(uid: int, text: str) -> Completion:
    tokens = tuple(text.encode())
    return Completion(
        uid=uid,
        round=0,
        sample=0,
        prompt=(0,),
        tokens=tokens,
        logprobs=(0.0,) * len(tokens),
        versions=(0,) * len(tokens),
        finish_reason="stop",
    )


def score(runner: RewardRunner, calls: list[tuple[str, str, float]]) -> list[float]:
    futures = [
        runner.submit(
            Request(uid=i, round=0, prompt=(0,), meta={"answer": answer}),
            _completion(i, response),
        )
        for i, (response, answer, _) in enumerate(calls)
    ]
    return [f.result() for f in futures]


def measure(backend: str, hostile: float, offset: int) -> dict[str, float]:
    calls = workload(_CALLS.value, hostile, offset)
    runner = RewardRunner(
        get_reward("math"),
        decode=lambda tokens: bytes(tokens).decode(),
        timeout_s=_TIMEOUT.value,
        workers=_WORKERS.value,
        backend=backend,
    )
    # Not timed: worker start-up, imports and sympy's first calls, on answers of their own.
    score(runner, workload(8 * _WORKERS.value, 0.0, offset + 10**6))
    t = time.perf_counter()
    scores = score(runner, calls)
    seconds = time.perf_counter() - t
    runner.close()
    stats = runner.stats()
    return {
        "calls_per_s": len(calls) / seconds,
        "timeouts": stats["timeouts"],
        "stuck": stats["stuck"],
        "correct": all(s == e for s, (_, _, e) in zip(scores, calls, strict=True)),
    }


def main(argv: list[str]) -> None:
    del argv
    print(
        f"{_CALLS.value} math-reward calls per row, {_WORKERS.value} workers, "
        f"timeout {_TIMEOUT.value} s"
    )
    print(
        f"{'backend':<8} {'hostile':>7} {'calls/s':>8} {'vs clean':>8} {'timeouts':>8} "
        f"{'stuck':>5}  scores"
    )
    offset = 0
    for backend in _BACKENDS.value:
        clean = None
        for fraction in map(float, _HOSTILE.value):
            offset += 10 * _CALLS.value
            row = measure(backend, fraction, offset)
            clean = clean or row["calls_per_s"]
            print(
                f"{backend:<8} {fraction:>7.0%} {row['calls_per_s']:>8.1f} "
                f"{row['calls_per_s'] / clean:>7.2f}x {row['timeouts']:>8d} {row['stuck']:>5d}  "
                + ("as expected" if row["correct"] else "WRONG")
            )


if __name__ == "__main__":
    app.run(main)
