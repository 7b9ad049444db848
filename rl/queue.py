"""The host-side queue of complete groups between the sampler and the learner.

The sampler `put`s each group the moment its last completion is rewarded (complete-group
pipelining); the learner `get`s them. A bounded queue gives backpressure: `put` blocks while full.
`close()` ends the stream (what is queued still drains); `fail(error)` is how one side's crash stops
the other promptly: every waiting and later `put`/`get` raises that error.

`Queue` is the protocol the runtime codes against, so a Ray-actor queue can stand in across hosts.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from threading import Condition, Lock
from typing import Protocol

from rl.types import Group


class QueueClosed(RuntimeError):
    """Raised by `put` after `close()`, and by `get` once the queue is closed and drained."""


class Queue(Protocol):
    def put(self, group: Group, timeout: float | None = None) -> None:
        """Appends a complete group; blocks while full."""

    def get(self, timeout: float | None = None) -> Group:
        """Removes and returns the oldest group; blocks while empty."""

    def close(self) -> None:
        """Ends the stream: no more puts; queued groups still drain."""

    def fail(self, error: BaseException) -> None:
        """Closes and makes every waiting and later put/get raise `error`."""

    def qsize(self) -> int:
        """Number of queued groups."""


class GroupQueue:
    """A thread-safe FIFO of complete, immutable Groups (stored as they are, never copied).

    Args:
        maxsize: the most groups held at once; `put` blocks while full. 0 means unbounded.
    """

    def __init__(self, maxsize: int = 0) -> None:
        if not isinstance(maxsize, int) or maxsize < 0:
            raise ValueError(f"maxsize must be an int >= 0 (0: unbounded); received {maxsize!r}.")
        self.maxsize = maxsize
        self._items: collections.deque[Group] = collections.deque()
        self._lock = Lock()
        self._not_empty = Condition(self._lock)
        self._not_full = Condition(self._lock)
        self._closed = False
        self._error: BaseException | None = None
        self._puts = self._gets = self._max_depth = 0
        self._wait_s = {self._not_full: 0.0, self._not_empty: 0.0}  # blocked seconds per side

    def put(self, group: Group, timeout: float | None = None) -> None:
        """Appends `group`, blocking while the queue is full.

        Args:
            group: a complete Group.
            timeout: the most seconds to wait for room; None waits forever.

        Raises:
            QueueClosed: the queue is closed (the message names the group's (round, uid)).
            TimeoutError: no room within `timeout`.
            BaseException: the error given to `fail()`.
        """
        if not isinstance(group, Group):
            raise TypeError(f"GroupQueue.put expects a Group; received {type(group).__name__}.")
        with self._lock:
            if not self._block(self._not_full, lambda: self._room_for(group), timeout):
                raise TimeoutError(
                    f"put of group (round, uid)={group.request.key} timed out after {timeout}s: "
                    f"the queue stayed full ({self.maxsize} groups)."
                )
            self._items.append(group)
            self._puts += 1
            self._max_depth = max(self._max_depth, len(self._items))
            self._not_empty.notify()

    def get(self, timeout: float | None = None) -> Group:
        """Removes and returns the oldest group, blocking while the queue is empty.

        Args:
            timeout: the most seconds to wait for a group; None waits forever.

        Raises:
            QueueClosed: the queue is closed and empty (after `close()` queued groups drain).
            TimeoutError: no group within `timeout`.
            BaseException: the error given to `fail()`.
        """
        with self._lock:
            if not self._block(self._not_empty, self._has_group, timeout):
                raise TimeoutError(f"get timed out after {timeout}s: the queue stayed empty.")
            group = self._items.popleft()
            self._gets += 1
            self._not_full.notify()
            return group

    def close(self) -> None:
        """Ends the stream: later puts raise QueueClosed; gets drain what is queued. Idempotent."""
        with self._lock:
            self._closed = True
            self._not_empty.notify_all()
            self._not_full.notify_all()

    def fail(self, error: BaseException) -> None:
        """Closes the queue and makes every waiting and later put/get raise `error`.

        Args:
            error: what stopped one side (e.g. the sampler's crash). The first error wins.
        """
        if not isinstance(error, BaseException):
            raise TypeError(f"fail() expects an exception; received {type(error).__name__}.")
        with self._lock:
            if self._error is None:
                self._error = error
            self._closed = True
            self._not_empty.notify_all()
            self._not_full.notify_all()

    # Getters read one attribute (atomic under the GIL); writers hold the lock.
    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def error(self) -> BaseException | None:
        """The error given to `fail()`, or None."""
        return self._error

    def qsize(self) -> int:
        return len(self._items)

    @property
    def puts(self) -> int:
        return self._puts

    @property
    def gets(self) -> int:
        return self._gets

    @property
    def max_depth(self) -> int:
        """The most groups ever queued at once."""
        return self._max_depth

    @property
    def put_wait_s(self) -> float:
        """Seconds `put` callers spent blocked on a full queue (summed over callers)."""
        return self._wait_s[self._not_full]

    @property
    def get_wait_s(self) -> float:
        """Seconds `get` callers spent blocked on an empty queue (summed over callers)."""
        return self._wait_s[self._not_empty]

    def _room_for(self, group: Group) -> bool:
        if self._error is not None:
            raise self._error
        if self._closed:
            raise QueueClosed(
                f"Cannot put group (round, uid)={group.request.key}: the queue is closed; "
                "expected put() before close()."
            )
        return not self.maxsize or len(self._items) < self.maxsize

    def _has_group(self) -> bool:
        if self._error is not None:
            raise self._error
        if not self._items and self._closed:
            raise QueueClosed(f"get() on a closed, drained queue ({self._gets} groups taken).")
        return bool(self._items)

    def _block(self, cv: Condition, ready: Callable[[], bool], timeout: float | None) -> bool:
        """Waits on `cv` (lock held) until `ready()`; False on timeout. Counts blocked time."""
        if timeout is not None and timeout < 0:
            raise ValueError(f"timeout must be >= 0 seconds or None; received {timeout}.")
        end = None if timeout is None else time.monotonic() + timeout
        t0 = None
        try:
            while not ready():
                t0 = time.monotonic() if t0 is None else t0
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    return False
                cv.wait(left)
            return True
        finally:
            if t0 is not None:
                self._wait_s[cv] += time.monotonic() - t0
