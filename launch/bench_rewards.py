"""Reward calls/s of the math verifier with and without hostile answers, per runner backend.

    python -m launch.bench_rewards [--calls 400 --workers 4 --timeout_s 2 --hostile 0,0.1,0.5]

A policy's answer is hostile input: a short `\\boxed{9^{9^{9^{9}}}}` would hang sympy if it were
evaluated (rl/rewards/symbolic.py bounds what it may evaluate). Per backend of the reward runner
(`thread`, the default, and `process`) and per fraction of hostile answers, `--calls` responses
(real answers: numbers, fractions, radicals, intervals, expressions; hostile ones: power towers,
huge factorials and binomials, huge symbolic powers, deep nesting) are scored by the registered
`math` reward through rl.rewards.RewardRunner, all submitted at once, --repeats times (fresh runner
and fresh numbers each time). The table gives calls/s (median and min-max over the repeats), the
ratio of medians to the clean workload of the same backend (measured in the same process), the
timeouts and the calls still stuck after the runner closed (summed over the repeats), and whether
every real answer scored as expected. A jax compile while scoring fails the program (compiles
timed, in this process: 0; the process backend's workers are not watched).
"""

from __future__ import annotations

import json
import time

from absl import app, flags

from launch import bench_util
from launch.hostile_answers import HOSTILE
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


_CALLS = flags.DEFINE_integer("calls", 400, "Reward calls per backend and hostile fraction.")
_WORKERS = flags.DEFINE_integer("workers", 4, "Calls run at once (task.reward_workers).")
_TIMEOUT = flags.DEFINE_float("timeout_s", 2.0, "Per-call timeout (task.reward_timeout_s).")
_HOSTILE = flags.DEFINE_list("hostile", ["0", "0.1", "0.5"], "Fractions of hostile answers.")
_BACKENDS = flags.DEFINE_list("backends", ["thread", "process"], "Runner backends.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed runs of each row; the median counts.")
_JSON = flags.DEFINE_string("json", "", "Write the rows here as JSON; empty: don't.")


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


def measure(
    backend: str, hostile: float, offset: int, watch: bench_util.CompileWatch
) -> dict[str, float]:
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
    with watch.timed():
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
        f"{'backend':<8} {'hostile':>7} {'calls/s':>8} {'min-max':>13} {'vs clean':>8} "
        f"{'timeouts':>8} {'stuck':>5}  scores"
    )
    offset, rows = 0, []
    with bench_util.CompileWatch() as watch:
        for backend in _BACKENDS.value:
            clean = None
            for fraction in map(float, _HOSTILE.value):
                runs = []
                for _ in range(_REPEATS.value):
                    offset += 10 * _CALLS.value
                    runs.append(measure(backend, fraction, offset, watch))
                rate = bench_util.spread(r["calls_per_s"] for r in runs)
                clean = clean or rate["median"]
                row = dict(
                    backend=backend,
                    hostile=fraction,
                    calls_per_s=rate["median"],
                    calls_per_s_spread=rate,
                    vs_clean=rate["median"] / clean,
                    timeouts=sum(r["timeouts"] for r in runs),
                    stuck=sum(r["stuck"] for r in runs),
                    correct=all(r["correct"] for r in runs),
                )
                rows.append(row)
                print(
                    f"{backend:<8} {fraction:>7.0%} {rate['median']:>8.1f} "
                    f"{bench_util.range_text(rate, '.1f'):>13} {row['vs_clean']:>7.2f}x "
                    f"{row['timeouts']:>8d} {row['stuck']:>5d}  "
                    + ("as expected" if row["correct"] else "WRONG")
                )
    print(f"calls/s: median of {_REPEATS.value} runs; compiles timed: {watch.compiles_timed}")
    if _JSON.value:
        with open(_JSON.value, "w") as f:
            json.dump(dict(rows=rows, compiles_timed=watch.compiles_timed), f, indent=2)
        print(f"wrote {_JSON.value}")
    bench_util.fail_if_compiled("launch.bench_rewards", watch.compiles_timed, watch.timed_names())


if __name__ == "__main__":
    app.run(main)
