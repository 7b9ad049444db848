"""Slot-based continuous-batching decode engine, in the shape of JetStream's Engine API.

    engine = Engine(model, EngineConfig(max_slots=32, max_length=512), mesh=sampler_mesh)
    params = engine.load_params(model)            # placed on the sampler mesh
    state = engine.init_decode_state()            # KV cache + per-slot sampling state, a pytree
    prefix = engine.prefill(params, prompt)       # one prefill per prompt ...
    state = engine.bulk_insert(prefix, state, slots, request)  # ... copied into its G slots
    state = engine.prefill_insert(params, state, [(request, slots, samples), ...])  # or batched
    state, result = engine.generate(params, state)            # k decode steps for all slots
    state = engine.free(state, slots)             # abort
    state = engine.extend(params, state, [(slot, fed, last), ...])  # multi-turn: observations in
    moved = engine.export_slots(state, slots)     # migration: running slots out ...
    state = other.import_slots(other_state, moved, free_slots)  # ... into another engine

The Engine holds the jitted programs, their shardings and the checks at its boundary; the
mechanisms live in a module each: the decode state, its layout and memory (sampler/cache.py),
prefill and insert with each slot's random stream (sampler/prefill.py), the decode step and its
attention reads (sampler/decode.py), observations appended between turns (sampler/extend.py),
export and import of running slots (sampler/slot_export.py), and with a paged cache
(`EngineConfig.page_size`) its pages: the books (sampler/paged.py) and the state kept to them,
growth and preemption by swapping (sampler/engine_paging.py).
A request's tokens depend on its seed, round, uid and sample index only, not on its slot or on the
other requests in the batch.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from rl.compiles import CompileCounter
from rl.models.sharding import Rules, axis_rules, current_rules, logical_to_spec, tree_shardings
from rl.models.transformer import Transformer, abstract_model
from rl.types import Request
from sampler import cache, decode, extend, prefill, slot_export
from sampler.cache import CacheLayout, DecodeState
from sampler.config import EngineConfig
from sampler.decode import StepResult
from sampler.engine_paging import Pager
from sampler.paged import PagePool
from sampler.prefill import Prefix
from sampler.slot_export import SlotState


class Engine:
    """The decode engine over a fixed number of slots; all device work is jitted."""

    def __init__(
        self,
        model: Transformer,
        config: EngineConfig,
        *,
        mesh: Mesh | None = None,
        rules: Rules | None = None,
    ):
        self.config = config
        # Decoding keeps no activations for a backward pass: the engine's copy of the model never
        # rematerialises (nnx.remat inside the decode scan cannot trace; the params are the same).
        self.model_config = dataclasses.replace(model.config, remat="none")
        self.mesh = mesh
        self.rules = current_rules() if rules is None else rules
        self._graphdef, abstract = nnx.split(abstract_model(self.model_config))
        self._param_shardings = None if mesh is None else tree_shardings(abstract, mesh, self.rules)
        cfg = self.model_config
        if config.max_length > cfg.max_position_embeddings:
            raise ValueError(
                f"EngineConfig.max_length ({config.max_length}) exceeds the model's "
                f"max_position_embeddings ({cfg.max_position_embeddings})."
            )
        if mesh is not None and "data" in mesh.axis_names and config.max_slots % mesh.shape["data"]:
            raise ValueError(
                f"max_slots ({config.max_slots}) must be divisible by the sampler mesh's data axis "
                f"({mesh.shape['data']})."
            )
        self.layout = CacheLayout.of(config, cfg)
        cache.check_memory(self.layout, config, cfg, mesh, self.rules)
        self._pager: Pager | None = None  # a paged cache's (init_decode_state makes it)
        shardings = None if mesh is None else self.layout.shardings(mesh, self.rules)
        paged = mesh is not None and config.page_size
        self._table_sharding = shardings.cache.table if paged else None
        out = {} if mesh is None else dict(out_shardings=shardings)
        gen_out = {} if mesh is None else dict(out_shardings=(shardings, None))
        self._compiles = CompileCounter()
        jit = self._compiles.jit
        self._init = jit("init", self.layout.init, **out)
        self._prefill = jit("prefill", self._prefill_impl)
        self._insert = jit("insert", prefill.insert, donate_argnums=(1,), **out)
        self._generate = jit(
            "generate", self._generate_impl, static_argnums=(2,), donate_argnums=(1,), **gen_out
        )
        self._free = jit("free", cache.free, donate_argnums=(0,), **out)
        # A chunk's keys/values (C, T, K, H) per layer, heads split as the cache's are.
        self._chunk_kv = None
        if mesh is not None:
            names = (None, None, "kv_heads", None)
            shape = (prefill.PREFILL_CHUNK, config.max_length, cfg.n_kv_heads, cfg.head_dim)
            spec = logical_to_spec(names, mesh, self.rules, shape=shape)
            self._chunk_kv = NamedSharding(mesh, spec)
        chunk_out = {} if mesh is None else dict(out_shardings=self._chunk_kv)
        self._prefill_chunk = jit("prefill_chunk", self._prefill_chunk_impl, **chunk_out)
        self._insert_chunk = jit("insert_chunk", prefill.insert_rows, donate_argnums=(0,), **out)
        self._extend = jit("extend", self._extend_impl, donate_argnums=(1,), **out)
        self._export = jit("export", slot_export.export_rows, static_argnums=(2,))
        self._import = jit("import", slot_export.import_rows, donate_argnums=(0,), **out)

    # ------------------------------------------------------------------------------ properties

    @property
    def max_concurrent_decodes(self) -> int:
        return self.config.max_slots

    @property
    def max_prefill_length(self) -> int:
        return self.config.max_prefill_length

    @property
    def cache_bytes_per_slot(self) -> int:
        return self.layout.bytes_per_slot

    @property
    def pool(self) -> PagePool | None:
        """A paged cache's books (sampler/paged.py); None: a dense cache."""
        return None if self._pager is None else self._pager.pool

    @property
    def compiles(self) -> CompileCounter:
        """The programs its jitted entry points compiled: counts, seconds, those after start."""
        return self._compiles

    def compile_counts(self) -> dict[str, int]:
        """How many programs each jitted entry point has compiled (prefill_chunk: one per bucket)."""
        return self._compiles.counts()

    # ---------------------------------------------------------------------------- compile budget

    def precompile(
        self,
        params_like: Any,
        *,
        recompute: bool = False,
        migrate_rows: int = 0,
        multi_turn: bool = False,
    ) -> None:
        """Compiles, now, every program a run calls on this engine (rl/compiles.py), for
        parameters shaped like `params_like` (arrays or ShapeDtypeStructs: what a publish hands
        the engine, in the sampler's dtype): the empty state, a chunk's prefill for every prompt
        bucket and its insert for every bucket x slot rung (`recompute`: also re-prefill's
        max_length bucket), generate for every count of live attention blocks, free, and
        (`migrate_rows` > 0: a migration moves up to that many slots at once) export and import
        of every row count x length (a paged pool that can run short, `EngineConfig.swaps`: of one
        row, to swap); `multi_turn`: extend for every prompt bucket.

        The JetStream-shaped `prefill` and `bulk_insert` are not compiled: a run does not call
        them.
        """
        c = self.config
        host = lambda x: self._abstract(x, None)  # arrays the host builds each call
        state = jax.eval_shape(self.layout.init)
        if self.mesh is None:
            params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params_like)
        else:
            params = jax.tree.map(self._abstract, params_like, self._param_shardings)
            state = jax.tree.map(
                self._abstract, state, self.layout.shardings(self.mesh, self.rules)
            )
        with self._context():
            self._init.precompile()
            buckets = c.reprefill_buckets() if recompute else c.buckets()
            for bucket in buckets:
                for n in c.slot_rungs():
                    tokens, *arrays = map(host, prefill.abstract_chunk(bucket, n, c))
                    self._prefill_chunk.precompile(params, tokens)
                    kv = jax.tree.map(
                        lambda x: self._abstract(x, self._chunk_kv),
                        self._prefill_chunk.eval_shape(params, tokens),
                    )
                    self._insert_chunk.precompile(state, kv, *arrays)
            rungs = decode.block_rungs(block=c.decode_block, cache_length=self.layout.length)
            for blocks in rungs:
                self._generate.precompile(params, state, blocks)
            self._free.precompile(state, host(jax.ShapeDtypeStruct((c.max_slots,), bool)))
            for bucket in c.buckets() if multi_turn else ():
                self._extend.precompile(params, state, *map(host, extend.abstract(bucket)))
            if migrate_rows or c.swaps:  # a pool that can run short swaps one slot at a time
                rows, lengths = slot_export.rungs(self.layout, max(migrate_rows, 1))
                for n in rows:
                    slots = host(jax.ShapeDtypeStruct((n,), np.int32))
                    for length in lengths:
                        self._export.precompile(state, slots, length)
                        moved = jax.tree.map(host, self._export.eval_shape(state, slots, length))
                        self._import.precompile(state, moved, slots)

    def _abstract(self, x: Any, sharding: Any) -> jax.ShapeDtypeStruct:
        """`x`'s shape and dtype with `sharding`; None: replicated on the mesh (host arrays)."""
        if sharding is None and self.mesh is not None:
            sharding = NamedSharding(self.mesh, jax.sharding.PartitionSpec())
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    # ----------------------------------------------------------------------------------- params

    def load_params(self, model: Transformer) -> Any:
        """The model's parameters as an nnx State, placed on the sampler mesh (a copy)."""
        state = nnx.state(model)
        if self.mesh is None:
            return jax.tree.map(jnp.asarray, state)
        return jax.device_put(state, self._param_shardings)

    def place_params(self, params: Any) -> Any:
        """`params` (published for any mesh) on this engine's devices, with its shardings."""
        if self.mesh is None:
            return params
        return jax.device_put(params, self._param_shardings)

    def _model(self, params: Any) -> Transformer:
        return nnx.merge(self._graphdef, params)

    def _context(self) -> Any:
        """The mesh and sharding rules the programs trace under (none without a mesh)."""
        if self.mesh is None:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        stack.enter_context(jax.set_mesh(self.mesh))
        stack.enter_context(axis_rules(self.rules))
        return stack

    def _call(self, fn: Any, *args: Any) -> Any:
        with self._context():
            return fn(*args)

    # --------------------------------------------------------------------- jitted with the model

    def _prefill_impl(self, params: Any, tokens_T: jax.Array) -> tuple[tuple, tuple]:
        return prefill.prefill_prompt(self._model(params), tokens_T, self.layout.dtype)

    def _prefill_chunk_impl(self, params: Any, tokens_CxT: jax.Array) -> tuple[tuple, tuple]:
        return prefill.prefill_rows(self._model(params), tokens_CxT, self.layout.dtype)

    def _extend_impl(self, params: Any, state: DecodeState, *arrays: jax.Array) -> DecodeState:
        return extend.extend_rows(self._model(params), state, *arrays)

    def _generate_impl(
        self, params: Any, state: DecodeState, blocks: int
    ) -> tuple[DecodeState, StepResult]:
        c = self.config
        return decode.generate(
            self._model(params),
            state,
            blocks=blocks,
            block=c.decode_block,
            steps=c.steps_per_call,
            kernel=c.attention_kernel,
        )

    # ------------------------------------------------------------------------- prefill, insert

    def fork(self) -> Engine:
        """This engine's devices and compiled programs, for a decode state of its own next to a
        running one (held-out evaluation while a rollout runs ahead on this engine): a paged
        engine's page pool belongs to the one decode state it serves, so a fork keeps its own
        books instead of emptying the running state's. Nothing compiles again."""
        twin = copy.copy(self)
        twin._pager = None
        return twin

    def init_decode_state(self) -> DecodeState:
        """An empty decode state. A paged engine serves one decode state at a time: this also
        empties its page pool."""
        c = self.config
        if c.page_size:
            width = self.layout.length // c.page_size
            pool = PagePool(pages=c.pool_pages, page=c.page_size, slots=c.max_slots, width=width)
            self._pager = Pager(
                pool,
                config=c,
                layout=self.layout,
                table_sharding=self._table_sharding,
                export=self.export_slots,
                deactivate=self._deactivate,
                import_rows=self._import_rows,
            )
        return self._call(self._init)

    def validate(self, request: Request) -> None:
        """Raises a clear error if `request` can never run on this engine."""
        c = self.config
        c.check_request(request, self.model_config.vocab_size)
        if c.page_size:
            pages = PagePool.group_cost(len(request.prompt), request.group_size, c.page_size)
            if pages > c.pool_pages:
                raise ValueError(
                    f"Request uid={request.uid}: its {request.group_size} samples of a "
                    f"{len(request.prompt)}-token prompt start on {pages} KV pages; the pool has "
                    f"{c.pool_pages}. Raise EngineConfig.kv_pages."
                )

    def prefill(self, params: Any, tokens: tuple[int, ...] | list[int]) -> Prefix:
        """Computes the KV of one prompt, padded to its length bucket (one compile per bucket)."""
        n = len(tokens)
        if n < 1:
            raise ValueError("prefill needs a prompt of at least one token.")
        padded = prefill.padded(tokens, self.config.bucket(n))
        k, v = self._call(self._prefill, params, jnp.asarray(padded))
        return Prefix(k=k, v=v, length=n, last_token=int(tokens[-1]))

    def bulk_insert(
        self,
        prefix: Prefix,
        state: DecodeState,
        slots: list[int] | tuple[int, ...],
        request: Request,
        samples: list[int] | tuple[int, ...] | None = None,
    ) -> DecodeState:
        """Copies one prompt's prefill into slots; sample samples[i] goes to slots[i].

        `samples` (default: all G, 0..G-1) are the request's sample indices to start: per-sample
        admission inserts one at a time. A sample's random stream depends on its index, not on
        its slot, so its tokens are the same either way.
        """
        samples = self._check_insert(slots, request, samples)
        if len(request.prompt) != prefix.length:
            raise ValueError(
                f"bulk_insert: the prefix holds {prefix.length} tokens but request "
                f"uid={request.uid} has a prompt of {len(request.prompt)}."
            )
        return self._put(prefix, state, slots, samples, request, request.params.max_new_tokens)

    def prefill_insert(
        self,
        params: Any,
        state: DecodeState,
        items: Sequence[tuple[Request, Sequence[int], Sequence[int] | None]],
    ) -> DecodeState:
        """Prefills the prompts of `items` and inserts them: one call per PREFILL_CHUNK prompts
        of a prompt-length bucket (sampler/prefill.py `pack_chunk`: shapes compiled ahead).

        Args:
          items: (request, slots, samples): sample samples[i] of the request starts in slots[i]
            (samples None: all G, 0..G-1), as in `bulk_insert`. Slots must be distinct.

        Returns:
          The decode state with every item inserted. Tokens are the same as with `prefill` and
          `bulk_insert` per request: a sample's random stream depends on its request and index.
        """
        checked = [(r, tuple(s), self._check_insert(s, r, i)) for r, s, i in items]
        used = [x for _, s, _ in checked for x in s]
        if len(set(used)) != len(used):
            raise ValueError(f"prefill_insert: slots must be distinct over items; got {used}.")
        state = self._start(state, [(s, len(r.prompt)) for r, s, _ in checked])
        return self._insert_chunks(params, state, checked, self.config.bucket)

    def _insert_chunks(
        self,
        params: Any,
        state: DecodeState,
        items: Sequence[prefill.Item],
        bucket: Callable[[int], int],
    ) -> DecodeState:
        """Prefills and inserts `items`: one call per PREFILL_CHUNK prompts of a bucket."""
        for length, group in prefill.by_bucket(items, bucket):
            for chunk in prefill.chunks(group):
                # host arrays go in as numpy: jnp.asarray would compile an eager op per shape
                tokens, *arrays = prefill.pack_chunk(chunk, length, self.config)
                kv = self._call(self._prefill_chunk, params, tokens)
                state = self._call(self._insert_chunk, state, kv, *arrays)
        return state

    def reprefill(
        self,
        params: Any,
        state: DecodeState,
        running: Sequence[tuple[int, Request, int, Sequence[int]]],
    ) -> DecodeState:
        """Recomputes running samples' KV cache with `params` (AReaL interruptible generation).

        Args:
          running: (slot, request, sample, generated): the prompt and the `generated` tokens so
            far are prefilled again into `slot`, which then continues as if it had decoded them
            with `params`: same random stream (the sample's key), same end (prompt length - 1 +
            max_new_tokens). Batched as `prefill_insert` is, a resumed sample being a request
            whose prompt is its prompt and tokens so far; those longer than max_prefill_length
            are padded to max_length (`EngineConfig.reprefill_buckets`).
        """
        items = []
        for slot, request, sample, generated in running:
            left = request.params.max_new_tokens - len(generated)
            if left < 1:
                raise ValueError(
                    f"reprefill: request uid={request.uid} sample {sample} has {len(generated)} "
                    f"tokens of max_new_tokens={request.params.max_new_tokens}; expected fewer "
                    "(it is done)."
                )
            if not 0 <= slot < self.config.max_slots:
                raise ValueError(
                    f"reprefill: slot must be in [0, {self.config.max_slots}); received {slot}."
                )
            self.validate(request)
            resumed = dataclasses.replace(
                request,
                prompt=(*request.prompt, *generated),
                params=dataclasses.replace(request.params, max_new_tokens=left),
            )
            items.append((resumed, (slot,), (sample,)))
        slots = [slot for slot, *_ in running]
        if len(set(slots)) != len(slots):
            raise ValueError(f"reprefill: slots must be distinct; received {slots}.")
        starts = [(s, len(r.prompt)) for r, s, _ in items]
        state = self._start(state, starts, keep_order=True)
        return self._insert_chunks(params, state, items, self.config.reprefill_bucket)

    def _check_insert(
        self, slots: Sequence[int], request: Request, samples: Sequence[int] | None
    ) -> tuple[int, ...]:
        return prefill.check_insert(
            self.config, self.model_config.vocab_size, slots, request, samples
        )

    def _put(
        self,
        prefix: Prefix,
        state: DecodeState,
        slots: list[int] | tuple[int, ...],
        samples: tuple[int, ...] | list[int],
        request: Request,
        max_new: int,
    ) -> DecodeState:
        """Inserts `prefix` for samples[i] into slots[i]; `max_new` tokens may follow it."""
        state = self._start(state, [(tuple(slots), prefix.length)])
        return self._call(
            self._insert,
            (prefix.k, prefix.v),
            state,
            jnp.asarray(slots, jnp.int32),
            jnp.asarray(samples, jnp.int32),
            *map(jnp.asarray, prefill.insert_args(prefix, request, max_new, self.config)),
        )

    # ------------------------------------------------------------------------- generate, free

    def live_blocks(self, state: DecodeState) -> int:
        """Attention blocks this generate call reads (0: the whole cache; sampler/decode.py).
        With attention blocks or pages it reads three (B,) arrays to the host once per call."""
        if not self.config.decode_block:
            return 0  # the whole cache: no host read
        pos, active, last = jax.device_get((state.positions, state.active, state.last_position))
        return decode.live_blocks(
            pos,
            active,
            last,
            steps=self.config.steps_per_call,
            block=self.config.decode_block,
            cache_length=self.layout.length,
        )

    def generate(self, params: Any, state: DecodeState) -> tuple[DecodeState, StepResult]:
        """Runs `steps_per_call` decode steps for every slot; inactive slots produce nothing. A
        paged engine first gives every running slot the pages this call writes, swapping the
        youngest sequences out when the pool runs short and back in when they fit
        (sampler/paged.py)."""
        if self._pager is None:
            blocks = self.live_blocks(state)
        else:
            state, blocks = self._pager.before_generate(state)
        state, result = self._call(self._generate, params, state, blocks)
        if self._pager is not None or self.config.decode_block:
            for x in (state.positions, state.active, state.last_position):
                x.copy_to_host_async()  # the next call reads them: copied while the device runs
        return state, result

    def free(self, state: DecodeState, slots: list[int] | tuple[int, ...]) -> DecodeState:
        """Deactivates slots (abort); they can be inserted into again at once (a paged
        engine's slots let go of their pages)."""
        self.release(slots)
        return self._deactivate(state, slots)

    def release(self, slots: Sequence[int]) -> None:
        """Slots whose sequences ended on the device (finished: inactive, free in the caller's
        books) let go of their KV pages; no device work (a dense engine: nothing to do)."""
        if self.pool is not None:
            for slot in slots:
                self.pool.release(int(slot))

    def _deactivate(self, state: DecodeState, slots: Sequence[int]) -> DecodeState:
        mask = np.zeros((self.config.max_slots,), bool)
        mask[np.asarray(slots, np.int64)] = True
        return self._call(self._free, state, mask)

    def extend(self, params: Any, state: DecodeState, items: Sequence[extend.Item]) -> DecodeState:
        """Appends observations to waiting samples' KV caches (multi-turn; sampler/extend.py).

        Args:
          items: (slot, fed, last): the slot, inactive since its turn ended on the stop token it
            is to feed next, is fed `fed` (that stop token, then the observation but its last
            token) at its next positions and left active, about to feed `last`. The caller keeps
            every position within the slot's response budget.
        """
        c = self.config
        extend.check(items, c.max_slots, c.bucket)
        if self.pool is not None:
            positions = jax.device_get(state.positions)
            grow = {slot: int(positions[slot]) + len(fed) for slot, fed, _ in items}
            state = self._pager.grow(state, grow)
        for length, chunk in extend.chunks(items, c.bucket):
            arrays = extend.pack(chunk, length, c.max_slots)
            state = self._call(self._extend, params, state, *arrays)
        return state

    # --------------------------------------------------------------------------------- migration

    def export_slots(self, state: DecodeState, slots: Sequence[int]) -> SlotState:
        """Running slots' KV cache rows (up to their positions), positions, last tokens and
        sampling state, for `import_slots` on another engine (JigsawRL migration). The slots stay
        as they are here: `free` them once the state is taken.

        Args:
          state: this engine's decode state.
          slots: distinct running slots.
        """
        slots = list(slots)
        if self.pool is not None and any(s in self.pool.swapped for s in slots):
            swapped = [s for s in slots if s in self.pool.swapped]
            state = self._pager.swap_in(state, swapped, slots)
        padded, length = slot_export.export_plan(state, slots, self.layout)
        out = self._call(self._export, state, padded, length)
        return dataclasses.replace(out, count=len(slots))

    def import_slots(
        self, state: DecodeState, moved: SlotState, slots: Sequence[int]
    ) -> DecodeState:
        """Writes exported slots (another engine's `export_slots`, on any devices) into free
        `slots` here, row i into slots[i]; they continue decoding with exactly the tokens they
        would have produced there (a slot's random stream is its request's and sample's)."""
        padded = slot_export.import_plan(state, moved, list(slots), self.layout)
        if self.pool is not None:
            written = jax.device_get(moved.positions)[: moved.count] + 1
            state = self._start(
                state, [((s,), int(n)) for s, n in zip(slots, written, strict=True)]
            )
        return self._import_rows(state, moved, padded)

    def _import_rows(self, state: DecodeState, moved: SlotState, padded: np.ndarray) -> DecodeState:
        target = (
            jax.devices()[0]
            if self.mesh is None
            else NamedSharding(self.mesh, jax.sharding.PartitionSpec())
        )
        # `count` is static in SlotState: the program must not depend on it (import_plan used it).
        moved = jax.device_put(dataclasses.replace(moved, count=0), target)
        return self._call(self._import, state, moved, padded)

    # ------------------------------------------------------------------------------- paged cache

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

    def _start(
        self,
        state: DecodeState,
        starts: Sequence[tuple[Sequence[int], int]],
        *,
        keep_order: bool = False,
    ) -> DecodeState:
        """A paged engine's pages for sequences starting in slots (Pager.start); dense: as is."""
        if self._pager is None:
            return state
        return self._pager.start(state, starts, keep_order=keep_order)
