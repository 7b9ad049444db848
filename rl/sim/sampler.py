"""The simulated sampler: replicas of N slots each, driven by the real admission policies.

It does what sampler/loop.py does, on a virtual clock: at each step a replica frees finished and
aborted slots, asks the admission policy for requests while it has free slots (a request is admitted
whole: one prefill, G slots), then runs generate calls of k fused decode steps over its active
slots. A sequence finishes at the end of the call that produced its last token; once `request.kept`
samples are rewarded the group is complete (over-provisioned samples still running are cut), and a
round's RoundCut, if it has one, decides whether it is emitted: a full cut aborts the round's other
requests, as sampler/loop.py does. Spans and instants go to a real rl.timeline.Timeline on the
runtime's lanes (sampler/slot{i}, sampler/prefill, sampler/groups; slot i of replica r is lane r *
slots + i). Aborted sequences leave no slot span, as in the real loop.

Speed: between two events nothing changes but the context, so a replica jumps to its next
finishing call in one event (StageModel.decode_calls_s sums the calls in closed form); an abort or
a change of contention cuts the jump at the call in flight.

Migration (JigsawRL): with a policy (rl.elastic.migration, the object the threaded replica sampler
runs), a replica at a call boundary, before it admits, asks it and executes the moves out of it:
the request's running sequences leave their slots (a partial slot span, args migrated=True), free
slots are reserved on the destination, and after StageModel.migrate_s(their KV tokens) they
continue there from the token they reached (the destination's jump is cut so it imports them at
its next call boundary; an idle destination starts then). A "migrate" span on sampler/migrate
records each (args round, uid, sequences, bytes, src, dst), as in the runtime.

Paged KV (rl/sim/paging.py): with StageModel.kv_pages > 0 a replica's pool of KV pages, not only
its slots, bounds what runs: groups are admitted when their pages fit, the youngest sequences are
swapped out when the pool runs out mid-decode and resumed, oldest first, when pages free up; a
jump also ends at the first call that would overflow the pool.

Routing: "shared" (one admission policy; a replica pulls from it whenever it has free slots at a
call boundary, an idle one at once) or "round_robin" (a policy per replica; submissions dealt in
turn; at a call boundary a replica with free slots and an empty queue takes requests waiting on
the replica with the longest queue, as the runtime's replicas steal work).
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from rl.admission import AdmissionPolicy
from rl.elastic.migration import MigrationPolicy
from rl.elastic.stage import StageModel
from rl.round_planner import RoundCut, RoundCuts
from rl.sim.migration import SimMigration
from rl.sim.paging import SimPaging
from rl.sim.replica import Chunk, Pending, Replica, Seq
from rl.sim.workload import Workload
from rl.timeline import Timeline
from rl.types import Completion, Group, Request

SIM_ROUTINGS = ("shared", "round_robin")
Schedule = Callable[[float, Callable[[float], None]], None]


@dataclasses.dataclass
class SamplerCounters:
    prefills: int = 0
    groups_emitted: int = 0
    groups_aborted: int = 0
    groups_cut: int = 0  # complete groups a full round cut refused
    samples_cut: int = 0  # unfinished over-provisioned samples dropped (Request.keep)
    tokens: int = 0  # tokens of finished sequences
    aborted_tokens: int = 0  # tokens decoded by sequences later aborted (wasted work)
    migrations: int = 0  # requests moved between replicas
    migrated_sequences: int = 0
    preemptions: int = 0  # sequences swapped out for KV pages (rl/sim/paging.py)
    swap_s: float = 0.0  # replica-seconds spent swapping KV pages out and back in
    swap_pages: int = 0  # KV pages swapped, both ways
    seq_s: float = 0.0  # sequence-seconds decoding (running sequences x call time, summed)
    peak_running: int = 0  # the most sequences running on one replica at once


class SimSampler:
    """Replicas over a virtual clock; see the module docstring.

    Args:
      model: stage-time model of one replica.
      workload: gives each request's sample lengths.
      admission: one policy per replica for "round_robin", one (shared) for "shared".
      replicas: engines.
      slots: slots per replica.
      routing: "shared" or "round_robin".
      schedule: schedule(t, fn) runs fn(t) at virtual time t (the simulator's event queue).
      emit: emit(group, t) when a group completes.
      on_busy: on_busy(busy, t) when the sampler as a whole turns busy or idle.
      on_idle: on_idle(replica index, t) when a replica turns idle.
      timeline: where spans go.
      migration: a long-tail migration policy (rl.elastic.migration); None: none.
    """

    def __init__(
        self,
        model: StageModel,
        workload: Workload,
        admission: list[AdmissionPolicy],
        *,
        replicas: int,
        slots: int,
        routing: str,
        schedule: Schedule,
        emit: Callable[[Group, float], None],
        on_busy: Callable[[bool, float], None],
        timeline: Timeline,
        on_idle: Callable[[int, float], None] | None = None,
        migration: MigrationPolicy | None = None,
    ):
        if routing not in SIM_ROUTINGS:
            raise ValueError(f"routing={routing!r}; expected one of {SIM_ROUTINGS}.")
        want = 1 if routing == "shared" else replicas
        if len(admission) != want or replicas < 1:
            raise ValueError(
                f"routing {routing!r} with {replicas} replicas takes {want} admission policies; "
                f"received {len(admission)}."
            )
        self.model, self.workload, self.routing = model, workload, routing
        self.slots = slots
        self.paging = SimPaging(self)
        self.replicas = [
            Replica(i, slots, admission[0 if routing == "shared" else i], self.paging.page)
            for i in range(replicas)
        ]
        self.schedule, self._emit, self._on_busy, self._on_idle = schedule, emit, on_busy, on_idle
        self.timeline = timeline
        self.migration = migration
        self.migrator = SimMigration(self)
        self.factor = 1.0
        self.version = 0  # the weights' version; a sequence is stamped with it at admission
        self.counters = SamplerCounters()
        self.pending: dict[tuple[int, int], Pending] = {}  # waiting or running requests
        self._cuts = RoundCuts()  # which complete groups of a cut round are emitted
        self._deal = 0
        self._order = 0  # admissions so far: a sequence's age (paging preempts the youngest)
        self.peak_replicas = replicas  # the most replicas at once (borrowed ones included)

    @property
    def num_slots(self) -> int:
        return self.slots * len(self.replicas)

    @property
    def busy(self) -> bool:
        return any(r.busy for r in self.replicas)

    # ------------------------------------------------------------------------------ control

    def submit(self, requests: Iterable[Request], now: float, cut: RoundCut | None = None) -> None:
        """Queues requests for admission; idle replicas start at once, busy ones with free slots
        admit at the end of their call in flight (not at their next finishing sequence).

        With `cut` (one round's requests), only the complete groups the cut accepts are emitted;
        once it is full the round's other requests are aborted.
        """
        requests = list(requests)
        if cut is not None:
            self._cuts.add(cut, requests)
        for r in requests:
            if r.group_size > self.slots:
                raise ValueError(
                    f"Request (round, uid)={r.key} has group_size {r.group_size}; a replica has "
                    f"{self.slots} slots, so it could never be admitted."
                )
            if r.key in self.pending:
                raise ValueError(f"Request (round, uid)={r.key} is already waiting or running.")
            self.paging.check(r)
        if self.routing == "shared":
            self.replicas[0].admission.submit(requests)
            homes = [0] * len(requests)
        else:
            homes = [(self._deal + i) % len(self.replicas) for i in range(len(requests))]
            self._deal += len(requests)
            for i, rep in enumerate(self.replicas):
                rep.admission.submit([r for r, h in zip(requests, homes, strict=True) if h == i])
        for r, h in zip(requests, homes, strict=True):
            self.pending[r.key] = Pending(r, h, self.workload.lengths(r))
        self._admit_idle(now)
        for rep in self.replicas:  # busy ones with free slots admit at their next call boundary
            if rep.busy and len(rep.admission) and rep.free_slots():
                self.cut_jump(rep, now)

    def abort(self, keys: Iterable[tuple[int, int]], now: float) -> list[Request]:
        """Aborts waiting or running requests; their slots free at the call in flight's end."""
        out = []
        for key in keys:
            p = self.pending.pop(key, None)
            if p is None:
                continue
            rep = self.replicas[p.replica]
            if rep.admission.remove(key) is None:  # running: free its slots
                self.counters.aborted_tokens += self._release(rep, p)
                self.cut_jump(rep, now)
            self.counters.groups_aborted += 1
            out.append(p.request)
        return out

    def _release(self, rep: Replica, p: Pending) -> int:
        """Frees the slots `p` still holds and forgets its swapped samples; returns the tokens its
        unfinished samples made."""
        made = sum(m for _, m in self.paging.drop(rep, p.request.key))
        for seq in p.seqs:
            if rep.seqs[seq.slot] is seq:
                made += min(seq.length, self.model.steps_per_call * (rep.calls - seq.admit_call))
                rep.remove(seq)
        return made

    def set_factor(self, factor: float, now: float) -> None:
        """Contention slowdown from now on; calls in flight finish at the old speed."""
        if factor != self.factor:
            self.factor = factor
            for rep in self.replicas:
                self.cut_jump(rep, now)

    # --------------------------------------------------------------------------- the replica

    def replica_busy_s(self, now: float) -> list[float]:
        """Each replica's busy time so far (replica-seconds; what migration frees)."""
        return [r.busy_s + (now - r.busy_since if r.busy else 0.0) for r in self.replicas]

    def _set_busy(self, rep: Replica, busy: bool, now: float) -> None:
        before = self.busy
        if busy and not rep.busy:
            rep.busy_since = now
        elif rep.busy and not busy:
            rep.busy_s += now - rep.busy_since
        rep.busy = busy
        if self.busy != before:
            self._on_busy(self.busy, now)
        if not busy and self._on_idle is not None:
            self._on_idle(rep.index, now)

    def _admit_idle(self, now: float) -> None:
        """Idle replicas admit what waits; "shared": one group at a time to the least loaded."""
        idle = [r for r in self.replicas if not r.busy and not r.parked]
        if self.routing == "round_robin":
            for rep in idle:
                self.step(rep, now)
            return
        t = {rep.index: self.paging.boundary(rep, now) for rep in idle}  # swaps (paged KV)
        while idle:
            rep = max(idle, key=lambda r: (self.paging.room(r), -r.index))
            request = rep.admission.next(self.paging.room(rep))
            if request is None:
                break
            t[rep.index] = self._admit(rep, request, t[rep.index])
        for rep in idle:
            self._go(rep, t[rep.index])

    def step(self, rep: Replica, now: float) -> None:
        """A step at a call boundary: adopt what arrived, migrate out what the policy says,
        admit what fits (prefills), then plan the next calls."""
        self.migrator.take_arrivals(rep, now)
        self._steal(rep)
        if self.migration is not None and len(self.replicas) > 1:
            self.migrator.migrate(rep, now)
        t = self.paging.boundary(rep, now)
        while (request := rep.admission.next(self.paging.room(rep))) is not None:
            t = self._admit(rep, request, t)
        self._go(rep, t)

    def _steal(self, rep: Replica) -> None:
        """round_robin: a replica with free slots and nothing waiting takes requests waiting on
        the replica with the longest queue, as the runtime's replicas do at a step boundary."""
        if self.routing != "round_robin" or len(rep.admission) or not rep.free_slots():
            return
        other = max(self.replicas, key=lambda r: (len(r.admission), -r.index))
        room, taken = len(rep.free_slots()), []
        while room > 0 and (r := other.admission.next(1 << 30)) is not None:
            taken.append(r)
            room -= r.group_size
        rep.admission.submit(taken)

    def _admit(self, rep: Replica, request: Request, now: float) -> float:
        """Prefills one request into the replica's free slots; returns when the prefill ends."""
        p = self.pending[request.key]
        p.replica = rep.index
        if not p.resume:
            p.version = self.version
        if not rep.busy:
            self._set_busy(rep, True, now)
        # a resumed request re-prefills each unfinished sample's tokens too
        kv = len(request.prompt) + sum(p.resume.values())
        t = now + self.factor * self.model.prefill_s(kv)
        self.timeline.span(
            "sampler/prefill", "prefill", now, t, round=request.round, uid=request.uid
        )
        self.counters.prefills += 1
        k = self.model.steps_per_call
        samples = [i for i in range(len(p.lengths)) if i not in p.done]
        self._order += 1
        for i, slot in zip(samples, rep.free_slots(), strict=False):
            n, made = p.lengths[i], p.resume.get(i, 0)
            admit = rep.calls - made // k
            seq = Seq(request, i, slot, n, admit, admit + -(-n // k), t, made, self._order)
            p.seqs.append(seq)
            rep.add(seq)
        p.resume = {}
        return t

    def _go(self, rep: Replica, now: float) -> None:
        """Plans the replica's calls up to its next finishing sequence, or idles it."""
        if not rep.active:
            if rep.busy:
                self._set_busy(rep, False, now)
            return
        if not rep.busy:
            self._set_busy(rep, True, now)
        now = self.paging.fit(rep, now)  # a re-prefilled request may not fit (rl/sim/paging.py)
        calls = self.paging.overflow_call(rep, self._next_finish(rep)) - rep.calls
        self.counters.peak_running = max(self.counters.peak_running, rep.active)
        rep.chunk = Chunk(
            now, calls, rep.active, rep.context(self.model.steps_per_call), self.factor
        )
        self._plan(rep)

    def _next_finish(self, rep: Replica) -> int:
        while True:
            fc, sid, slot = rep.heap[0]
            seq = rep.seqs[slot]
            if seq is not None and seq.serial == sid:
                return fc
            heapq.heappop(rep.heap)

    def _elapsed(self, c: Chunk, calls: int) -> float:
        return c.factor * self.model.decode_calls_s(calls, c.slots, c.context)

    def _plan(self, rep: Replica) -> None:
        rep.epoch += 1
        epoch, c = rep.epoch, rep.chunk
        assert c is not None
        self.schedule(c.start + self._elapsed(c, c.calls), lambda t: self._end(rep, epoch, t))

    def cut_jump(self, rep: Replica, now: float) -> None:
        """Ends the replica's current jump at the first call boundary at or after `now`."""
        c = rep.chunk
        if c is None or c.calls <= 1:
            return
        lo, hi = 1, c.calls
        while lo < hi:
            mid = (lo + hi) // 2
            if c.start + self._elapsed(c, mid) >= now:
                hi = mid
            else:
                lo = mid + 1
        if lo < c.calls:
            c.calls = lo
            self._plan(rep)

    def _end(self, rep: Replica, epoch: int, now: float) -> None:
        if epoch != rep.epoch or rep.chunk is None:
            return
        self.counters.seq_s += rep.chunk.slots * self._elapsed(rep.chunk, rep.chunk.calls)
        rep.calls += rep.chunk.calls
        rep.chunk = None
        rep.fresh.clear()
        finished: list[Seq] = []
        while rep.heap and rep.heap[0][0] <= rep.calls:
            _, sid, slot = heapq.heappop(rep.heap)
            seq = rep.seqs[slot]
            if seq is not None and seq.serial == sid:
                finished.append(seq)
                rep.remove(seq)
        groups = []
        for seq in finished:
            r = seq.request
            self.slot_span(rep, seq, now, seq.length)
            self.counters.tokens += seq.length
            p = self.pending.get(r.key)
            if p is None:  # its group completed earlier in this call: dropped, as in the loop
                continue
            p.done[seq.sample] = Completion(
                uid=r.uid,
                round=r.round,
                sample=seq.sample,
                prompt=r.prompt,
                tokens=(0,) * seq.length,  # placeholders: the simulator times, it does not decode
                logprobs=(),
                # the version at admission for every token: an upper bound of each token's lag
                # (the real engine swaps weights between decode steps)
                versions=(p.version,) * seq.length,
                finish_reason="length" if seq.length >= r.params.max_new_tokens else "stop",
                reward=0.0,
            )
            if len(p.done) == r.kept and r.key in self.pending:
                del self.pending[r.key]
                if r.kept < r.group_size:  # over-provisioned: cut the samples still running
                    self.counters.samples_cut += sum(
                        rep.seqs[q.slot] is q or q.serial in rep.swapped for q in p.seqs
                    )
                    self.counters.aborted_tokens += self._release(rep, p)
                completions = tuple(p.done[i] for i in sorted(p.done))
                groups.append(Group(request=r, completions=completions))
        t = now + self.model.reward_s * len(finished)
        if t > now:
            self.schedule(t, lambda t: self._finish_step(rep, groups, t))
        else:
            self._finish_step(rep, groups, now)

    def _apply_cuts(self, groups: list[Group], now: float) -> list[Group]:
        groups, abort, refused = self._cuts.apply(groups)
        self.abort(abort, now)
        self.counters.groups_cut += refused
        return groups

    def _finish_step(self, rep: Replica, groups: list[Group], now: float) -> None:
        groups = self._apply_cuts(groups, now)
        for g in groups:
            self.timeline.instant(
                "sampler/groups", "group", now, round=g.request.round, uid=g.request.uid
            )
            self.counters.groups_emitted += 1
        for g in groups:
            self._emit(g, now)  # may abort (a full round) or change the contention factor
        if rep.chunk is None:
            self.step(rep, now)

    def slot_span(self, rep: Replica, seq: Seq, now: float, made: int, **args: Any) -> None:
        """`seq`'s span on its slot lane, from its start to `now`, having made `made` tokens."""
        r = seq.request
        self.timeline.span(
            f"sampler/slot{rep.index * self.slots + seq.slot}",
            f"{r.uid}/{seq.sample}",
            seq.start,
            now,
            round=r.round,
            uid=r.uid,
            sample=seq.sample,
            tokens=made - seq.base,
            **args,
        )

    # ------------------------------------------------------------------- elastic (rl/elastic)

    @property
    def outstanding(self) -> int:
        """Requests submitted and not yet emitted, aborted or cut."""
        return len(self.pending)

    def remaining(
        self,
        select: Callable[[Request], bool] | None = None,
        submitting: Sequence[Request] = (),
    ) -> tuple[int, int, int, float]:
        """(sequences, tokens, longest, mean context) still to decode, from the known lengths, of
        the pending requests `select` accepts (default all) and of `submitting` (about to be
        submitted: nothing made yet)."""
        k, seqs, tokens, longest, context = self.model.steps_per_call, 0, 0, 0, 0.0
        for p in self.pending.values():
            if select is not None and not select(p.request):
                continue
            running = {s.sample: s for s in p.seqs}
            for i, n in enumerate(p.lengths[: p.request.kept]):
                if i in p.done:
                    continue
                s = running.get(i)
                swapped = None if s is None else self.replicas[p.replica].swapped.get(s.serial)
                if s is None or swapped is not None:
                    made = p.resume.get(i, 0) if s is None else swapped[1]
                else:
                    made = k * (self.replicas[p.replica].calls - s.admit_call)
                left = max(n - made, 0)
                seqs, tokens, longest = seqs + 1, tokens + left, max(longest, left)
                context += len(p.request.prompt) + made
        for r in submitting:
            for n in self.workload.lengths(r)[: r.kept]:
                seqs, tokens, longest = seqs + 1, tokens + n, max(longest, n)
                context += len(r.prompt)
        return seqs, tokens, longest, context / seqs if seqs else 0.0

    def add_replicas(self, count: int, now: float) -> None:
        """`count` more replicas (borrowed devices) pulling from the shared admission policy."""
        if self.routing != "shared":
            raise ValueError(f"add_replicas needs routing 'shared'; received {self.routing!r}.")
        admission = self.replicas[0].admission
        n = len(self.replicas)
        self.replicas += [
            Replica(n + i, self.slots, admission, self.paging.page) for i in range(count)
        ]
        self.peak_replicas = max(self.peak_replicas, len(self.replicas))
        self._admit_idle(now)

    @property
    def queued(self) -> int:
        """Sequences of requests waiting for admission."""
        return sum(p.request.group_size for p in self.pending.values() if not p.seqs)

    def evict_replicas(self, count: int, now: float) -> None:
        """Removes the last `count` replicas now, busy or not (lent devices taken back): what
        runs there goes back to the queue, each sample with the tokens it has made, and is
        re-prefilled (prompt + those tokens) when admitted again; nothing is lost."""
        if self.routing != "shared" or count >= len(self.replicas):
            raise ValueError(
                f"evict_replicas({count}) needs routing 'shared' and a replica left; "
                f"{len(self.replicas)} replicas, routing {self.routing!r}."
            )
        k = self.model.steps_per_call
        gone = self.replicas[len(self.replicas) - count :]
        del self.replicas[len(self.replicas) - count :]
        again: dict[tuple[int, int], Pending] = {}
        for rep in gone:
            for seq in [s for s in rep.seqs if s is not None]:
                p = self.pending[seq.request.key]
                made = min(seq.length, k * (rep.calls - seq.admit_call))
                p.resume[seq.sample] = made
                rep.remove(seq)
                self.slot_span(rep, seq, now, made, evicted=True)
                again[p.request.key] = p
            for seq, made in list(rep.swapped.values()):  # on host: re-prefilled elsewhere
                p = self.pending[seq.request.key]
                p.resume[seq.sample] = made
                again[p.request.key] = p
            rep.swapped.clear()
            for _, p, moved in rep.incoming:  # on their way here: they resume elsewhere
                for old, _, made in moved:
                    p.resume[old.sample] = made
                again[p.request.key] = p
            rep.incoming.clear()
            rep.epoch += 1  # its planned call end is void
            rep.chunk = None
            if rep.busy:
                self._set_busy(rep, False, now)
        for p in again.values():
            p.seqs = []
        self.replicas[0].admission.submit([p.request for p in again.values()])
        self._admit_idle(now)
        for rep in self.replicas:
            if rep.busy and len(rep.admission) and rep.free_slots():
                self.cut_jump(rep, now)

    def remove_replicas(self, count: int) -> None:
        """Removes the last `count` replicas, which must be idle (the borrowed devices return)."""
        gone = self.replicas[len(self.replicas) - count :]
        if count >= len(self.replicas) or any(r.active or r.busy for r in gone):
            raise RuntimeError(f"remove_replicas({count}): those replicas are not idle.")
        del self.replicas[len(self.replicas) - count :]

    def remaining_learner_tokens(self, submitting: Sequence[Request] = ()) -> int:
        """Prompt + response tokens the learner will train for the requests not yet emitted
        (`submitting`, about to be submitted, included)."""
        requests = [(p.request, p.lengths) for p in self.pending.values()]
        requests += [(r, self.workload.lengths(r)) for r in submitting]
        return sum(sum(len(r.prompt) + n for n in lengths[: r.kept]) for r, lengths in requests)
