"""A sampler replica's paged KV cache on the simulator's clock (rl/sim/sampler.py drives it).

What a paged engine does (vLLM's block manager, sampler/paged.py), as bookkeeping over a Replica's
sequences. The pool holds StageModel.kv_pages pages of StageModel.page_size positions. A group's
prompt pages are held once per group while any of its samples runs on the replica; a sample holds
the pages of the response positions written by the end of the call it runs, so at call c a sample
admitted at call a (k steps per call) of `length` tokens needs ceil(min(k (c - a + 1), length) /
page) pages besides its prompt's. At each of a replica's call boundaries, in this order:

  1. grow: while the running sequences need more pages for the next call than the pool holds, the
     youngest (latest admitted) is preempted: swapped out to host, its slot and pages freed (its
     group's prompt pages too once no sample of it runs here), at StageModel.swap_s(its pages);
  2. resume: if nothing was preempted, the swapped sequences come back oldest first while a slot
     and their pages (the next call's, plus their prompt's if their group holds none here) are
     free, each at swap_s of the pages it brings back; the first that does not fit stops it;
  3. admit: only while nothing is swapped, a new group when its prompt pages plus one first-call
     page per sample fit. The admission policy is offered the samples that fit beside the largest
     prompt submitted so far (it cannot show its head first): a bound, by at most that prompt's
     pages (25 of ~37,000 on the H100 preset).

Nothing is dropped: a preempted sequence keeps its tokens and continues from them. The oldest
running sequence is never preempted while another runs, so every request finishes. Between two
boundaries the running set is fixed and its pages only grow, so the first call that would overflow
the pool is found by bisection and the replica's jump ends there (`overflow_call`).

Swaps add to the replica's time (the engine copies between decode steps) and are recorded as spans
"swap_out" / "swap_in" on the "sampler/swap" lane (args round, uid, sample, pages, replica). A
StageModel with kv_pages = 0 has no pool: slots alone limit a replica (a dense cache, whose
slots already reserve max_length each; rl/sim/presets.py sizes them).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from rl.sim.replica import Replica, Seq, pages
from rl.types import Request


class SimPaging:
    """The paged KV cache of every replica of a SimSampler (`sampler`); off when kv_pages = 0."""

    def __init__(self, sampler: Any):
        self.sampler = sampler
        self.model = sampler.model
        self.pool = self.model.kv_pages
        self.page = self.model.page_size if self.pool else 0
        self.k = self.model.steps_per_call
        self.max_prompt_pages = 0  # the largest prompt submitted so far, in pages

    @property
    def on(self) -> bool:
        return self.pool > 0

    # ---------------------------------------------------------------------------- page counts

    def need(self, seq: Seq, call: int) -> int:
        """Response pages `seq` holds once call `call` has run (its prompt's not counted)."""
        return pages(min(self.k * (call - seq.admit_call + 1), seq.length), self.page)

    def demand(self, rep: Replica, call: int) -> int:
        """Pages the replica's running sequences hold once call `call` has run."""
        return rep.prompt_pages + sum(self.need(s, call) for s in rep.seqs if s is not None)

    def _bound(self, rep: Replica, call: int, upper: bool) -> float:
        """An O(1) bound of demand(rep, call), for a call before every running sequence's last:
        ceil(x / page) <= x / page + 1, and a sample's tokens are within k - 1 of k (c - a + 1)."""
        tokens = self.k * (rep.active * (call + 1) - rep.admit_sum)
        if upper:
            return rep.prompt_pages + tokens / self.page + rep.active
        return rep.prompt_pages + (tokens - rep.active * (self.k - 1)) / self.page

    def _first(self, f: Any, lo: int, hi: int) -> int:
        """The first c in [lo, hi) with f(c) > the pool (f monotone in c), else hi."""
        while lo < hi:
            mid = (lo + hi) // 2
            if f(mid) > self.pool:
                hi = mid
            else:
                lo = mid + 1
        return lo

    def overflow_call(self, rep: Replica, end: int) -> int:
        """The first call in (rep.calls, end) whose pages exceed the pool, else `end` (no running
        sequence ends before `end`; the pages of call rep.calls fit)."""
        if not self.on or end <= rep.calls + 1:
            return end
        lo = self._first(lambda c: self._bound(rep, c, True), rep.calls + 1, end)
        if lo == end:
            return end
        hi = self._first(lambda c: self._bound(rep, c, False), lo, end)
        return self._first(lambda c: self.demand(rep, c), lo, min(end, hi + 1))

    def room(self, rep: Replica) -> int:
        """Samples of a new group the replica may admit now (its free slots, bounded by pages)."""
        free = len(rep.free_slots())
        if not self.on or not free:
            return free
        if rep.swapped:
            return 0
        left = self.pool - self.demand(rep, rep.calls) - self.max_prompt_pages
        return max(0, min(free, left // pages(self.k, self.page)))

    def free(self, rep: Replica) -> int:
        """Pages a migration may fill on `rep` now (rl/sim/migration.py): the pool less the next
        call's pages of what runs there, of what is swapped out (it comes back first) and of what
        is on its way there; 0 when not paged."""
        if not self.on:
            return 0
        owed, groups = 0, set(rep.groups)
        waiting = list(rep.swapped.values())
        waiting += [(s, made) for _, _, moved in rep.incoming for s, _, made in moved]
        for seq, made in waiting:
            owed += pages(min(made + self.k, seq.length), self.page)
            if seq.request.key not in groups:
                groups.add(seq.request.key)
                owed += pages(len(seq.request.prompt), self.page)
        return max(0, self.pool - self.demand(rep, rep.calls) - owed)

    def kv_pages(self, seqs: list[Seq], calls: int) -> int:
        """Pages a group's running `seqs` (on a replica at call `calls`) hold: their prompt's once
        and each one's tokens so far; 0 when not paged."""
        made = sum(pages(min(s.length, self.k * (calls - s.admit_call)), self.page) for s in seqs)
        return made + pages(len(seqs[0].request.prompt), self.page) if self.on else 0

    def check(self, request: Request) -> None:
        """A request the pool could never run: its group's first call or one sample at its cap."""
        if not self.on:
            return
        prompt = pages(len(request.prompt), self.page)
        self.max_prompt_pages = max(self.max_prompt_pages, prompt)
        cap = min(request.params.max_new_tokens, self.sampler.workload.cfg.max_new_tokens)
        first = prompt + request.group_size * pages(self.k, self.page)
        alone = prompt + pages(cap, self.page)
        if max(first, alone) > self.pool:
            raise ValueError(
                f"Request (round, uid)={request.key} needs {first} KV pages to start its group and "
                f"{alone} for one sample at its cap of {cap} tokens; a replica's pool holds "
                f"{self.pool} pages of {self.page}, so it could never run."
            )

    # ----------------------------------------------------------------------- the boundary rules

    def boundary(self, rep: Replica, now: float) -> float:
        """Rules 1 and 2 at a call boundary; returns when the swaps end."""
        if not self.on:
            return now
        preempted = self.sampler.counters.preemptions
        t = self.fit(rep, now)
        return t if self.sampler.counters.preemptions > preempted else self.resume(rep, t)

    def fit(self, rep: Replica, now: float) -> float:
        """Rule 1: preempts the youngest running sequences until the next call's pages fit."""
        t = now
        while self.on and rep.active > 1 and self.demand(rep, rep.calls) > self.pool:
            seq = max((s for s in rep.seqs if s is not None), key=lambda s: (s.order, s.sample))
            made = min(seq.length, self.k * (rep.calls - seq.admit_call))
            rep.remove(seq)
            rep.swapped[seq.serial] = (seq, made)
            self.sampler.slot_span(rep, seq, now, made, preempted=True)
            t = self._swap(rep, seq, self._pages(rep, seq, made), t, "swap_out")
            self.sampler.counters.preemptions += 1
        return t

    def resume(self, rep: Replica, now: float) -> float:
        """Rule 2: the swapped sequences, oldest first, while a slot and their pages are free."""
        t = now
        for seq, made in sorted(rep.swapped.values(), key=lambda v: (v[0].order, v[0].sample)):
            slots = rep.free_slots()
            bring = self._pages(rep, seq, made)  # its pages (and its prompt's) back from host
            grow = pages(min(self.k * (made // self.k + 1), seq.length), self.page)
            extra = bring - pages(made, self.page) + grow  # its prompt's and the next call's
            if not slots or self.demand(rep, rep.calls) + extra > self.pool:
                break
            del rep.swapped[seq.serial]
            t = self._swap(rep, seq, bring, t, "swap_in")
            admit = rep.calls - made // self.k
            back = dataclasses.replace(
                seq,
                slot=slots[0],
                admit_call=admit,
                start=t,
                base=made,
                finish_call=admit + -(-seq.length // self.k),
            )
            p = self.sampler.pending[seq.request.key]
            p.seqs[p.seqs.index(seq)] = back
            rep.add(back)
        return t

    def _pages(self, rep: Replica, seq: Seq, made: int) -> int:
        """The pages a swap of `seq` with `made` tokens moves: its own, and its prompt's when no
        other sample of its group runs on the replica."""
        alone = seq.request.key not in rep.groups
        return pages(made, self.page) + alone * pages(len(seq.request.prompt), self.page)

    def _swap(self, rep: Replica, seq: Seq, n: int, now: float, name: str) -> float:
        t = now + self.model.swap_s(n)
        r = seq.request
        self.sampler.timeline.span(
            "sampler/swap",
            name,
            now,
            t,
            round=r.round,
            uid=r.uid,
            sample=seq.sample,
            pages=n,
            replica=rep.index,
        )
        self.sampler.counters.swap_s += t - now
        self.sampler.counters.swap_pages += n
        return t

    def drop(self, rep: Replica, key: tuple[int, int]) -> list[tuple[Seq, int]]:
        """Forgets the swapped sequences of request `key` (aborted, cut, or to be re-prefilled
        elsewhere); returns them with the tokens each had made."""
        out = [v for v in rep.swapped.values() if v[0].request.key == key]
        for seq, _ in out:
            del rep.swapped[seq.serial]
        return out
