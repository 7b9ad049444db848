"""The sampler loop: admitted requests in, rewarded complete groups out (nothing partial).

A step, at its boundary, frees the slots released since the last one, imports adopted requests
and takes new weights; then admits what fits (sampler/admit.py: group-atomic or per-sample, the
prompts admitted together prefilled in one batched call per length bucket), runs one engine
generate call over every slot, and records and rewards the finished samples
(sampler/completion.py); a request's Group is emitted once its kept samples are rewarded. Runs,
and which slot holds which sample, are sampler/runs.py's; migration's endpoints (`view`,
`reserve`, `handoff`, `adopt`) are sampler/migration.py's.

Rewards run off the decode thread when `reward_fn` has a `submit(request, completion) -> Future`
(`rl.rewards.RewardRunner`). Everything but the reward is settled when the sample finishes, as
with an inline reward: which samples a group keeps, the round cuts, the aborts they trigger and
the freed slots; groups are emitted in the order they completed, each once its rewards are in. So
a slow verifier delays a group's emission, never a decode step, and the groups, their order and
their tokens are those of an inline `reward_fn`.

With an `environment` (rl.envs.EnvRunner) a sample is a multi-turn episode: a stopped turn goes to
the environment and its slot waits, KV kept, until the answer's observation is appended and it
decodes on (sampler/episodes.py); its reward is the episode's return, and `reward_fn` is not used.

New weights (`set_params`) are taken between decode steps; every token records the version that
drew it. Running samples go on with their KV cache (PipelineRL), or, with `recompute_kv=True`
(AReaL interruptible generation), are re-prefilled first, prompt + tokens so far, with the new
weights: their next tokens and log-probs are then exactly the new policy's. Runs synchronously
(`step`, `run_until_idle`) or in a background thread (`start`, `drain`, `close`;
sampler/background.py); an error in the thread is re-raised to the caller.

Thread-safety: `submit`, `abort`, `set_params` and the properties may be called from any thread.
Engine calls, rewards and `emit` run outside the lock, so a blocking `emit` (a full queue) never
blocks those calls.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import jax

from rl.admission import AdmissionPolicy
from rl.elastic.migration import ReplicaView
from rl.envs import EnvRunner
from rl.round_planner import RoundCut, RoundCuts
from rl.types import Completion, Group, Request
from sampler import admit, completion, migration
from sampler.background import LoopThread
from sampler.engine import Engine
from sampler.episodes import Episodes
from sampler.migration import Handoff
from sampler.runs import Complete, Run, SlotTable, slot_span
from sampler.stats import SamplerStats

RewardFn = Callable[[Request, Completion], float]
EmitFn = Callable[[Group], None]


class SamplerLoop:
    """Drives an Engine over an admission policy; see the module docstring."""

    def __init__(
        self,
        engine: Engine,
        params: Any,
        *,
        admission: AdmissionPolicy,
        reward_fn: RewardFn,
        emit: EmitFn,
        version: int = 0,
        group_atomic: bool = True,
        recompute_kv: bool = False,
        timeline: Any = None,
        clock: Callable[[], float] = time.monotonic,
        on_boundary: Callable[[], None] | None = None,
        environment: EnvRunner | None = None,
    ):
        self.engine = engine
        self._episodes = (
            None
            if environment is None
            else Episodes(environment, max_observation=engine.max_prefill_length)
        )
        # Called on the loop's thread at every step boundary (after frees and adoptions, before
        # admission): a replica sampler decides and executes migrations there.
        self.on_boundary = on_boundary
        self.timeline = timeline  # rl.timeline.Timeline: slot, prefill and group-complete events
        self.clock = clock
        self.admission = admission
        self.reward_fn = reward_fn
        self.emit = emit
        self.group_atomic = group_atomic  # False: per-sample admission (sampler/admit.py)
        self.recompute_kv = recompute_kv  # re-prefill running samples when new weights come in
        self.stats = SamplerStats()
        self._params, self._version = params, version
        self._pending_params: tuple[Any, int] | None = None
        self._state = engine.init_decode_state()
        self._table = SlotTable(engine.max_concurrent_decodes)  # runs and slots, under the lock
        self._cuts = RoundCuts()  # which complete groups of a cut round are emitted
        self._scoring: collections.deque[Complete] = collections.deque()  # completion order
        self._parked: collections.deque[Run] = collections.deque()  # `resume`d, not yet in slots
        self._submit_reward = getattr(reward_fn, "submit", None)  # off the decode thread
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._thread = LoopThread(self.step, self._has_work, self._wake)  # `start`

    # ---------------------------------------------------------------------------- control (any thread)

    @property
    def error(self) -> BaseException | None:
        """The exception that stopped the loop thread, if any."""
        return self._thread.error

    @property
    def version(self) -> int:
        return self._version

    @property
    def num_slots(self) -> int:
        return self.engine.max_concurrent_decodes

    @property
    def replica_slots(self) -> tuple[int, ...]:
        """One replica (rl.runtime.protocols.Sampler)."""
        return (self.engine.max_concurrent_decodes,)

    def submit(self, requests: Iterable[Request], cut: RoundCut | None = None) -> None:
        """Queues requests for admission; each is validated against the engine first.

        With `cut` (one round's requests only), only the complete groups the cut accepts are
        emitted; once it is full the round's other requests are aborted at once, slots freed.
        """
        requests = list(requests)
        for r in requests:
            self.engine.validate(r)
        with self._lock:
            self._raise_if_failed()
            for r in requests:
                if r.key in self._table.runs:
                    raise ValueError(f"Request (round, uid)={r.key} is already running.")
            if cut is not None:
                self._cuts.add(cut, requests)
            self.admission.submit(requests)
            self._thread.idle.clear()
            self._wake.notify_all()

    def abort(self, keys: Iterable[tuple[int, int]]) -> list[Request]:
        """Aborts requests by (round, uid), waiting or running; their slots are freed before the
        next decode step and none of their groups is emitted. Returns the aborted requests."""
        with self._lock:
            out = self._abort_locked(keys)
            self._wake.notify_all()
        return out

    def _abort_locked(self, keys: Iterable[tuple[int, int]]) -> list[Request]:
        out = []
        for key in keys:
            r = self.admission.remove(key)
            parked = next((run for run in self._parked if run.request.key == key), None)
            if r is None and parked is not None:
                parked.aborted = True
                self._parked.remove(parked)
                r = parked.request
            if r is None and key in self._table.runs:
                run = self._table.runs.pop(key)
                run.aborted = True
                self._table.release(run)
                r = run.request
            if r is not None:
                out.append(r)
                self.stats.groups_aborted += 1
        return out

    def set_params(self, params: Any, version: int) -> None:
        """New weights, taken between decode steps; tokens record the version that made them."""
        with self._lock:
            self._pending_params = (params, version)
            self._wake.notify_all()

    def busy_slots(self) -> int:
        with self._lock:
            return self._table.busy()

    def free_slots(self) -> int:
        """Slots free for admission now."""
        with self._lock:
            return len(self._table.free_slots())

    def waiting(self) -> int:
        """Requests waiting for admission (one taken and held for KV pages included)."""
        with self._lock:
            return len(self.admission) + (self._table.held is not None)

    def waiting_sequences(self) -> int:
        """Samples of the requests waiting for admission (the slots they need)."""
        with self._lock:
            held = self._table.held
            return self.admission.sequences() + (0 if held is None else len(held[1]))

    def kv_usage(self) -> dict[str, int]:
        """KV cache bytes held and live positions now (Engine.kv_usage); call between steps."""
        return self.engine.kv_usage(self._state)

    def pending(self) -> int:
        """Requests waiting, running, or complete with rewards still running."""
        with self._lock:
            return (
                len(self.admission) + len(self._table.runs) + len(self._scoring) + len(self._parked)
            )

    # ----------------------------------------------------------------------------- the loop itself

    def step(self) -> bool:
        """Admits what fits, runs one engine generate call, rewards and emits finished work.

        Returns:
          Whether requests are still waiting or running.
        """
        with self._lock:
            swapped = self._pending_params is not None
            if swapped:
                (self._params, self._version), self._pending_params = self._pending_params, None
            to_free, self._table.to_free = self._table.to_free, []
            params, version = self._params, self._version
            imports = migration.imports(self._table)
        if to_free:
            self._state = self.engine.free(self._state, to_free)
        for slots, moved in imports:
            self._state = self.engine.import_slots(self._state, moved, slots)
        if swapped and self.recompute_kv:
            self._recompute(params)
        episodes = self._episodes
        if episodes is not None:
            self._next_turns(episodes, params, version)
            self._release_ended()
        if self.on_boundary is not None:
            self.on_boundary()
        self._admit(params)
        waiting = 0 if episodes is None else len(episodes.waiting)
        if self._table.busy() == waiting:  # nothing to decode
            if episodes is not None and waiting:
                self._emit_scored(wait=False)
                episodes.wait()
                return True
            self._emit_scored(wait=True)  # wait for rewards still running
            return self.pending() > 0
        self._state, result = self.engine.generate(params, self._state)
        result = jax.device_get(result)
        if imports:
            with self._lock:
                migration.decoded(self._table, imports)
        finished = self._record(result, version)
        self._release_ended()
        self._complete(finished)
        return self.pending() > 0

    def _release_ended(self) -> None:
        """The engine takes back what sequences that ended on it held (a paged cache's pages)."""
        with self._lock:
            ended, self._table.ended = self._table.ended, []
        self.engine.release(ended)

    def _complete(self, finished: list[tuple[Run, int]]) -> None:
        """Settles finished samples; their complete groups go to scoring (round cuts applied)."""
        complete = [g for g in map(self._finish, finished) if g is not None]
        with self._lock:
            groups, abort, refused = self._cuts.apply(complete)  # round cuts: abort the rest
            self._abort_locked(abort)
            self.stats.groups_cut += refused
            self._scoring.extend(groups)
        self._emit_scored(wait=False)

    def _next_turns(self, episodes: Episodes, params: Any, version: int) -> None:
        """Samples whose environment answered go on (observation into their KV) or finish."""
        with self._lock:
            resume, finished = episodes.settle(self._table, version, self.stats)
            for s, run, i in finished:
                slot_span(self.timeline, s, run, i, self.clock())
        extend = [(r.slot, r.fed, r.last) for r in resume if not r.reprefill]
        if extend:
            self._state = self.engine.extend(params, self._state, extend)
        again = [(r.slot, r.run, r.sample) for r in resume if r.reprefill]
        if again:
            self._state = self.engine.reprefill(params, self._state, self._recomputed(again))
        self._complete([(run, i) for _, run, i in finished])

    def run_until_idle(self, max_steps: int | None = None) -> None:
        """Steps until nothing waits or runs (synchronous use)."""
        n = 0
        while self.step():
            n += 1
            if max_steps is not None and n >= max_steps:
                raise RuntimeError(f"Sampler still busy after {max_steps} steps.")

    def may_admit(self) -> bool:
        """Whether this step admits waiting requests: always. A subclass may hold them back (the
        static-batching baseline of launch/bench_sampler.py admits only into an empty loop)."""
        return True

    def _admit(self, params: Any) -> None:
        """Starts what fits now; the prompts admitted together are prefilled in one batched call
        per PREFILL_CHUNK prompts of a length bucket (`Engine.prefill_insert`)."""
        if not self.may_admit():
            return
        with self._lock:
            # Weights published after this step took its params: what is admitted now waits for
            # them (the next step), so a request submitted after a publish never runs on the
            # weights before it (async's staleness bound counts on that).
            if self._pending_params is not None:
                return
            resumed = migration.place(self._table, self._parked, self.clock())
            self.stats.resumed_sequences += len(resumed)
            admitted = admit.admit(
                self._table,
                self.admission,
                group_atomic=self.group_atomic,
                stats=self.stats,
                budget=self.engine.admission_budget(),
                cost=self.engine.start_cost,
            )
        if resumed:
            self._state = self.engine.reprefill(params, self._state, resumed)
        if not admitted:
            return
        t0 = self.clock()
        items = [
            (run.request, [run.slots[i] for i in samples], samples) for run, samples in admitted
        ]
        self._state = self.engine.prefill_insert(params, self._state, items)
        t1 = self.clock()
        for run, samples in admitted:
            for i in samples:
                run.samples[i].start = t1
            if self.timeline is not None:
                r = run.request
                self.timeline.span("sampler/prefill", "prefill", t0, t1, round=r.round, uid=r.uid)
        with self._lock:
            self.stats.prefills += len(admitted)

    def _recompute(self, params: Any) -> None:
        """Re-prefills every running sample (prompt + its tokens so far) with `params`."""
        with self._lock:
            running = []
            for s, run, i in self._table.running():
                if i in run.waiting:  # between turns: re-prefilled when its next turn starts
                    run.samples[i].stale = True
                else:
                    running.append((s, run, i))
        self._state = self.engine.reprefill(params, self._state, self._recomputed(running))

    def _recomputed(
        self, samples: list[tuple[int, Run, int]]
    ) -> list[tuple[int, Request, int, tuple]]:
        """`Engine.reprefill`'s items for these (slot, run, sample)s: prompt + tokens so far."""
        with self._lock:
            items = [(s, run.request, i, tuple(run.samples[i].tokens)) for s, run, i in samples]
            self.stats.recomputes += len(items)
            self.stats.recomputed_tokens += sum(len(q.prompt) + len(g) for _, q, _, g in items)
        return items

    def _record(self, result: Any, version: int) -> list[tuple[Run, int]]:
        """Appends produced tokens to their samples; returns the (run, sample) pairs that finished
        (with an environment, none: a stopped turn waits for its answer, sampler/episodes.py)."""
        with self._lock:
            finished = completion.record(self._table, result, version, self.stats)
            if self._episodes is not None:
                for s, run, i in finished:
                    self._episodes.turn_ended(self._table, s, run, i)
                return []
            for s, run, i in finished:
                slot_span(self.timeline, s, run, i, self.clock())
                self._table.ended.append(s)
        return [(run, i) for _, run, i in finished]

    def _finish(self, finished: tuple[Run, int]) -> Complete | None:
        """Records a finished sample (its reward started); its group if that completed it."""
        run, i = finished
        done = run.completion(i)
        with self._lock:
            if run.aborted:
                return None
        if self._episodes is not None:  # the episode's return
            reward = completion.resolved(sum(done.turn_rewards))
        else:
            reward = completion.score(self.reward_fn, self._submit_reward, run.request, done)
        with self._lock:
            return completion.settle(self._table, run, i, done, reward, self.stats)

    def _emit_scored(self, *, wait: bool) -> None:
        """Emits the complete groups whose rewards are in, in completion order.

        Args:
          wait: wait for the oldest group's rewards (when there is nothing to decode meanwhile);
            those behind it are emitted only if theirs are in.
        """
        while True:
            with self._lock:
                head = self._scoring[0] if self._scoring else None
            if head is None or not (wait or head.ready()):
                return
            g, wait = head.group(), False  # waits for the oldest group only
            with self._lock:
                self._scoring.popleft()
                self.stats.groups_emitted += 1
            if self.timeline is not None:
                r = g.request
                self.timeline.instant(
                    "sampler/groups", "group", self.clock(), round=r.round, uid=r.uid
                )
            self.emit(g)

    # ----------------------------------------------------------------------------------- migration

    @property
    def idle(self) -> bool:
        """Nothing waits, runs or is being scored here."""
        return self.pending() == 0

    def view(self) -> ReplicaView:
        """This loop as a migration policy sees it (rl.elastic.migration; sampler/migration.py
        `view`: with a paged engine, in pages too)."""
        with self._lock:
            queued = len(self.admission) > 0 or self._table.held is not None
            return migration.view(self._table, queued=queued, pool=self.engine.pool)

    def running(self, key: tuple[int, int]) -> bool:
        """Request `key` is admitted here and its group not yet complete."""
        with self._lock:
            return key in self._table.runs

    def reserve(self, n: int) -> list[int] | None:
        """Promises n free slots to an adoption (any thread); None if fewer are free now."""
        with self._lock:
            return migration.reserve(self._table, n)

    def unreserve(self, slots: Iterable[int]) -> None:
        """Gives back slots `reserve` promised and no adoption took."""
        with self._lock:
            self._table.reserved.difference_update(slots)

    def handoff(self, key: tuple[int, int]) -> Handoff | None:
        """Takes request `key`'s running samples out of this loop (on its own thread, at a step
        boundary: in `on_boundary`), with their decode state; their slots are freed here.

        Returns:
          The Handoff, or None when the request no longer runs here (it finished, or was aborted
          or cut since the policy saw it): the caller gives back what it reserved.
        """
        with self._lock:
            taken = migration.take_out(self._table, key)
        if taken is None:
            return None
        run, slots, samples = taken
        moved = self.engine.export_slots(self._state, slots)
        self._state = self.engine.free(self._state, slots)
        t1 = self.clock()
        with self._lock:
            self.stats.migrations += 1
            self.stats.migrated_sequences += len(slots)
            self.stats.migrated_bytes += moved.nbytes
        for s, i in zip(slots, samples, strict=True):
            slot_span(self.timeline, s, run, i, t1, migrated=True)
        return Handoff(run=run, samples=samples, state=moved)

    def adopt(self, handoff: Handoff, slots: list[int]) -> None:
        """Takes over a request another loop handed off, into slots `reserve` gave (any
        thread); its state is imported before the next decode step, and its group completes here."""
        if len(slots) != len(handoff.samples):
            raise ValueError(
                f"adopt: {len(handoff.samples)} samples need as many slots; received {slots}."
            )
        now = self.clock()
        with self._lock:
            migration.check_reserved(self._table, slots)
            self._raise_if_failed()
            migration.take_in(self._table, handoff, slots, now)
            self._thread.idle.clear()
            self._wake.notify_all()

    # ------------------------------------------------------------------- a replica taken back

    def evict(self) -> tuple[list[Request], list[Run], list[Complete]]:
        """Empties a stopped loop (`close` first: a lent replica taken back mid-rollout).

        Returns:
          (the requests still waiting for admission; the runs admitted and not complete, each
          sample out of its slot with its tokens so far, to `resume` on another loop; the
          complete groups whose rewards are still running, to be emitted by the caller).
        """
        if self._thread.is_alive():
            raise RuntimeError("evict() needs a stopped loop; call close() first.")
        with self._lock:
            if self._episodes is not None and any(r.waiting for r in self._table.runs.values()):
                raise ValueError("evict(): an episode waits for its environment here.")
            queued, runs, running = migration.evict(self._table, self.admission, self._parked)
            now = self.clock()
            for s, run, i in running:
                slot_span(self.timeline, s, run, i, now, evicted=True)
            self.stats.evicted_sequences += len(running)
            old, self._table = self._table, SlotTable(self.engine.max_concurrent_decodes)
        # every slot here goes back empty: the running ones, those released since the last step
        self.engine.release(old.ended)
        if running or old.to_free:
            self._state = self.engine.free(self._state, [s for s, _, _ in running] + old.to_free)
        with self._lock:
            scoring, self._scoring = list(self._scoring), collections.deque()
            self.stats.groups_emitted += len(scoring)  # the caller emits them
        return queued, runs, scoring

    def resume(self, runs: Iterable[Run]) -> None:
        """Takes over runs another loop evicted (any thread): each goes into free slots as soon
        as all its unfinished samples fit, before any new request, re-prefilled with its prompt
        and tokens so far (Engine.reprefill: it decodes on as if it had never moved)."""
        runs = list(runs)
        with self._lock:
            self._raise_if_failed()
            for run in runs:
                if run.request.key in self._table.runs:
                    raise ValueError(f"resume: request {run.request.key} already runs here.")
            self._parked.extend(runs)
            self._thread.idle.clear()
            self._wake.notify_all()

    def take_queued(self, slots: int) -> list[Request]:
        """Removes requests still waiting for admission here, in the policy's order, until their
        samples fill `slots` (a replica that joins takes them: requests are routed at
        submission)."""
        out: list[Request] = []
        with self._lock:
            while slots > 0 and (r := self.admission.next(1 << 30)) is not None:
                out.append(r)
                slots -= r.group_size
        return out

    # ------------------------------------------------------------------------------------ threaded

    def start(self) -> None:
        """Runs the loop in a background thread until `close`."""
        self._thread.start()

    def _has_work(self) -> bool:
        """Something waits, runs, is scored, or waits for the next step boundary (lock held)."""
        t, queued = self._table, len(self.admission)
        episodes = self._episodes is not None and bool(self._episodes.waiting)
        return bool(
            queued
            or self._parked
            or t.runs
            or self._scoring
            or t.to_free
            or t.imports
            or self._pending_params
            or episodes
        )

    def drain(self, timeout: float | None = None) -> None:
        """Blocks until nothing waits or runs; re-raises an error from the loop thread."""
        if not self._thread.started:
            self.run_until_idle()
            return
        self._thread.wait_idle(timeout, self.pending)

    def request_stop(self) -> None:
        """Asks the loop thread to stop after its current step; `close` waits for it."""
        self._thread.request_stop()

    def close(self) -> None:
        """Stops the loop thread (work in flight is dropped); re-raises a loop error."""
        self._thread.close()

    def _raise_if_failed(self) -> None:
        self._thread.raise_if_failed()
