"""The Engine's paged-cache side (a mixin of sampler/engine.py's Engine): pages for every insert,
growth before each generate call, preemption by swapping, and what admission and migration read.

The books are sampler/paged.py's `PagePool` (`Engine.pool`, None for a dense cache); this moves
the device state to match them: the block table copied to the device when it changed, the youngest
running sequences swapped out (`export_slots` to the host, pages released) when the pool runs
short, and swapped back in (`import_slots`' device half) oldest first once they fit. Everything
here runs on the thread that owns the decode state.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from rl.types import Request
from sampler import decode, slot_export
from sampler.cache import CacheLayout, DecodeState
from sampler.config import EngineConfig
from sampler.paged import PagePool, Swapped


class PagedSlots:
    """The Engine's methods for a paged cache (see the module docstring)."""

    config: EngineConfig
    layout: CacheLayout
    pool: PagePool | None
    _table_sharding: Any

    def admission_budget(self) -> int | None:
        """KV pages new sequences may take now (sampler/paged.py); None: a dense cache, no limit
        beyond its slots."""
        return None if self.pool is None else self.pool.admission_budget()

    def start_cost(self, request: Request, samples: int) -> int:
        """KV pages `samples` samples of `request` take when started together (0: dense)."""
        return 0 if self.pool is None else self.pool.start_cost(len(request.prompt), samples)

    def kv_usage(self, state: DecodeState) -> dict[str, int]:
        """KV bytes held (dense: the whole cache, reserved; paged: the pages in use) and the
        positions running sequences have written (`live_tokens`)."""
        active, pos = jax.device_get((state.active, state.positions))
        live = int(np.sum(np.where(active, pos + 1, 0)))
        held = self.layout.bytes
        if self.pool is not None:
            held = self.pool.used * self.pool.page * self.layout.bytes_per_token
        return dict(bytes=held, live_tokens=live)

    def _synced(self, state: DecodeState) -> DecodeState:
        """`state` with the pool's block table, if it changed since the device last got it."""
        if not self.pool.dirty:
            return state
        self.pool.dirty = False
        table = self.pool.table.copy()
        table = (
            table if self._table_sharding is None else jax.device_put(table, self._table_sharding)
        )
        return dataclasses.replace(state, cache=dataclasses.replace(state.cache, table=table))

    def _start(
        self,
        state: DecodeState,
        starts: Sequence[tuple[Sequence[int], int]],
        *,
        keep_order: bool = False,
    ) -> DecodeState:
        """Slots start sequences of the given lengths (each group's slots sharing its prompt's
        pages), making room by swapping out the youngest running sequences; a slot's old pages
        are let go first. `keep_order`: a sequence re-prefilled in place keeps its age."""
        pool = self.pool
        if pool is None:
            return state
        orders = {}
        for slots, _ in starts:
            for s in slots:
                orders[s] = pool.order.get(s) if keep_order else None
                pool.release(s)
        need = sum(pool.start_cost(n, len(slots)) for slots, n in starts)
        protect = {s for slots, _ in starts for s in slots}
        state = self._make_room(state, need, protect)
        for slots, n in starts:
            order = orders[slots[0]] if len(slots) == 1 else None
            pool.start(list(slots), n, order=order)
        return self._synced(state)

    def _grow(self, state: DecodeState, want: dict[int, int]) -> DecodeState:
        """Slots hold the pages of positions 0..want[slot]-1, swapping out the youngest other
        running sequences to make room."""
        pool = self.pool
        need = sum(pool.need(s, n) for s, n in want.items())
        state = self._make_room(state, need, set(want))
        for s, n in want.items():
            pool.grow(s, n)
        return self._synced(state)

    def _make_room(self, state: DecodeState, need: int, protect: set[int]) -> DecodeState:
        """Swaps out the youngest running sequences not in `protect` until `need` pages are
        free."""
        pool = self.pool
        if need <= pool.free:
            return state
        active, pos = jax.device_get((state.active, state.positions))
        running = {s for s in pool.order if active[s] and s not in protect}
        while need > pool.free:
            if not running:
                raise RuntimeError(
                    f"The KV page pool ({pool.pages} pages of {pool.page} positions) cannot hold "
                    f"{need} more pages with every other sequence swapped out; raise "
                    "EngineConfig.kv_pages."
                )
            victim = pool.youngest(running)
            running.remove(victim)
            state = self._swap_out(state, victim, int(pos[victim]) + 1)
        return state

    def _swap_out(self, state: DecodeState, slot: int, written: int) -> DecodeState:
        """Preempts `slot`: its state to the host, its pages released (sampler/paged.py)."""
        pool = self.pool
        state = self._synced(state)  # the table the export reads, kept in the state that goes on
        saved = jax.device_put(self.export_slots(state, [slot]), jax.devices("cpu")[0])
        order = pool.order[slot]
        pool.release(slot)
        pool.swapped[slot] = Swapped(order=order, state=saved, written=written)
        pool.preemptions += 1
        return self._deactivate(state, [slot])

    def _swap_in(
        self, state: DecodeState, slots: Sequence[int], protect: Sequence[int]
    ) -> DecodeState:
        """Brings swapped-out `slots` back, exactly as they left."""
        pool = self.pool
        for slot in slots:
            saved = pool.swapped.pop(slot)
            need = pool.pages_for(saved.written)
            state = self._make_room(state, need, set(protect))
            pool.start([slot], saved.written, order=saved.order)
            padded = slot_export.import_plan(state, saved.state, [slot], self.layout)
            state = self._import_rows(self._synced(state), saved.state, padded)
        return state

    def _page_for_steps(self, state: DecodeState) -> tuple[DecodeState, int]:
        """Before a generate call: swapped-out sequences back while they fit (oldest first), then
        every running slot given the pages of the positions the call writes. Returns the state
        and the attention blocks the call reads (`live_blocks`)."""
        pool, c = self.pool, self.config
        read = lambda s: map(np.array, jax.device_get((s.positions, s.active, s.last_position)))
        pos, active, last = read(state)
        back = pool.resumable(sum(bool(active[s]) for s in pool.order))
        if back:
            state = self._swap_in(state, back, back)
            pos, active, last = read(state)
        want = {s: int(min(pos[s] + c.steps_per_call, last[s])) for s in pool.order if active[s]}
        need = sum(pool.need(s, n) for s, n in want.items())
        while need > pool.free:
            victim = pool.youngest(set(want))
            state = self._swap_out(state, victim, int(pos[victim]) + 1)
            active[victim] = False
            del want[victim]
            need = sum(pool.need(s, n) for s, n in want.items())
        for s, n in want.items():
            pool.grow(s, n)
        blocks = decode.live_blocks(
            pos,
            active,
            last,
            steps=c.steps_per_call,
            block=c.decode_block,
            cache_length=self.layout.length,
        )
        return self._synced(state), blocks
