"""RewardRunner: a text reward function made into the sampler's RewardFn, with a timeout.

`RewardRunner(fn, decode=tokenizer.decode)(request, completion)` decodes the completion's tokens
and calls `fn(request, text)` on a worker, waiting at most `timeout_s` once a worker has taken the
call. `submit(request, completion)` does the same without waiting: it returns a Future of the
score at once, so the sampler loop scores finished samples while it keeps decoding. A reward that
raises, returns something other than a finite number, or runs past the timeout scores 0.0 and is
counted (`stats()`); the first of each kind is logged with an example, the rest only counted, so
one bad reward function or dataset row never stops the sampler and never floods the log.

`workers` calls run at once, each on one worker lane. Two backends (rl/rewards/workers.py):

- `backend="thread"` (default; any callable, closures and lambdas too): the call runs on a
  thread. A call past its timeout is stopped: an exception is raised in its thread (CPython's
  `PyThreadState_SetAsyncExc`), which ends a call running Python code (a sympy loop) at its next
  bytecode, and a fresh thread takes its place at once, so capacity is kept. A call blocked inside
  one long C function (a huge integer power) runs on until that returns: such calls count as
  stuck (`stats()`), more than `max_stuck` of them at once fail the call with a RuntimeError, and
  the threads are daemons, so they never block interpreter exit. The shipped verifiers bound
  their own work (rl/rewards/symbolic.py), so none of their calls is stuck.
- `backend="process"` (a picklable `fn`: a module-level function, e.g. a registered reward):
  each lane owns a worker process (started with "spawn", so no JAX state is forked). A call past
  its timeout kills the process and a fresh one replaces it, so a hung CPU-bound verifier (a
  sympy simplification that never ends) costs one timeout, never a stuck thread or the GIL.
"""

from __future__ import annotations

import concurrent.futures
import math
import pickle
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

from absl import logging

from rl.rewards.registry import TextRewardFn
from rl.rewards.workers import CallTimeout, Job, ProcessWorker, ThreadWorker
from rl.types import Completion, Request

BACKENDS = ("thread", "process")
COUNTERS = ("calls", "errors", "timeouts", "stuck", "replaced")  # RewardRunner.stats' keys


