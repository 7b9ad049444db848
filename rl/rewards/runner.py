"""RewardRunner: a text reward function made into the sampler's RewardFn, with a timeout.

`RewardRunner(fn, decode=tokenizer.decode)(request, completion)` decodes the completion's tokens
and calls `fn(request, text)` on a worker thread, waiting at most `timeout_s`. A reward that
raises, returns something other than a finite number, or runs past the timeout scores 0.0 and is
counted (`stats()`); the first of each kind is logged with an example, the rest only counted, so
one bad reward function or dataset row never stops the sampler and never floods the log.

Python threads cannot be killed: a call past its timeout is abandoned, its thread running on
until the function returns. A fresh worker takes its place at once, so capacity is kept; the
workers are daemon threads, so a hung call does not block interpreter exit. Stuck threads still
take their share of the GIL, so more than `max_stuck` of them at once raises a RuntimeError
rather than letting them pile up.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

from absl import logging

from rl.rewards.registry import TextRewardFn
from rl.types import Completion, Request


@dataclasses.dataclass(eq=False)
class _Job:
    request: Request
    tokens: Sequence[int]
    future: concurrent.futures.Future = dataclasses.field(default_factory=concurrent.futures.Future)
    abandoned: bool = False  # timed out while running: its thread leaves once the call returns


class RewardRunner:
    """Calls a text reward function with a timeout; errors and timeouts score 0.0 and are counted.

    Thread-safe: may be called from several threads at once (up to `workers` calls then run in
    parallel; the timeout includes any wait for a free worker).
    """

    def __init__(
        self,
        fn: TextRewardFn,
        *,
        decode: Callable[[Sequence[int]], str],
        timeout_s: float = 5.0,
        workers: int = 4,
        max_stuck: int = 32,
    ):
        """Starts the workers.

        Args:
            fn: `fn(request, completion_text) -> float`, e.g. `rl.rewards.get_reward("math")`.
            decode: Turns a completion's tokens into the text `fn` reads.
            timeout_s: How long one call (decode and `fn`) may take before it scores 0.0.
            workers: Worker threads kept available.
            max_stuck: Abandoned calls that may still be running at once before a timeout raises.
        """
        if not (timeout_s > 0 and math.isfinite(timeout_s)):
            raise ValueError(f"timeout_s must be a finite number > 0; received {timeout_s}.")
        if workers < 1:
            raise ValueError(f"workers must be >= 1; received {workers}.")
        if max_stuck < 0:
            raise ValueError(f"max_stuck must be >= 0; received {max_stuck}.")
        self.fn, self.decode = fn, decode
        self.timeout_s, self.workers, self.max_stuck = timeout_s, workers, max_stuck
        self.name = getattr(fn, "__qualname__", repr(fn))
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._calls = self._errors = self._timeouts = self._stuck = self._replaced = 0
        self._logged: set[str] = set()
        self._closed = False
        self._spawned = 0
        for _ in range(workers):
            self._spawn()

    # ------------------------------------------------------------------------------ the sampler

    def __call__(self, request: Request, completion: Completion) -> float:
        """The reward of a finished completion: `fn(request, decode(tokens))`, or 0.0 on failure."""
        job = _Job(request, completion.tokens)
        with self._lock:
            if self._closed:
                raise RuntimeError(f"RewardRunner({self.name}) is closed; expected an open one.")
            self._calls += 1
        self._jobs.put(job)
        done, _ = concurrent.futures.wait([job.future], timeout=self.timeout_s)
        if not done:
            self._abandon(job)
            return 0.0
        error = job.future.exception()
        if error is not None:
            self._count_error(
                "exception", "Reward %s raised on request uid=%d round=%d: %r", request, error
            )
            return 0.0
        value = job.future.result()
        reward = _as_finite_float(value)
        if reward is None:
            self._count_error(
                "invalid value",
                "Reward %s returned an invalid value for request uid=%d round=%d: %r; expected "
                "a finite real number",
                request,
                value,
            )
            return 0.0
        return reward

    # --------------------------------------------------------------------------------- counters

    @property
    def calls(self) -> int:
        return self._calls

    @property
    def errors(self) -> int:
        """Calls that raised or returned something other than a finite number."""
        return self._errors

    @property
    def timeouts(self) -> int:
        return self._timeouts

    def stats(self) -> dict[str, int]:
        """Counters: calls, errors, timeouts, stuck (abandoned calls still running), replaced."""
        with self._lock:
            return {
                "calls": self._calls,
                "errors": self._errors,
                "timeouts": self._timeouts,
                "stuck": self._stuck,
                "replaced": self._replaced,  # workers started to stand in for stuck ones
            }

    def close(self) -> None:
        """Stops the workers once queued calls finish; never waits for stuck calls. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for _ in range(self.workers):
            self._jobs.put(None)

    def __enter__(self) -> RewardRunner:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # --------------------------------------------------------------------------------- internals

    def _spawn(self) -> None:
        self._spawned += 1
        name = f"reward-{self.name}-{self._spawned}"
        threading.Thread(target=self._work, name=name, daemon=True).start()

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            if not job.future.set_running_or_notify_cancel():
                continue  # timed out while queued
            try:
                value = self.fn(job.request, self.decode(job.tokens))
            except BaseException as e:  # handed to the caller, which scores 0.0 or re-raises
                job.future.set_exception(e)
            else:
                job.future.set_result(value)
            with self._lock:
                if job.abandoned:  # a replacement already took this worker's place
                    self._stuck -= 1
                    return

    def _abandon(self, job: _Job) -> None:
        """Counts a timeout; a running call is abandoned and a fresh worker replaces its thread."""
        with self._lock:
            self._timeouts += 1
            first = "timeout" not in self._logged
            self._logged.add("timeout")
            running = not job.future.cancel() and not job.future.done()
            if running:
                if self._stuck >= self.max_stuck:
                    raise RuntimeError(
                        f"Reward {self.name}: {self._stuck + 1} calls are stuck past timeout_s="
                        f"{self.timeout_s} (threads cannot be killed); expected at most "
                        f"max_stuck={self.max_stuck}. The last was request uid={job.request.uid}."
                    )
                job.abandoned = True
                self._stuck += 1
                self._replaced += 1
                if not self._closed:
                    self._spawn()
        if first:
            logging.warning(
                "Reward %s took over timeout_s=%s on request uid=%d round=%d; scored 0.0 and the "
                "call abandoned (its thread runs on: threads cannot be killed). Later timeouts "
                "are only counted: see RewardRunner.stats().",
                self.name,
                self.timeout_s,
                job.request.uid,
                job.request.round,
            )

    def _count_error(self, kind: str, message: str, request: Request, detail: Any) -> None:
        with self._lock:
            self._errors += 1
            first = kind not in self._logged
            self._logged.add(kind)
        if first:
            logging.warning(
                message + "; scored 0.0. Later errors of this kind are only counted: see "
                "RewardRunner.stats().",
                self.name,
                request.uid,
                request.round,
                detail,
            )


def _as_finite_float(value: Any) -> float | None:
    """`float(value)` for a finite real (bool, int, float, numpy or jax scalar); else None."""
    if isinstance(value, (str, bytes, bytearray, complex)) or not hasattr(value, "__float__"):
        return None
    try:
        reward = float(value)
    except (TypeError, ValueError, OverflowError):
        return None
    return reward if math.isfinite(reward) else None
