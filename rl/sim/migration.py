"""The simulated sampler's half of long-tail migration (rl/sim/sampler.py's SimSampler).

At a replica's call boundary the SimSampler asks the migration policy (rl.elastic.migration, the
object the runtime runs) and executes the moves out of that replica here: the request's running
sequences leave their slots, slots are reserved on the destination, and after
StageModel.migrate_s(their KV tokens) they continue there from the token they reached.
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING, Any

from rl.elastic.migration import ReplicaView, RunningView

if TYPE_CHECKING:
    from rl.sim.sampler import _Replica, _Seq


class SimMigration:
    """Migration for SimSampler (a mixin: it uses the sampler's replicas, clock and timeline)."""

    replicas: list[_Replica]
    migration: Any
    slots: int
    model: Any
    timeline: Any
    counters: Any
    _pending: dict
    _schedule: Any
    _step: Any  # SimSampler's: a step at a call boundary
    _cut: Any  # SimSampler's: end a replica's jump at the next call boundary

    def _view(self, rep: _Replica) -> ReplicaView:
        k = self.model.steps_per_call
        runs: dict[tuple[int, int], list[_Seq]] = {}
        for seq in rep.seqs:
            if seq is not None:
                runs.setdefault(seq.request.key, []).append(seq)
        return ReplicaView(
            slots=self.slots,
            free=len(rep.free_slots()),
            queued=len(rep.admission) > 0,
            running=tuple(
                RunningView(
                    key=key,
                    sequences=len(seqs),
                    tokens_left=max(s.length - k * (rep.calls - s.admit_call) for s in seqs),
                    movable=key not in rep.fresh,
                )
                for key, seqs in runs.items()
            ),
        )

    def _migrate(self, rep: _Replica, now: float) -> None:
        """Executes the policy's moves out of `rep` (at its call boundary)."""
        assert self.migration is not None
        views = [self._view(r) for r in self.replicas]
        k = self.model.steps_per_call
        for move in self.migration.moves(views):
            if move.src != rep.index:
                continue
            dst = self.replicas[move.dst]
            p = self._pending[move.key]
            seqs = [s for s in rep.seqs if s is not None and s.request.key == move.key]
            slots = dst.free_slots()[: len(seqs)]
            dst.reserved.update(slots)
            moved, kv_tokens = [], 0
            for seq, slot in zip(seqs, slots, strict=True):
                made = k * (rep.calls - seq.admit_call)
                rep.remove(seq)
                kv_tokens += len(seq.request.prompt) + made
                self._slot_span(rep, seq, now, made, migrated=True)
                moved.append((seq, slot, made))
            t = now + self.model.migrate_s(kv_tokens)
            self.timeline.span(
                "sampler/migrate",
                "migrate",
                now,
                t,
                round=move.key[0],
                uid=move.key[1],
                sequences=len(seqs),
                bytes=kv_tokens * self.model.kv_bytes_per_token,
                src=rep.index,
                dst=dst.index,
            )
            self.counters.migrations += 1
            self.counters.migrated_sequences += len(seqs)
            p.replica = dst.index
            dst.incoming.append((t, p, moved))
            self._schedule(t, lambda t, dst=dst: self._arrive(dst, t))

    def _arrive(self, dst: _Replica, now: float) -> None:
        """Migrated sequences reached `dst`: an idle one starts, a busy one takes them at its
        next call boundary."""
        if dst.chunk is None:
            if not dst.busy:
                self._step(dst, now)
            return
        self._cut(dst, now)

    def _import(self, rep: _Replica, now: float) -> None:
        """Adopts the migrated sequences that have arrived (at a call boundary)."""
        k = self.model.steps_per_call
        arrived = [x for x in rep.incoming if x[0] <= now]
        rep.incoming = [x for x in rep.incoming if x[0] > now]
        for _, p, moved in arrived:
            rep.reserved.difference_update(slot for _, slot, _ in moved)
            if self._pending.get(p.request.key) is not p:  # aborted on the way
                continue
            for old, slot, made in moved:
                admit = rep.calls - made // k
                finish = admit + -(-old.length // k)
                seq = type(old)(old.request, old.sample, slot, old.length, admit, finish, now, made)
                p.seqs[p.seqs.index(old)] = seq
                rep.seqs[slot] = seq
                heapq.heappush(rep.heap, (seq.finish_call, id(seq), slot))
                rep.active += 1
                rep.prompt_sum += len(seq.request.prompt)
                rep.admit_sum += admit
            rep.fresh.add(p.request.key)
