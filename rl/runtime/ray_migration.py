"""Long-tail migration (JigsawRL) across the Ray runtime's replica actors.

The threaded replica sampler asks the migration policy at each replica's step boundary, where it
sees every replica at once. Across processes there is no common boundary: `RayMigrator` runs the
same policy (rl.elastic.migration) from a thread of the driver process, every `poll_s` seconds,
over the replicas' views (SamplerReplica.view), and executes each decision in four steps:

1. reserve free slots on the destination (`reserve`; a destination that filled up meanwhile is
   skipped);
2. ask the source to take the request out at its next step boundary (`handoff`): its decode
   state (KV rows, positions, sampling state) goes to host arrays in the object store
   (sampler.transfer), its finished samples' rewards resolved;
3. collect it (`take_handoffs`; a request that finished, or was aborted or cut, before its
   source's next boundary answers None and the slots are given back, as are those of samples
   that finished since the view);
4. move the request's owner in the router's Routing to the destination, then `adopt` there: the
   destination fetches the state from the source's object store and imports it before its next
   decode step. The group completes and is delivered from there.

Views are a few milliseconds apart, so a decision can be stale; every step checks again instead
of trusting it. Faults: a source that dies before step 4 still owns the request (the router
re-samples it with its other requests); a destination that dies after it owns it (likewise); a
state lost with its source after step 3 (the destination cannot fetch it) is re-sampled from
scratch. Per-request randomness makes every re-sampled group's tokens the same. Each move is a
"migrate" span on the source replica's lane sampler/replica{src}/migrate (args round, uid,
sequences, bytes, src, dst; from the ask to the adoption), which rl.metrics.migration_metrics sums
per round; the source's SamplerStats count migrations, sequences and bytes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from rl.elastic.migration import MigrationPolicy
from rl.runtime.routing import Routing
from rl.timeline import Timeline
from rl.types import Request

Key = tuple[int, int]


class Router(Protocol):
    """What the migrator uses of rl.runtime.ray_router.ReplicaRouter."""

    routing: Routing  # request -> replica; guarded by `lock`
    lock: threading.RLock
    timeline: Timeline

    @property
    def alive(self) -> list[int]: ...

    def each(self, method: str, *args: Any, replicas: Any = None) -> dict: ...

    def lane(self, name: str, i: int) -> str: ...

    def submit(self, requests: list[Request]) -> None: ...

    def fail(self, error: BaseException) -> None: ...


class RayMigrator:
    """Runs `policy` over `router`'s live replicas from a background thread; see the module
    docstring.

    Args:
      router: the ReplicaRouter (its Routing, lock, replicas and timeline).
      policy: the migration policy (rl.elastic.migration).
      poll_s: seconds between decisions.
      clock: the timeline's clock.
    """

    def __init__(
        self,
        router: Router,
        policy: MigrationPolicy,
        *,
        poll_s: float,
        clock: Callable[[], float] = time.monotonic,
    ):
        if not poll_s > 0:
            raise ValueError(f"RayMigrator: poll_s must be > 0; received {poll_s!r}.")
        self.router, self.policy, self.poll_s, self.clock = router, policy, poll_s, clock
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.moves = 0  # requests adopted by another replica
        self.stale = 0  # decided moves not made: no room, or the request ended before its handoff
        self.resampled = 0  # moved requests whose state was lost with their source

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._main, name="ray-migrator", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Ends the thread after the decision in flight (its moves are completed or undone)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def _main(self) -> None:
        try:
            while not self._stop.wait(self.poll_s):
                self.step()
        except BaseException as e:  # stops the run: the driver polls router.error
            logging.exception("the migration thread failed")
            self.router.fail(RuntimeError(f"Long-tail migration failed: {type(e).__name__}: {e}"))

    def _one(self, i: int, method: str, *args: Any) -> tuple[bool, Any]:
        """(whether replica i answered, its answer) to `method`; a dead one's requests are the
        router's to handle."""
        out = self.router.each(method, *args, replicas=[i])
        return i in out, out.get(i)

    def step(self) -> int:
        """One decision over the live replicas, executed; returns the requests moved."""
        router = self.router
        alive = list(router.alive)
        if len(alive) < 2:
            return 0
        views = router.each("view", replicas=alive)
        ids = [i for i in alive if i in views]
        if len(ids) < 2:
            return 0
        pending: dict[Key, tuple[int, int, list[int], float]] = {}
        for move in self.policy.moves([views[i] for i in ids]):
            src, dst = ids[move.src], ids[move.dst]
            n = next(r.sequences for r in views[src].running if r.key == move.key)
            _, slots = self._one(dst, "reserve", n)
            if not slots:
                self.stale += 1
                continue
            pending[move.key] = (src, dst, slots, self.clock())
        for src in sorted({p[0] for p in pending.values()}):
            asked = [k for k, p in pending.items() if p[0] == src]
            if not self._one(src, "handoff", asked)[0]:  # dead: it still owns them
                for key in asked:
                    self._give_back(pending.pop(key))
        moved = 0
        while pending:
            if self._stop.is_set():  # the run is ending: a source may be blocked in emit
                for key in list(pending):
                    self._give_back(pending.pop(key))
                break
            for src in sorted({p[0] for p in pending.values()}):
                answered, out = self._one(src, "take_handoffs")
                if not answered:  # the source died: it still owns its requests
                    for key in [k for k, p in pending.items() if p[0] == src]:
                        self._give_back(pending.pop(key))
                    continue
                for key, ref in out.items():
                    if key in pending:
                        moved += self._finish(key, ref, pending.pop(key))
            if pending:
                time.sleep(min(self.poll_s, 0.005))  # until the sources' next step boundaries
        return moved

    def _give_back(self, p: tuple[int, int, list[int], float]) -> None:
        self.stale += 1
        self._one(p[1], "unreserve", p[2])

    def _finish(self, key: Key, ref: Any, p: tuple[int, int, list[int], float]) -> int:
        src, dst, slots, t0 = p
        router = self.router
        if ref is None:  # ended before its source's boundary
            self._give_back(p)
            return 0
        with router.lock:
            if router.routing.owner(key) != src:  # forgotten (a full cut) or re-sampled
                ours = False
            else:
                router.routing.move(key, dst)
                ours = True
        if not ours:
            self._give_back(p)
            return 0
        # samples that finished since the view need no slot there
        slots, spare = slots[: ref[2]], slots[ref[2] :]
        if spare:
            self._one(dst, "unreserve", spare)
        answered, adopted = self._one(dst, "adopt", ref, slots)
        if not answered:  # the destination died owning it: the router re-samples it
            return 0
        if not adopted:  # its state went with its source: sample it again from scratch
            with router.lock:
                request = router.routing.outstanding.get(key, (None, None))[1]
                if request is not None:
                    router.routing.deliver(key)
            if request is not None:
                self.resampled += 1
                router.submit([request])
            return 0
        self.moves += 1
        router.timeline.span(
            router.lane("sampler/migrate", src),
            "migrate",
            t0,
            self.clock(),
            round=key[0],
            uid=key[1],
            sequences=len(slots),
            bytes=ref[1],
            src=src,
            dst=dst,
        )
        return 1