class RewardRunner:
    """Calls a text reward function with a timeout; errors and timeouts score 0.0 and are counted.

    Thread-safe: `submit` and calls may come from several threads at once; up to `workers` calls
    run in parallel, the rest wait in a queue (the timeout starts when a worker takes a call).
    """

    def __init__(
        self,
        fn: TextRewardFn,
        *,
        decode: Callable[[Sequence[int]], str],
        timeout_s: float = 5.0,
        workers: int = 4,
        max_stuck: int = 32,
        backend: str = "thread",
        check: Callable[[Any], Any] | None = None,
        failure: Any = 0.0,
        what: str = "Reward",
        expected: str = "a finite real number",
    ):
        """Starts the workers.

        Args:
            fn: `fn(request, completion_text) -> float`, e.g. `rl.rewards.get_reward("math")`.
            decode: Turns a completion's tokens into the text `fn` reads.
            timeout_s: How long one call (decode and `fn`) may take before it scores 0.0.
            workers: Calls run at once (worker threads or processes).
            max_stuck: thread backend: stopped calls that may still be running at once (inside a
                C function) before a timeout raises.
            backend: "thread" or "process" (see the module docstring).
            check: turns a call's value into the result, or None when the value is invalid
                (default: a finite real number; rl.envs.EnvRunner checks an environment's Turn).
            failure: the result of a call that raised, returned an invalid value or timed out.
            what: what `fn` is, in log messages and errors ("Reward", "Environment").
            expected: what a valid value is, in the message about an invalid one.
        """
        if not (timeout_s > 0 and math.isfinite(timeout_s)):
            raise ValueError(f"timeout_s must be a finite number > 0; received {timeout_s}.")
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"workers must be >= 1; received {workers}.")
        if max_stuck < 0:
            raise ValueError(f"max_stuck must be >= 0; received {max_stuck}.")
        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r}; expected one of {BACKENDS}.")
        self.name = getattr(fn, "__qualname__", repr(fn))
        if backend == "process":
            try:
                pickle.dumps(fn)
            except Exception as e:
                raise ValueError(
                    f"backend='process' sends the reward function to worker processes, but "
                    f"{self.name} cannot be pickled ({e}); expected a module-level function "
                    "(e.g. a registered reward), or backend='thread'."
                ) from None
        self.fn, self.decode, self.backend = fn, decode, backend
        self.check, self.failure, self.what = check or as_finite_float, failure, what
        self.expected = expected
        self.timeout_s, self.workers, self.max_stuck = timeout_s, workers, max_stuck
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._calls = self._errors = self._timeouts = self._replaced = 0
        self._retired: list[ThreadWorker] = []  # thread workers whose call was stopped
        self._logged: set[str] = set()
        self._closed = False
        self._spawned = 0
        self._lanes = [
            threading.Thread(target=self._lane, name=f"reward-lane-{i}", daemon=True)
            for i in range(workers)
        ]
        for lane in self._lanes:
            lane.start()

    # ------------------------------------------------------------------------------ the sampler

    def submit(self, request: Request, completion: Completion) -> concurrent.futures.Future:
        """Queues the call and returns at once: a Future of the score (0.0 on failure).

        The Future raises only when the runner cannot score at all: it was closed with the call
        still queued, or too many calls are stuck (thread backend, see `max_stuck`).
        """
        return self.submit_call(request, completion.tokens)

    def submit_call(self, request: Request, payload: Any) -> concurrent.futures.Future:
        """`submit` of any payload: `fn(request, decode(payload))` on a worker (a Future)."""
        job = Job(request, payload)
        with self._lock:
            if self._closed:
                raise RuntimeError(
                    f"{self.what} runner {self.name} is closed; expected an open one."
                )
            self._calls += 1
        self._jobs.put(job)
        return job.future

    def __call__(self, request: Request, completion: Completion) -> float:
        """The reward of a finished completion: `fn(request, decode(tokens))`, or 0.0 on failure."""
        return self.submit(request, completion).result()

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
        """Counters: calls, errors, timeouts, stuck (stopped calls still running), replaced."""
        with self._lock:
            values = (self._calls, self._errors, self._timeouts, self._stuck(), self._replaced)
            # replaced: workers started to stand in for stuck/killed ones
            return dict(zip(COUNTERS, values, strict=True))

    def close(self) -> None:
        """Stops the workers once queued calls finish (each within its timeout) and waits for
        their threads and processes to end; a stuck call (see `max_stuck`) is waited for at most
        one second. Idempotent."""
        with self._lock:
            closed, self._closed = self._closed, True
        if not closed:
            for _ in range(self.workers):
                self._jobs.put(None)
        for lane in self._lanes:
            if lane is not threading.current_thread():
                lane.join()
        for worker in self._retired:
            worker.thread.join(timeout=1.0)

    def __enter__(self) -> RewardRunner:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # --------------------------------------------------------------------------------- internals

    def _worker(self) -> ThreadWorker | ProcessWorker:
        with self._lock:
            self._spawned += 1
            name = f"reward-{self.name}-{self._spawned}"
        cls = ProcessWorker if self.backend == "process" else ThreadWorker
        return cls(self.fn, self.decode, name)

    def _lane(self) -> None:
        """One worker lane: takes queued calls one at a time and scores them."""
        try:
            worker = self._worker()  # started now, so a process's start-up is not a call's wait
        except Exception:
            worker = None  # started again (and its error reported) on the first call
        try:
            while (job := self._jobs.get()) is not None:
                if not job.future.set_running_or_notify_cancel():
                    continue
                try:
                    if worker is None:
                        worker = self._worker()
                    job.future.set_result(self._score(worker, job))
                except CallTimeout:
                    try:
                        worker = self._replace(worker, job)
                    except BaseException as e:
                        job.future.set_exception(e)
                    else:
                        job.future.set_result(self.failure)
                except BaseException as e:  # the runner itself failed: the caller sees it
                    job.future.set_exception(e)
                if isinstance(worker, ProcessWorker) and not worker.alive():
                    worker.kill()  # crashed (e.g. killed by the OS): a fresh one next call
                    worker = None
        finally:
            if worker is not None:
                worker.stop()  # an idle worker: ends at once

    def _score(self, worker: ThreadWorker | ProcessWorker, job: Job) -> Any:
        """The call's result (`check`ed), or `failure` (counted) for an error or an invalid value."""
        try:
            value = worker.call(job, self.timeout_s)
        except CallTimeout:
            raise
        except Exception as error:
            self._count_error(
                "exception", "%s %s raised on request uid=%d round=%d: %r", job.request, error
            )
            return self.failure
        result = self.check(value)
        if result is None:
            self._count_error(
                "invalid value",
                "%s %s returned an invalid value for request uid=%d round=%d: %r; expected "
                + self.expected,
                job.request,
                value,
            )
            return self.failure
        return result

    def _replace(
        self, worker: ThreadWorker | ProcessWorker, job: Job
    ) -> ThreadWorker | ProcessWorker | None:
        """Counts a timeout and replaces the worker that ran past it (killed or stopped)."""
        with self._lock:
            self._timeouts += 1
            first = "timeout" not in self._logged
            self._logged.add("timeout")
        if first:
            how = "the worker process killed" if self.backend == "process" else "the call stopped"
            logging.warning(
                "%s %s took over timeout_s=%s on request uid=%d round=%d; gave %r and %s. "
                "Later timeouts are only counted: see RewardRunner.stats().",
                self.what,
                self.name,
                self.timeout_s,
                job.request.uid,
                job.request.round,
                self.failure,
                how,
            )
        if isinstance(worker, ProcessWorker):
            worker.kill()
        else:
            worker.stop_call()
            with self._lock:
                if self._stuck() >= self.max_stuck:  # (this one not counted: the run stops)
                    raise RuntimeError(
                        f"{self.what} {self.name}: {self._stuck() + 1} calls are stuck past timeout_s="
                        f"{self.timeout_s} (each inside a C function that a thread cannot "
                        f"interrupt); expected at most max_stuck={self.max_stuck}. The last was "
                        f"request uid={job.request.uid}; backend='process' kills such calls."
                    )
                self._retired.append(worker)
        with self._lock:
            self._replaced += 1
            closed = self._closed
        return None if closed else self._worker()

    def _stuck(self) -> int:
        """Stopped calls whose thread still runs (the caller holds the lock)."""
        self._retired = [w for w in self._retired if w.thread.is_alive()]
        return len(self._retired)

    def _count_error(self, kind: str, message: str, request: Request, detail: Any) -> None:
        with self._lock:
            self._errors += 1
            first = kind not in self._logged
            self._logged.add(kind)
        if first:
            logging.warning(
                message + "; gave %r. Later errors of this kind are only counted: see "
                "RewardRunner.stats().",
                self.what,
                self.name,
                request.uid,
                request.round,
                detail,
                self.failure,
            )


def as_finite_float(value: Any) -> float | None:
    """`float(value)` for a finite real (bool, int, float, numpy or jax scalar); else None."""
    if isinstance(value, (str, bytes, bytearray, complex)) or not hasattr(value, "__float__"):
        return None
    try:
        reward = float(value)
    except (TypeError, ValueError, OverflowError):
        return None
    return reward if math.isfinite(reward) else None
