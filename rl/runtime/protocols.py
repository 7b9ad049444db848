"""What the driver (rl.driver) talks to: a sampler, a queue of complete groups and a weight sync.

Both runtimes implement them: `threads` with sampler replicas in threads (rl.runtime.replicas: a
SamplerLoop per Engine), a GroupQueue and a DevicePutSync in one process; `ray` with sampler replica actors behind a router, a queue actor and the object store
(rl.runtime.ray). The driver never sees which.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

from learner.publish import Published, WeightSync
from rl.queue import Queue
from rl.round_planner import RoundCut
from rl.types import Request

__all__ = ["Published", "Queue", "Sampler", "WeightSync"]


class Sampler(Protocol):
    """Admitted requests in, rewarded complete groups out (onto the queue it was built with).

    `stats` is a sampler.loop.SamplerStats (summed over replicas); reading it also brings the
    driver's timeline up to date with the sampler's events (a remote sampler sends them with it).
    """

    num_slots: int  # engine slots, all replicas together
    replica_slots: tuple[int, ...]  # engine slots per replica (one entry: a single sampler)

    @property
    def error(self) -> BaseException | None:
        """What stopped the sampler (None while it runs); the driver polls it while it waits."""

    @property
    def stats(self) -> Any:
        """Counters since the start (sampler.loop.SamplerStats)."""

    def start(self) -> None:
        """Starts sampling in the background; `set_params` has given the first weights."""

    def submit(self, requests: Iterable[Request], cut: RoundCut | None = None) -> None:
        """Queues requests for admission (one round's with `cut`)."""

    def set_params(self, params: Any, version: int) -> None:
        """New weights (a WeightSync's Published.params), taken between decode steps."""

    def request_stop(self) -> None:
        """Asks the sampler to stop after its current step."""

    def close(self) -> None:
        """Stops the sampler; re-raises its error, if any."""
