"""The sampler loop: admitted requests in, rewarded complete groups out.

Admission (an AdmissionPolicy) picks which waiting request starts when enough slots are free; the
request's prompt is prefilled once and inserted into its G slots (the prompts admitted together in
one batched call per length bucket); the engine steps all slots; a
finished response is rewarded; when all G responses of a request are rewarded the Group is emitted.
Nothing partial is emitted.

Rewards run off the decode thread when `reward_fn` has a `submit(request, completion) -> Future`
(`rl.rewards.RewardRunner`): a finished sample is handed to the reward workers and decoding goes
on. Everything but the reward is settled when the sample finishes, as with an inline reward: which
samples a group keeps, the round cuts, the aborts they trigger and the freed slots; groups are
emitted in the order they completed, each once its rewards are in. So a slow verifier delays a
group's emission (throughput), never a decode step, and the groups, their order and their tokens
are those of an inline `reward_fn`. With `group_atomic=False` (per-sample admission, as slime/SGLang post
each sample as its own request) a request is taken from the policy as soon as one slot is free and
its samples start one by one, each with its own prefill, as slots free up; the samples of requests
already taken start before the policy is asked again. Tokens are the same either way (a sample's
random stream depends on its index, not its slot); only when each sample starts changes.

New weights (`set_params`) are taken between decode steps; every token records the version that
drew it. Running samples go on with their KV cache (PipelineRL), or, with `recompute_kv=True`
(AReaL interruptible generation), are re-prefilled first, prompt + tokens so far, with the new
weights: their next tokens and log-probs are then exactly the new policy's. Runs synchronously (`step`, `run_until_idle`) or in a background
thread (`start`, `drain`, `close`); an error in the thread is re-raised to the caller.

Thread-safety: `submit`, `abort`, `set_params` and the properties may be called from any thread.
Engine calls, rewards and `emit` run outside the lock, so a blocking `emit` (a full queue) never
blocks those calls.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import jax
import numpy as np

from rl.admission import AdmissionPolicy
from rl.elastic.migration import ReplicaView, RunningView
from rl.queue import QueueClosed
from rl.rounds import RoundCut, RoundCuts
from rl.types import Completion, Group, Request
from sampler.engine import Engine
from sampler.slot_export import SlotState

RewardFn = Callable[[Request, Completion], float]
EmitFn = Callable[[Group], None]


@dataclasses.dataclass
class _Sample:
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    start: float = 0.0  # when it entered its slot
    base: int = 0  # tokens it had when it entered this slot (> 0 after a migration)


@dataclasses.dataclass
class _Run:
    request: Request
    slots: list[int | None]  # sample i's (last) slot; None: not started yet (per-sample admission)
    samples: list[_Sample]
    # finished samples, each with its reward's Future
    done: dict[int, tuple[Completion, concurrent.futures.Future]] = dataclasses.field(
        default_factory=dict
    )
    aborted: bool = False  # aborted, or its group is already emitted


@dataclasses.dataclass(frozen=True)
class _Complete:
    """A complete group whose rewards may still be running: emitted once they are all in."""

    request: Request
    done: tuple[tuple[Completion, concurrent.futures.Future], ...]

    def ready(self) -> bool:
        return all(f.done() for _, f in self.done)

    def group(self) -> Group:
        """The Group (waits for the rewards; a reward runner's failure is raised here)."""
        return Group(
            request=self.request,
            completions=tuple(
                dataclasses.replace(c, reward=float(f.result())) for c, f in self.done
            ),
        )


@dataclasses.dataclass
class SamplerStats:
    prefills: int = 0
    groups_admitted: int = 0
    groups_emitted: int = 0
    groups_aborted: int = 0  # by abort() or by a round's cut
    groups_cut: int = 0  # complete groups refused by a full round cut
    samples_cut: int = 0  # unfinished samples dropped once their group kept `keep` finished ones
    cut_sample_tokens: int = 0  # tokens those samples had produced (a lower bound on their length)
    tokens: int = 0  # response tokens produced
    generate_calls: int = 0
    slot_steps: int = 0  # slots x decode steps run (occupancy = tokens / slot_steps)
    recomputes: int = 0  # recompute_kv: running samples re-prefilled after a weight swap
    recomputed_tokens: int = 0  # the tokens those re-prefills covered (prompt + response so far)
    migrations: int = 0  # requests handed off to another replica (JigsawRL migration)
    migrated_sequences: int = 0  # their running samples
    migrated_bytes: int = 0  # decode state moved (KV rows and per-slot state)

    @property
    def occupancy(self) -> float:
        return self.tokens / self.slot_steps if self.slot_steps else 0.0

    @classmethod
    def total(cls, stats: Iterable[SamplerStats]) -> SamplerStats:
        """The counters of several replicas summed."""
        out = cls()
        for one in stats:
            for f in dataclasses.fields(cls):
                setattr(out, f.name, getattr(out, f.name) + getattr(one, f.name))
        return out


@dataclasses.dataclass(frozen=True)
class Handoff:
    """A request's running samples taken out of one loop (`handoff`) for another (`adopt`).

    Attributes:
      run: the request's bookkeeping (tokens, log-probs and versions so far, finished samples
        with their rewards in flight).
      samples: the sample indices that were running, in the order of `state`'s rows.
      state: their decode state (Engine.export_slots), on the source's devices.
    """

    run: _Run
    samples: tuple[int, ...]
    state: SlotState


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
    ):
        self.engine = engine
        # Called on the loop's thread at every step boundary (after frees and adoptions, before
        # admission): a replica sampler decides and executes migrations there.
        self.on_boundary = on_boundary
        self.timeline = timeline  # rl.timeline.Timeline: slot, prefill and group-complete events
        self.clock = clock
        self.admission = admission
        self.reward_fn = reward_fn
        self.emit = emit
        self.group_atomic = group_atomic  # False: per-sample admission (see the module docstring)
        self.recompute_kv = recompute_kv  # re-prefill running samples when new weights come in
        self._partial: collections.deque[_Run] = collections.deque()  # runs with unstarted samples
        self.stats = SamplerStats()
        self._params, self._version = params, version
        self._pending_params: tuple[Any, int] | None = None
        self._state = engine.init_decode_state()
        self._slot_run: list[_Run | None] = [None] * engine.max_concurrent_decodes
        self._slot_sample = [0] * engine.max_concurrent_decodes  # the sample index in each slot
        self._runs: dict[tuple[int, int], _Run] = {}
        self._to_free: list[int] = []
        self._reserved: set[int] = set()  # free slots promised to an adoption (`reserve`)
        self._imports: list[tuple[list[int], SlotState]] = []  # adopted, imported at the next step
        self._unmovable: set[tuple[int, int]] = set()  # adopted runs not decoded here yet
        self._cuts = RoundCuts()  # which complete groups of a cut round are emitted
        self._scoring: collections.deque[_Complete] = collections.deque()  # completion order
        self._submit_reward = getattr(reward_fn, "submit", None)  # off the decode thread
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._idle = threading.Event()
        self._idle.set()
        self._stop = False
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    # ---------------------------------------------------------------------------- control (any thread)

    @property
    def error(self) -> BaseException | None:
        """The exception that stopped the loop thread, if any."""
        return self._error

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
                if r.key in self._runs:
                    raise ValueError(f"Request (round, uid)={r.key} is already running.")
            if cut is not None:
                self._cuts.add(cut, requests)
            self.admission.submit(requests)
            self._idle.clear()
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
            if r is None and key in self._runs:
                run = self._runs.pop(key)
                run.aborted = True
                self._release_slots(run)
                r = run.request
            if r is not None:
                out.append(r)
                self.stats.groups_aborted += 1
        return out

    def _release_slots(self, run: _Run) -> None:
        """Frees the slots `run` still holds (before the next decode step)."""
        for s, r in enumerate(self._slot_run):
            if r is run:
                self._slot_run[s] = None
                self._to_free.append(s)

    def set_params(self, params: Any, version: int) -> None:
        """New weights, taken between decode steps; tokens record the version that made them."""
        with self._lock:
            self._pending_params = (params, version)
            self._wake.notify_all()

    def busy_slots(self) -> int:
        with self._lock:
            return sum(r is not None for r in self._slot_run)

    def pending(self) -> int:
        """Requests waiting, running, or complete with rewards still running."""
        with self._lock:
            return len(self.admission) + len(self._runs) + len(self._scoring)

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
            to_free, self._to_free = self._to_free, []
            params, version = self._params, self._version
            # an adoption aborted before its import has its slots in to_free: nothing to import
            imports = [
                (slots, moved)
                for slots, moved in self._imports
                if all(self._slot_run[x] is not None for x in slots)
            ]
            self._imports = []
        if to_free:
            self._state = self.engine.free(self._state, to_free)
        for slots, moved in imports:
            self._state = self.engine.import_slots(self._state, moved, slots)
        if swapped and self.recompute_kv:
            self._recompute(params)
        if self.on_boundary is not None:
            self.on_boundary()
        self._admit(params)
        if not any(r is not None for r in self._slot_run):
            self._emit_scored(wait=True)  # nothing to decode: wait for rewards still running
            return self.pending() > 0
        self._state, result = self.engine.generate(params, self._state)
        result = jax.device_get(result)
        if imports:
            with self._lock:  # decoded here once: movable again
                self._unmovable.difference_update(self._slot_keys(imports))
        finished = self._record(result, version)
        complete = [g for g in (self._finish(run, s) for run, s in finished) if g is not None]
        with self._lock:
            self._scoring.extend(self._apply_cuts(complete))
        self._emit_scored(wait=False)
        return self.pending() > 0

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
                self.timeline.instant(
                    "sampler/groups",
                    "group",
                    self.clock(),
                    round=g.request.round,
                    uid=g.request.uid,
                )
            self.emit(g)

    def run_until_idle(self, max_steps: int | None = None) -> None:
        """Steps until nothing waits or runs (synchronous use)."""
        n = 0
        while self.step():
            n += 1
            if max_steps is not None and n >= max_steps:
                raise RuntimeError(f"Sampler still busy after {max_steps} steps.")

    def _admit(self, params: Any) -> None:
        """Starts what fits now; the prompts admitted together are prefilled in one batched call
        per length bucket (`Engine.prefill_insert`)."""
        if not self.may_admit():
            return
        admitted = []
        with self._lock:
            while True:
                if self._pending_params is not None:
                    # Weights published after this step took its params: what is admitted
                    # now waits for them (the next step), so a request submitted after a
                    # publish never runs on the weights before it (async's staleness bound
                    # counts on that).
                    break
                # a slot aborted since this step's frees is freed at the next one
                free = [
                    i
                    for i, r in enumerate(self._slot_run)
                    if r is None and i not in self._reserved and i not in self._to_free
                ]
                taken = self._take(len(free))
                if taken is None:
                    break
                run, samples = taken
                for i, s in zip(samples, free, strict=False):
                    run.slots[i] = s
                    self._slot_run[s], self._slot_sample[s] = run, i
                admitted.append((run, samples))
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

    def may_admit(self) -> bool:
        """Whether this step admits waiting requests: always. A subclass may hold them back (the
        static-batching baseline of launch/bench_sampler.py admits only into an empty loop)."""
        return True

    def _recompute(self, params: Any) -> None:
        """Re-prefills every running sample (prompt + its tokens so far) with `params`."""
        with self._lock:
            running = [
                (s, run, self._slot_sample[s], tuple(run.samples[self._slot_sample[s]].tokens))
                for s, run in enumerate(self._slot_run)
                if run is not None
            ]
        for s, run, i, generated in running:
            self._state = self.engine.reprefill(params, self._state, s, run.request, i, generated)
        with self._lock:
            self.stats.recomputes += len(running)
            self.stats.recomputed_tokens += sum(
                len(run.request.prompt) + len(g) for _, run, _, g in running
            )

    def _take(self, free: int) -> tuple[_Run, list[int]] | None:
        """The run and the sample indices to start in `free` slots now, or None (lock held)."""
        if free < 1:
            return None
        if not self.group_atomic:
            while self._partial and self._partial[0].aborted:  # aborted or emitted meanwhile
                self._partial.popleft()
            if self._partial:
                run = self._partial[0]
                i = run.slots.index(None)
                if None not in run.slots[i + 1 :]:
                    self._partial.popleft()
                return run, [i]
        # per-sample: any free slot takes the policy's next request, whatever its group size
        fits = free if self.group_atomic else self.engine.max_concurrent_decodes
        request = self.admission.next(fits)
        if request is None:
            return None
        g = request.group_size
        run = _Run(request=request, slots=[None] * g, samples=[_Sample() for _ in range(g)])
        self._runs[request.key] = run
        self.stats.groups_admitted += 1
        if self.group_atomic:
            return run, list(range(g))
        if g > 1:
            self._partial.append(run)
        return run, [0]

    def _record(self, result: Any, version: int) -> list[tuple[_Run, int]]:
        """Appends produced tokens to their samples; returns the (run, sample) pairs that finished."""
        finished = []
        k, b = result.tokens.shape
        with self._lock:
            self.stats.generate_calls += 1
            self.stats.slot_steps += k * b
            self.stats.tokens += int(np.sum(result.valid))
            for s in range(b):
                run = self._slot_run[s]
                if run is None:
                    continue  # free, or aborted while this call ran
                i = self._slot_sample[s]
                sample = run.samples[i]
                for t in range(k):
                    if not result.valid[t, s]:
                        continue
                    sample.tokens.append(int(result.tokens[t, s]))
                    sample.logprobs.append(float(result.logprobs[t, s]))
                    sample.versions.append(version)
                    if result.finished[t, s]:
                        self._slot_run[s] = None
                        finished.append((run, i))
                        if self.timeline is not None:
                            self.timeline.span(
                                f"sampler/slot{s}",
                                f"{run.request.uid}/{i}",
                                sample.start,
                                self.clock(),
                                round=run.request.round,
                                uid=run.request.uid,
                                sample=i,
                                tokens=len(sample.tokens) - sample.base,
                            )
                        break
        return finished

    def _apply_cuts(self, groups: list[_Complete]) -> list[_Complete]:
        """The complete groups the round cuts accept; aborts what a full cut leaves (lock held)."""
        groups, abort, refused = self._cuts.apply(groups)
        self._abort_locked(abort)
        self.stats.groups_cut += refused
        return groups

    def _score(self, request: Request, completion: Completion) -> concurrent.futures.Future:
        """The reward's Future: submitted to the reward workers, or computed here (inline)."""
        if self._submit_reward is not None:
            return self._submit_reward(request, completion)
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.set_result(float(self.reward_fn(request, completion)))
        return future

    def _finish(self, run: _Run, i: int) -> _Complete | None:
        """Records sample i of `run` as finished (its reward started); its group if complete."""
        r, sample = run.request, run.samples[i]
        stop = bool(sample.tokens) and sample.tokens[-1] in r.params.stop_token_ids
        completion = Completion(
            uid=r.uid,
            round=r.round,
            sample=i,
            prompt=r.prompt,
            tokens=tuple(sample.tokens),
            logprobs=tuple(sample.logprobs),
            versions=tuple(sample.versions),
            finish_reason="stop" if stop else "length",
        )
        with self._lock:
            if run.aborted:
                return None
        reward = self._score(r, completion)
        with self._lock:
            if run.aborted:
                return None
            run.done[i] = (completion, reward)
            if len(run.done) < r.kept:
                return None
            run.aborted = True  # emitted: later finishers of this run are dropped
            del self._runs[r.key]
            if r.kept < r.group_size:  # response over-provisioning: cut the unfinished samples
                for j, s in enumerate(run.slots):
                    if (
                        j not in run.done
                        and s is not None
                        and self._slot_run[s] is run
                        and (self._slot_sample[s] == j)
                    ):
                        self.stats.samples_cut += 1
                        self.stats.cut_sample_tokens += len(run.samples[j].tokens)
                self._release_slots(run)
        return _Complete(request=r, done=tuple(run.done[j] for j in sorted(run.done)))

    # ----------------------------------------------------------------------------------- migration

    def _slot_keys(self, imports: list[tuple[list[int], SlotState]]) -> set[tuple[int, int]]:
        return {
            run.request.key
            for slots, _ in imports
            for s in slots
            if (run := self._slot_run[s]) is not None
        }

    @property
    def idle(self) -> bool:
        """Nothing waits, runs or is being scored here."""
        return self.pending() == 0

    def view(self) -> ReplicaView:
        """This loop as a migration policy sees it (rl.elastic.migration)."""
        with self._lock:
            count: dict[int, int] = {}
            runs: dict[int, _Run] = {}
            left: dict[int, int] = {}
            for s, run in enumerate(self._slot_run):
                if run is None:
                    continue
                sample = run.samples[self._slot_sample[s]]
                count[id(run)] = count.get(id(run), 0) + 1
                runs[id(run)] = run
                rest = run.request.params.max_new_tokens - len(sample.tokens)
                left[id(run)] = max(left.get(id(run), 0), rest)
            running = tuple(
                RunningView(
                    key=run.request.key,
                    sequences=count[i],
                    tokens_left=left[i],
                    movable=self._movable(run),
                )
                for i, run in runs.items()
            )
            free = sum(
                r is None and s not in self._reserved and s not in self._to_free
                for s, r in enumerate(self._slot_run)
            )
            return ReplicaView(
                slots=self.num_slots, free=free, queued=len(self.admission) > 0, running=running
            )

    def running(self, key: tuple[int, int]) -> bool:
        """Request `key` is admitted here and its group not yet complete."""
        with self._lock:
            return key in self._runs

    def _movable(self, run: _Run) -> bool:
        """A run can move: not done, every sample started, decoded here since it came (lock)."""
        return (
            not run.aborted
            and None not in run.slots
            and run.request.key not in self._unmovable
            and run.request.key in self._runs
        )

    def reserve(self, n: int) -> list[int] | None:
        """Promises n free slots to an adoption (any thread); None if fewer are free now."""
        with self._lock:
            free = [
                s
                for s, r in enumerate(self._slot_run)
                if r is None and s not in self._reserved and s not in self._to_free
            ]
            if n < 1 or len(free) < n:
                return None
            self._reserved.update(free[:n])
            return free[:n]

    def unreserve(self, slots: Iterable[int]) -> None:
        """Gives back slots `reserve` promised and no adoption took."""
        with self._lock:
            self._reserved.difference_update(slots)

    def handoff(self, key: tuple[int, int]) -> Handoff | None:
        """Takes request `key`'s running samples out of this loop (on its own thread, at a step
        boundary: in `on_boundary`), with their decode state; their slots are freed here.

        Returns:
          The Handoff, or None when the request no longer runs here (it finished, or was aborted
          or cut since the policy saw it): the caller gives back what it reserved.
        """
        with self._lock:
            run = self._runs.get(key)
            if run is None:
                return None
            if not self._movable(run):
                raise ValueError(
                    f"handoff: request {key} is not a movable running request here; expected "
                    "one with every sample started and decoded here since it came."
                )
            slots = [s for s, r in enumerate(self._slot_run) if r is run]
            samples = tuple(self._slot_sample[s] for s in slots)
            del self._runs[key]
            for s in slots:
                self._slot_run[s] = None
        moved = self.engine.export_slots(self._state, slots)
        self._state = self.engine.free(self._state, slots)
        t1 = self.clock()
        with self._lock:
            self.stats.migrations += 1
            self.stats.migrated_sequences += len(slots)
            self.stats.migrated_bytes += moved.nbytes
        if self.timeline is not None:
            r = run.request
            for s, i in zip(slots, samples, strict=True):
                sample = run.samples[i]
                self.timeline.span(
                    f"sampler/slot{s}",
                    f"{r.uid}/{i}",
                    sample.start,
                    t1,
                    round=r.round,
                    uid=r.uid,
                    sample=i,
                    tokens=len(sample.tokens) - sample.base,
                    migrated=True,
                )
        return Handoff(run=run, samples=samples, state=moved)

    def adopt(self, handoff: Handoff, slots: list[int]) -> None:
        """Takes over a request another loop handed off, into slots `reserve` gave (any
        thread); its state is imported before the next decode step, and its group completes here."""
        run = handoff.run
        if len(slots) != len(handoff.samples):
            raise ValueError(
                f"adopt: {len(handoff.samples)} samples need as many slots; received {slots}."
            )
        now = self.clock()
        with self._lock:
            if not set(slots) <= self._reserved:
                raise ValueError(f"adopt: slots {slots} were not reserved here.")
            self._raise_if_failed()
            for s, i in zip(slots, handoff.samples, strict=True):
                run.slots[i] = s
                self._slot_run[s], self._slot_sample[s] = run, i
                run.samples[i].start, run.samples[i].base = now, len(run.samples[i].tokens)
            self._reserved.difference_update(slots)
            self._runs[run.request.key] = run
            self._unmovable.add(run.request.key)
            self._imports.append((list(slots), handoff.state))
            self._idle.clear()
            self._wake.notify_all()

    # ------------------------------------------------------------------------------------ threaded

    def start(self) -> None:
        """Runs the loop in a background thread until `close`."""
        if self._thread is not None:
            raise RuntimeError("SamplerLoop.start called twice.")
        self._thread = threading.Thread(target=self._thread_main, name="sampler-loop", daemon=True)
        self._thread.start()

    def _thread_main(self) -> None:
        try:
            while True:
                with self._lock:
                    while not self._stop and not (
                        len(self.admission)
                        or self._runs
                        or self._scoring
                        or self._to_free
                        or self._imports
                        or self._pending_params
                    ):
                        self._idle.set()
                        self._wake.wait()
                    if self._stop:
                        return
                self.step()
        except BaseException as e:  # surfaced to the caller by drain/close/submit
            with self._lock:
                # Work running ahead (async) may finish while the run shuts down: once a stop is
                # requested, a group the closed queue refuses is dropped, not an error.
                if not (self._stop and isinstance(e, QueueClosed)):
                    self._error = e
        finally:
            self._idle.set()

    def drain(self, timeout: float | None = None) -> None:
        """Blocks until nothing waits or runs; re-raises an error from the loop thread."""
        if self._thread is None:
            self.run_until_idle()
            return
        if not self._idle.wait(timeout):
            raise TimeoutError(
                f"Sampler did not drain within {timeout} s ({self.pending()} requests pending)."
            )
        with self._lock:
            self._raise_if_failed()

    def request_stop(self) -> None:
        """Asks the loop thread to stop after its current step; `close` waits for it."""
        with self._lock:
            self._stop = True
            self._wake.notify_all()

    def close(self) -> None:
        """Stops the loop thread (work in flight is dropped); re-raises a loop error."""
        self.request_stop()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error
