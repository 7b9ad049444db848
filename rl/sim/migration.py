"""The simulated sampler's half of long-tail migration (rl/sim/sampler.py's SimSampler).

At a replica's call boundary the SimSampler asks the migration policy (rl.elastic.migration, the
object the runtime runs) and executes the moves out of that replica here: the request's running
sequences leave their slots, slots are reserved on the destination, and after
StageModel.migrate_s(their KV tokens) they continue there from the token they reached. With paged
KV the policy sees each replica's pool and free pages (rl/sim/paging.py `free`: less what its
swapped-out and arriving sequences will take) and each request's pages; nothing new is charged.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from rl.elastic.migration import ReplicaView, RunningView
from rl.sim.replica import Replica, Seq


class SimMigration:
    """Migration for a SimSampler: its replicas, policy, clock and timeline (`sampler`)."""

    def __init__(self, sampler: Any):
        self.sampler = sampler

    def _view(self, rep: Replica) -> ReplicaView:
        if rep.parked:  # serving another pipeline: no slots for this one's moves
            return ReplicaView(slots=0, free=0)
        k = self.sampler.model.steps_per_call
        runs: dict[tuple[int, int], list[Seq]] = {}
        swapped = {seq.request.key for seq, _ in rep.swapped.values()}  # stay: KV on this host
        for seq in rep.seqs:
            if seq is not None:
                runs.setdefault(seq.request.key, []).append(seq)
        paging = self.sampler.paging
        return ReplicaView(
            slots=self.sampler.slots,
            free=len(rep.free_slots()),
            queued=len(rep.admission) > 0,
            running=tuple(
                RunningView(
                    key=key,
                    sequences=len(seqs),
                    tokens_left=max(s.length - k * (rep.calls - s.admit_call) for s in seqs),
                    movable=key not in rep.fresh and key not in swapped,
                    kv_pages=paging.kv_pages(seqs, rep.calls),
                )
                for key, seqs in runs.items()
            ),
            pages=paging.pool,
            free_pages=paging.free(rep),
            page=paging.page,
            leaving=rep.leaving,
        )

    def migrate(self, rep: Replica, now: float) -> None:
        """Executes the policy's moves out of `rep` (at its call boundary)."""
        assert self.sampler.migration is not None
        views = [self._view(r) for r in self.sampler.replicas]
        k = self.sampler.model.steps_per_call
        for move in self.sampler.migration.moves(views):
            if move.src != rep.index:
                continue
            dst = self.sampler.replicas[move.dst]
            p = self.sampler.pending[move.key]
            seqs = [s for s in rep.seqs if s is not None and s.request.key == move.key]
            slots = dst.free_slots()[: len(seqs)]
            dst.reserved.update(slots)
            moved, kv_tokens = [], 0
            for seq, slot in zip(seqs, slots, strict=True):
                made = k * (rep.calls - seq.admit_call)
                rep.remove(seq)
                kv_tokens += len(seq.request.prompt) + made
                self.sampler.slot_span(rep, seq, now, made, migrated=True)
                moved.append((seq, slot, made))
            t = now + self.sampler.model.migrate_s(kv_tokens)
            self.sampler.timeline.span(
                "sampler/migrate",
                "migrate",
                now,
                t,
                round=move.key[0],
                uid=move.key[1],
                sequences=len(seqs),
                bytes=kv_tokens * self.sampler.model.kv_bytes_per_token,
                src=rep.index,
                dst=dst.index,
            )
            self.sampler.counters.migrations += 1
            self.sampler.counters.migrated_sequences += len(seqs)
            p.replica = dst.index
            dst.incoming.append((t, p, moved))
            self.sampler.schedule(t, lambda t, dst=dst: self._arrive(dst, t))

    def _arrive(self, dst: Replica, now: float) -> None:
        """Migrated sequences reached `dst`: an idle one starts, a busy one takes them at its
        next call boundary."""
        if dst.chunk is None:
            if not dst.busy:
                self.sampler.step(dst, now)
            return
        self.sampler.cut_jump(dst, now)

    def take_arrivals(self, rep: Replica, now: float) -> None:
        """Adopts the migrated sequences that have arrived (at a call boundary)."""
        k = self.sampler.model.steps_per_call
        arrived = [x for x in rep.incoming if x[0] <= now]
        rep.incoming = [x for x in rep.incoming if x[0] > now]
        for _, p, moved in arrived:
            rep.reserved.difference_update(slot for _, slot, _ in moved)
            if self.sampler.pending.get(p.request.key) is not p:  # aborted on the way
                continue
            for old, slot, made in moved:
                admit = rep.calls - made // k
                finish = admit + -(-old.length // k)
                seq = dataclasses.replace(
                    old, slot=slot, admit_call=admit, finish_call=finish, start=now, base=made
                )
                p.seqs[p.seqs.index(old)] = seq
                rep.add(seq)
            rep.fresh.add(p.request.key)
