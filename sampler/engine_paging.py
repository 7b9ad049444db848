"""A paged engine's pager: pages for every insert, growth before each generate call, preemption by
swapping.

The books are sampler/paged.py's `PagePool` (`Engine.pool`); the Pager keeps the decode state to
them: the block table copied to the device when it changed, the youngest running sequences swapped
out (the engine's `export_slots` to the host, then their slots deactivated and pages released) when
the pool runs short, and swapped back in (the engine's import of rows) oldest first once they fit.
The engine (sampler/engine.py) makes one per decode state and hands it the three operations it
needs. Everything here runs on the thread that owns the decode state.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from sampler import decode, slot_export
from sampler.cache import CacheLayout, DecodeState
from sampler.config import EngineConfig
from sampler.paged import PagePool, Swapped


class Pager:
    """Keeps a paged engine's decode state to its PagePool (see the module docstring).

    Args:
      pool: the books.
      config, layout: the engine's.
      table_sharding: where the block table lives on the engine's mesh (None: no mesh).
      export: the engine's `export_slots(state, slots) -> SlotState`.
      deactivate: `(state, slots) -> state` with the slots inactive, pages untouched.
      import_rows: `(state, moved, padded slots) -> state`, pages already given.
    """

    def __init__(
        self,
        pool: PagePool,
        *,
        config: EngineConfig,
        layout: CacheLayout,
        table_sharding: Any,
        export: Callable[[DecodeState, Sequence[int]], Any],
        deactivate: Callable[[DecodeState, Sequence[int]], DecodeState],
        import_rows: Callable[[DecodeState, Any, np.ndarray], DecodeState],
    ):
        self.pool, self.config, self.layout = pool, config, layout
        self.table_sharding = table_sharding
        self.export, self.deactivate, self.import_rows = export, deactivate, import_rows

    def synced(self, state: DecodeState) -> DecodeState:
        """`state` with the pool's block table, if it changed since the device last got it."""
        if not self.pool.dirty:
            return state
        self.pool.dirty = False
        table = self.pool.table.copy()
        if self.table_sharding is not None:
            table = jax.device_put(table, self.table_sharding)
        return dataclasses.replace(state, cache=dataclasses.replace(state.cache, table=table))

    def start(
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
        return self.synced(state)

    def grow(self, state: DecodeState, want: dict[int, int]) -> DecodeState:
        """Slots hold the pages of positions 0..want[slot]-1, swapping out the youngest other
        running sequences to make room."""
        pool = self.pool
        need = sum(pool.need(s, n) for s, n in want.items())
        state = self._make_room(state, need, set(want))
        for s, n in want.items():
            pool.grow(s, n)
        return self.synced(state)

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
        state = self.synced(state)  # the table the export reads, kept in the state that goes on
        saved = jax.device_put(self.export(state, [slot]), jax.devices("cpu")[0])
        order = pool.order[slot]
        pool.release(slot)
        pool.swapped[slot] = Swapped(order=order, state=saved, written=written)
        pool.preemptions += 1
        return self.deactivate(state, [slot])

    def swap_in(
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
            state = self.import_rows(self.synced(state), saved.state, padded)
        return state

    def before_generate(self, state: DecodeState) -> tuple[DecodeState, int]:
        """Before a generate call: swapped-out sequences back while they fit (oldest first), then
        every running slot given the pages of the positions the call writes. Returns the state
        and the attention blocks the call reads (`live_blocks`)."""
        pool, c = self.pool, self.config
        read = lambda s: map(np.array, jax.device_get((s.positions, s.active, s.last_position)))
        pos, active, last = read(state)
        back = pool.resumable(sum(bool(active[s]) for s in pool.order))
        if back:
            state = self.swap_in(state, back, back)
            pos, active, last = read(state)
        slots = np.fromiter((s for s in pool.order if active[s]), np.int64)
        want = np.minimum(pos[slots] + c.steps_per_call, last[slots])
        need = np.maximum(0, pool.pages_for(want) - pool.held[slots])
        while need.sum() > pool.free:
            victim = pool.youngest(set(slots.tolist()))
            state = self._swap_out(state, victim, int(pos[victim]) + 1)
            active[victim] = False
            keep = slots != victim
            slots, want, need = slots[keep], want[keep], need[keep]
        for s, n in zip(slots[need > 0].tolist(), want[need > 0].tolist(), strict=True):
            pool.grow(s, n)
        blocks = decode.live_blocks(
            pos,
            active,
            last,
            steps=c.steps_per_call,
            block=c.decode_block,
            cache_length=self.layout.length,
        )
        return self.synced(state), blocks
