"""Where a reward call runs: a worker thread or a worker process, one call at a time.

rl.rewards.runner.RewardRunner gives each of its lanes a worker and scores the calls it takes:

    worker = ThreadWorker(fn, decode, name)   # or ProcessWorker (a picklable fn)
    value = worker.call(job, timeout_s)       # fn(request, decode(tokens)); CallTimeout past it

- `ThreadWorker` (any callable): the call runs on a daemon thread. A call past its timeout is
  stopped with `stop_call`: an exception is raised in its thread (CPython's
  `PyThreadState_SetAsyncExc`) at its next bytecode and the worker is retired; a call blocked
  inside one C function runs on until that returns.
- `ProcessWorker` (a picklable fn): the call runs in a process of its own, started with "spawn"
  (so no JAX state is forked). A call past its timeout is ended with `kill`.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import dataclasses
import multiprocessing
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

from rl.rewards.registry import TextRewardFn
from rl.types import Request

STARTUP_TIMEOUT_S = 300.0  # a spawned worker imports the reward's module; not billed to a call


@dataclasses.dataclass(eq=False)
class Job:
    """A queued call: the request, its completion's tokens, and the Future of its score."""

    request: Request
    tokens: Sequence[int]
    future: concurrent.futures.Future = dataclasses.field(default_factory=concurrent.futures.Future)


class CallTimeout(Exception):
    """A call ran past timeout_s (the runner turns it into a 0.0 score)."""


class _Stopped(BaseException):
    """Raised inside a thread worker's call that ran past its timeout (`ThreadWorker.stop_call`)."""


def _async_raise(ident: int | None, exc: type[BaseException] | None) -> None:
    """Raises `exc` in thread `ident` at its next Python bytecode; None clears a pending one."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(ident or 0), None if exc is None else ctypes.py_object(exc)
    )


class ThreadWorker:
    """Runs calls on one daemon thread; a call past its timeout is stopped and the worker retired."""

    def __init__(self, fn: TextRewardFn, decode: Callable[[Sequence[int]], str], name: str):
        self.fn, self.decode = fn, decode
        self.inbox: queue.SimpleQueue[tuple[Job, concurrent.futures.Future] | None] = (
            queue.SimpleQueue()
        )
        self.retired = False
        # `_in_call` under `_lock`: a stop is sent only while fn runs, and a stop sent but not yet
        # delivered when fn returns is cleared, so it can never land after the call (in
        # threading's own code, or in another thread that reuses this one's id).
        self._lock = threading.Lock()
        self._in_call = False
        self.thread = threading.Thread(target=self._main, name=name, daemon=True)
        self.thread.start()

    def _run(self, job: Job) -> Any:
        with self._lock:
            self._in_call = True
        try:
            return self.fn(job.request, self.decode(job.tokens))
        finally:
            with self._lock:
                self._in_call = False
                _async_raise(threading.get_ident(), None)  # a stop not yet delivered: cleared

    def _main(self) -> None:
        while (item := self.inbox.get()) is not None:
            job, result = item
            try:
                result.set_result(self._run(job))
            except BaseException as e:  # handed to the lane, which scores 0.0 (or _Stopped)
                result.set_exception(e)
            if self.retired:
                return

    def call(self, job: Job, timeout_s: float) -> Any:
        result: concurrent.futures.Future = concurrent.futures.Future()
        self.inbox.put((job, result))
        done, _ = concurrent.futures.wait([result], timeout=timeout_s)
        if not done:  # (not result.result(timeout): fn's own TimeoutError is an error, not this)
            raise CallTimeout
        return result.result()

    def stop_call(self) -> None:
        """Retires the worker and stops the call it runs: `_Stopped` is raised in its thread at
        the thread's next Python bytecode (at once for Python code; a C call finishes first)."""
        self.retired = True
        with self._lock:
            if self._in_call:
                _async_raise(self.thread.ident, _Stopped)
        self.inbox.put(None)  # wakes the thread if the call ended before the stop

    def stop(self) -> None:
        """Ends the thread once its queued calls are done and waits for it; a retired worker
        (its call stopped, maybe still inside a C function) is not waited for."""
        self.inbox.put(None)
        if not self.retired:
            self.thread.join()


def _process_main(conn: Any, fn: TextRewardFn) -> None:
    """A reward worker process: answers (request, text) messages until None or a closed pipe."""
    conn.send(("ready", None))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        request, text = message
        try:
            reply = ("ok", fn(request, text))
        except BaseException as e:
            reply = ("error", e)
        try:
            conn.send(reply)
        except Exception:  # an unpicklable value or exception: sent as its repr
            kind, value = reply
            conn.send(("error", RuntimeError(f"unpicklable {kind} result {value!r}")))


class ProcessWorker:
    """Runs calls in one spawned process; a call past its timeout kills the process."""

    def __init__(self, fn: TextRewardFn, decode: Callable[[Sequence[int]], str], name: str):
        self.decode = decode
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_process_main, args=(child, fn), name=name, daemon=True)
        self.process.start()
        child.close()
        if not self.conn.poll(STARTUP_TIMEOUT_S):
            self.kill()
            raise RuntimeError(
                f"Reward worker process {name} did not start within {STARTUP_TIMEOUT_S} s."
            )
        self.conn.recv()  # "ready"

    def call(self, job: Job, timeout_s: float) -> Any:
        text = self.decode(job.tokens)
        self.conn.send((job.request, text))
        if not self.conn.poll(timeout_s):
            raise CallTimeout
        try:
            kind, value = self.conn.recv()
        except (EOFError, OSError):
            raise RuntimeError("the reward worker process died during the call") from None
        if kind == "error":
            raise value
        return value

    def alive(self) -> bool:
        return self.process.is_alive()

    def kill(self) -> None:
        self.process.kill()
        self.process.join(timeout=10.0)
        self.conn.close()

    def stop(self) -> None:
        try:
            self.conn.send(None)
        except OSError:
            pass
        self.process.join(timeout=5.0)
        if self.process.is_alive():
            self.kill()
        else:
            self.conn.close()
