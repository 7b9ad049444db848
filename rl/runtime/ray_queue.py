"""The complete-group queue across processes: the queue actor and the Driver's client of it.

`QueueActor` is rl.queue.GroupQueue in a Ray actor (backpressure, close, fail), that the sampler
replicas put complete groups into; `QueueClient` is the Driver's Queue (rl.runtime.protocols) over
it. The actor returns errors as values, so the caller re-raises the exact exception (QueueClosed,
a sampler thread's crash).
"""

from __future__ import annotations

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
    """

    def __repr__(self) -> str:  # its role, in Ray's error messages (rl.runtime.worker_errors)
        return actor_repr(self)

    def __init__(self, maxsize: int):

        self.queue = GroupQueue(maxsize)

    def put(self, group: Any, timeout: float | None = None) -> BaseException | None:
        try:
            self.queue.put(group, timeout)
        except BaseException as e:  # re-raised in the caller, same type
            return e
        return None

    def get(self, timeout: float | None = None) -> tuple[Any, BaseException | None]:
        try:
            return self.queue.get(timeout), None
        except BaseException as e:
            return None, e

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
