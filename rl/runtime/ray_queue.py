"""The complete-group queue across processes: the queue actor and the Driver's client of it.

`QueueActor` is rl.queue.GroupQueue in a Ray actor (backpressure, close, fail), that the sampler
replicas put complete groups into; `QueueClient` is the Driver's Queue (rl.runtime.protocols) over
it. The actor returns errors as values, so the caller re-raises the exact exception (QueueClosed,
a sampler thread's crash). It also answers which requests' groups it holds (`keys`): the router
keeps those owned when their replica leaves or dies, so they are delivered, not sampled again.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any

import ray

from rl.queue import GroupQueue
from rl.runtime.ray_cluster import actor_repr
from rl.types import Group


@ray.remote
class QueueActor:
    """rl.queue.GroupQueue in an actor: backpressure, close and fail across processes.

    A threaded actor, so a put blocked on a full queue does not block gets.

    `keys` names the requests whose groups are here: put (a put blocked on a full queue counts
    from its call, since the group lands even if its replica dies meanwhile) and not yet taken,
    plus the last one `get` handed out, until the next `get` (the driver's client is accepting
    it: QueueClient.get takes one group at a time).
    """

    def __repr__(self) -> str:  # its role, in Ray's error messages (rl.runtime.worker_errors)
        return actor_repr(self)

    def __init__(self, maxsize: int):

        self.queue = GroupQueue(maxsize)
        self._lock = threading.Lock()  # the keys' books (not the queue's own lock)
        self._held: collections.Counter[tuple[int, int]] = collections.Counter()
        self._taken: tuple[int, int] | None = None

    def put(self, group: Any, timeout: float | None = None) -> BaseException | None:
        key = group.request.key
        with self._lock:
            self._held[key] += 1
        try:
            self.queue.put(group, timeout)
        except BaseException as e:  # re-raised in the caller, same type
            with self._lock:
                self._release(key)
            return e
        return None

    def get(self, timeout: float | None = None) -> tuple[Any, BaseException | None]:
        with self._lock:
            self._taken = None  # the caller is done with the group it took last
        try:
            group = self.queue.get(timeout)
        except BaseException as e:
            return None, e
        with self._lock:  # in hand before it leaves the books: never in neither
            self._taken = group.request.key
            self._release(group.request.key)
        return group, None

    def _release(self, key: tuple[int, int]) -> None:
        """One put of `key` is no longer on the queue (the lock held)."""
        self._held[key] -= 1
        if self._held[key] <= 0:
            del self._held[key]

    def keys(self) -> set[tuple[int, int]]:
        """The requests whose groups are on the queue or in the driver's hands (class docstring)."""
        with self._lock:
            return set(self._held) | ({self._taken} if self._taken is not None else set())

    def close(self) -> None:
        self.queue.close()

    def fail(self, error: BaseException) -> None:
        self.queue.fail(error)

    def counters(self) -> dict[str, float]:
        q = self.queue
        return {
            "puts": q.puts,
            "gets": q.gets,
            "max_depth": q.max_depth,
            "put_wait_s": q.put_wait_s,
            "get_wait_s": q.get_wait_s,
        }


class QueueClient:
    """The Driver's Queue over the queue actor; `accept` drops a group already taken (a replica's
    re-sampled request whose first copy was delivered before the replica died) or refused by its
    round's cut."""

    def __init__(self, actor: Any, accept: Any):
        self.actor, self.accept = actor, accept

    def put(self, group: Group, timeout: float | None = None) -> None:
        error = ray.get(self.actor.put.remote(group, timeout))
        if error is not None:
            raise error

    def get(self, timeout: float | None = None) -> Group:
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if end is None else max(0.0, end - time.monotonic())
            group, error = ray.get(self.actor.get.remote(left))
            if error is not None:
                raise error
            if self.accept(group):
                return group

    def close(self) -> None:
        ray.get(self.actor.close.remote())

    def fail(self, error: BaseException) -> None:
        try:
            ray.get(self.actor.fail.remote(error))
        except Exception:  # an error that does not pickle: its message still stops the other side
            ray.get(self.actor.fail.remote(RuntimeError(f"{type(error).__name__}: {error}")))

    def qsize(self) -> int:
        c = ray.get(self.actor.counters.remote())
        return int(c["puts"] - c["gets"])
