"""Slot-based continuous-batching decode engine, in the shape of JetStream's Engine API.

    engine = Engine(model, EngineConfig(max_slots=32, max_length=512), mesh=sampler_mesh)
    params = engine.load_params(model)            # placed on the sampler mesh
    state = engine.init_decode_state()            # KV cache + per-slot sampling state, a pytree
    prefix = engine.prefill(params, prompt)       # one prefill per prompt ...
    state = engine.bulk_insert(prefix, state, slots, request)  # ... copied into its G slots
    state = engine.prefill_insert(params, state, [(request, slots, samples), ...])  # or batched
    state, result = engine.generate(params, state)            # k decode steps for all slots
    state = engine.free(state, slots)             # abort

Cache index == token position. A request's prompt of length L is prefilled at positions 0..L-1;
insert leaves the slot about to feed prompt[L-1] at position L-1, so every response token,
the first included, is drawn by `generate` from the same code path. The token drawn after feeding
position p sits at position p+1 and uses the PRNG key
    fold_in(fold_in(fold_in(fold_in(key(seed), round), uid), sample), p + 1),
so it does not depend on the slot or on the other requests in the batch.

Decode path (issue 19): the cache is head-major, keys (slots, kv heads, head dim, positions) and
values (slots, kv heads, positions, head dim) per layer, so a decode step attends without
transposing it, as fused multiply-reduces over the whole cache (`attend_live`: fixed shapes, so a
row's floats never depend on its neighbours). With `attention_block` > 0, attention instead reads
only the first blocks of that many positions that the longest live sequence reaches (the block
count rounded up to a power of two: one compile each), block by block (`attend_blocks`); that pays
for long caches where slices are free (GPU), but on XLA:CPU every block is a copy. `prefill_insert`
prefills all prompts admitted together in one call per length bucket.

Memory: the KV cache takes 2 * n_layers * max_length * n_kv_heads * head_dim * itemsize bytes per
slot (`cache_bytes_per_slot`; max_length rounded up to whole attention blocks, if any), sharded
over `data` (slots) and `tp` (kv heads).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from rl.compiles import CompileCounter
from rl.models.config import DTYPES
from rl.models.sharding import Rules, axis_rules, current_rules, logical_to_spec, tree_shardings
from rl.models.transformer import (
    HEAD_MAJOR_K_AXES,
    HEAD_MAJOR_V_AXES,
    HeadMajorKVCache,
    Transformer,
    abstract_model,
)
from rl.types import Request
from sampler.sampling import sample_tokens

# Prompts per prefill matmul (padded with empty prompts): one fixed row count, so a prompt's
# keys/values do not depend on how many prompts were admitted with it.
_PREFILL_CHUNK = 8
# Migration exports a slot's KV rows up to a power-of-two count of this many positions.
EXPORT_BLOCK = 32


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
    max_slots: int = 64  # max_concurrent_decodes
    max_length: int = 1024  # KV positions per slot: prompt + response
    max_prefill_length: int = 512  # longest prompt
    min_prefill_bucket: int = 16  # prompts are padded to powers of two from here (few compiles)
    steps_per_call: int = 8  # decode steps fused into one generate call (host overhead / k)
    max_stop_tokens: int = 4  # stop ids per request
    cache_dtype: str = ""  # KV cache dtype; empty: the model's compute dtype
    seed: int = 0  # root of every request's random stream
    memory_budget_bytes: int = 0  # per device for params + KV cache; 0: the device's own limit
    attention_block: int = 0  # > 0: decode attention reads only the live blocks of this many
    # positions (module docstring); 0: the whole cache, faster on XLA:CPU

    def __post_init__(self):
        for name in (
            "max_slots",
            "max_length",
            "max_prefill_length",
            "min_prefill_bucket",
            "steps_per_call",
            "max_stop_tokens",
        ):
            if getattr(self, name) < 1:
                raise ValueError(
                    f"EngineConfig.{name} must be >= 1; received {getattr(self, name)}."
                )
        if self.max_prefill_length > self.max_length:
            raise ValueError(
                f"EngineConfig.max_prefill_length ({self.max_prefill_length}) exceeds max_length "
                f"({self.max_length}); a prompt must fit in the cache."
            )
        if self.attention_block < 0:
            raise ValueError(
                f"EngineConfig.attention_block must be >= 0; received {self.attention_block}."
            )
        if not 0 <= self.seed < 2**31:
            raise ValueError(f"EngineConfig.seed must be in [0, 2**31); received {self.seed}.")
        if self.cache_dtype and self.cache_dtype not in DTYPES:
            raise ValueError(
                f"EngineConfig.cache_dtype={self.cache_dtype!r}; expected one of {tuple(DTYPES)}."
            )

    def buckets(self) -> tuple[int, ...]:
        out, b = [], self.min_prefill_bucket
        while b < self.max_prefill_length:
            out.append(b)
            b *= 2
        return (*out, self.max_prefill_length)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecodeState:
    """Everything the device needs per slot. B = max_slots."""

    cache: HeadMajorKVCache
    tokens: jax.Array  # (B,) int32: the token to feed next
    positions: jax.Array  # (B,) int32: its position
    active: jax.Array  # (B,) bool: slot holds an unfinished sequence
    last_position: jax.Array  # (B,) int32: position of the final allowed response token
    keys: jax.Array  # (B,) PRNG keys of the slot's request and sample
    temperature: jax.Array  # (B,) float32
    top_k: jax.Array  # (B,) int32
    top_p: jax.Array  # (B,) float32
    stop_ids: jax.Array  # (B, max_stop_tokens) int32, -1 padded


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SlotState:
    """Running slots' state taken out of an engine (`export_slots`) for another (`import_slots`).

    Rows are padded to a power of two (the padding repeats the first slot and is dropped on
    import); `count` of them are real. Cache rows stop at `length` positions (whole attention
    blocks covering every exported slot's position).
    """

    k: tuple[jax.Array, ...]  # (N, kv heads, length, head dim) per layer
    v: tuple[jax.Array, ...]
    tokens: jax.Array  # (N,) and the other per-slot DecodeState fields, as in DecodeState
    positions: jax.Array
    active: jax.Array
    last_position: jax.Array
    keys: jax.Array
    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    stop_ids: jax.Array
    count: int = dataclasses.field(metadata=dict(static=True), default=0)

    @property
    def nbytes(self) -> int:
        """Bytes of the real rows (what a migration moves)."""
        leaves = [x for x in jax.tree.leaves(self) if hasattr(x, "dtype")]
        total = sum(
            x.size * (8 if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x.itemsize)
            for x in leaves
        )
        return total * self.count // self.tokens.shape[0]


_PER_SLOT = (
    "tokens",
    "positions",
    "active",
    "last_position",
    "keys",
    "temperature",
    "top_k",
    "top_p",
    "stop_ids",
)


@dataclasses.dataclass(frozen=True)
class Prefix:
    """One prompt's prefilled keys/values, (bucket, K, H) per layer, and its length."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    length: int
    last_token: int


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StepResult:
    """What k fused decode steps produced; arrays are (k, B)."""

    tokens: jax.Array  # sampled token
    logprobs: jax.Array  # behaviour log-prob of that token (see sampler/sampling.py)
    valid: jax.Array  # the slot was active and produced this token
    finished: jax.Array  # this token ended the sequence (stop token or length)


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
        self.cache_dtype = DTYPES[config.cache_dtype or cfg.dtype]
        block = config.attention_block
        self.cache_length = -(-config.max_length // block) * block if block else config.max_length
        self._check_memory()
        self._state_shardings = None if mesh is None else self._decode_state_shardings()
        donate = dict(donate_argnums=(1,))
        out = {} if mesh is None else dict(out_shardings=self._state_shardings)
        self._compiles = CompileCounter()
        jit = self._compiles.jit
        self._init = jit("init", self._init_impl, **out)
        self._prefill = jit("prefill", self._prefill_impl)
        self._insert = jit("insert", self._insert_impl, donate_argnums=(1,), **out)
        gen_out = {} if mesh is None else dict(out_shardings=(self._state_shardings, None))
        self._generate = jit(
            "generate", self._generate_impl, static_argnums=(2,), **donate, **gen_out
        )
        self._free = jit("free", self._free_impl, donate_argnums=(0,), **out)
        self._prefill_insert = jit("prefill_insert", self._prefill_insert_impl, **donate, **out)
        self._export = jit("export", self._export_impl, static_argnums=(2,))
        self._import = jit("import", self._import_impl, donate_argnums=(0,), **out)

    # ------------------------------------------------------------------------------ properties

    @property
    def max_concurrent_decodes(self) -> int:
        return self.config.max_slots

    @property
    def max_prefill_length(self) -> int:
        return self.config.max_prefill_length

    @property
    def cache_bytes_per_slot(self) -> int:
        c = self.model_config
        itemsize = jnp.dtype(self.cache_dtype).itemsize
        return 2 * c.n_layers * self.cache_length * c.n_kv_heads * c.head_dim * itemsize

    @property
    def compiles(self) -> CompileCounter:
        """The programs its jitted entry points compiled: counts, seconds, those after start."""
        return self._compiles

    def compile_counts(self) -> dict[str, int]:
        """How many programs each jitted entry point has compiled (prefill: one per bucket)."""
        return self._compiles.counts()

    def _check_memory(self) -> None:
        devices = self.mesh.devices.flatten() if self.mesh is not None else jax.devices()[:1]
        stats = devices[0].memory_stats() or {}
        limit = self.config.memory_budget_bytes or stats.get("bytes_limit")
        if not limit:
            return  # the CPU backend reports no limit
        shards = 1
        if self.mesh is not None:
            spec = logical_to_spec(
                self._cache_axes("v"), self.mesh, self.rules, shape=self._cache_shape("v")
            )
            for axes in spec:
                for a in (axes,) if isinstance(axes, str) else (axes or ()):
                    shards *= self.mesh.shape[a]
        need = self.config.max_slots * self.cache_bytes_per_slot // shards
        param_bytes = (
            self.model_config.num_params() * jnp.dtype(self.model_config.jnp_param_dtype).itemsize
        )
        free = limit - stats.get("bytes_in_use", 0) - param_bytes // len(devices)
        if need > free:
            raise ValueError(
                f"KV cache does not fit: {self.config.max_slots} slots x max_length "
                f"{self.config.max_length} need {need / 2**30:.2f} GiB per device "
                f"({self.cache_bytes_per_slot / 2**20:.1f} MiB per slot before sharding), but about "
                f"{free / 2**30:.2f} GiB is free after the parameters. Lower max_slots or max_length."
            )

    # ----------------------------------------------------------------------------------- params

    def load_params(self, model: Transformer) -> Any:
        """The model's parameters as an nnx State, placed on the sampler mesh (a copy)."""
        state = nnx.state(model)
        if self.mesh is None:
            return jax.tree.map(jnp.asarray, state)
        return jax.device_put(state, self._param_shardings)

    def _model(self, params: Any) -> Transformer:
        return nnx.merge(self._graphdef, params)

    def _call(self, fn: Any, *args: Any) -> Any:
        if self.mesh is None:
            return fn(*args)
        with jax.set_mesh(self.mesh), axis_rules(self.rules):
            return fn(*args)

    # ------------------------------------------------------------------------------ decode state

    def _decode_state_shardings(self) -> DecodeState:
        abstract = jax.eval_shape(self._init_impl)

        def named(x: Any, names: tuple[str | None, ...]) -> NamedSharding:
            return NamedSharding(
                self.mesh, logical_to_spec(names, self.mesh, self.rules, shape=x.shape)
            )

        cache = HeadMajorKVCache(
            k=tuple(named(x, self._cache_axes("k")) for x in abstract.cache.k),
            v=tuple(named(x, self._cache_axes("v")) for x in abstract.cache.v),
        )
        per_slot = {
            f.name: named(
                getattr(abstract, f.name),
                ("batch",) + (None,) * (getattr(abstract, f.name).ndim - 1),
            )
            for f in dataclasses.fields(DecodeState)
            if f.name != "cache"
        }
        return DecodeState(cache=cache, **per_slot)

    def _cache_axes(self, kind: str) -> tuple[str, ...]:
        """Logical axes of a key ("k") or value ("v") cache array."""
        return HEAD_MAJOR_K_AXES if kind == "k" else HEAD_MAJOR_V_AXES

    def _cache_shape(self, kind: str) -> tuple[int, ...]:
        sizes = dict(
            batch=self.config.max_slots,
            cache_length=self.cache_length,
            kv_heads=self.model_config.n_kv_heads,
            head_dim=self.model_config.head_dim,
        )
        return tuple(sizes[a] for a in self._cache_axes(kind))

    def _init_impl(self) -> DecodeState:
        b, c = self.config.max_slots, self.model_config
        zeros = lambda kind: jnp.zeros(self._cache_shape(kind), self.cache_dtype)
        return DecodeState(
            cache=HeadMajorKVCache(
                k=tuple(zeros("k") for _ in range(c.n_layers)),
                v=tuple(zeros("v") for _ in range(c.n_layers)),
            ),
            tokens=jnp.zeros((b,), jnp.int32),
            positions=jnp.zeros((b,), jnp.int32),
            active=jnp.zeros((b,), bool),
            last_position=jnp.zeros((b,), jnp.int32),
            keys=jax.random.split(jax.random.key(0), b),
            temperature=jnp.ones((b,), jnp.float32),
            top_k=jnp.zeros((b,), jnp.int32),
            top_p=jnp.ones((b,), jnp.float32),
            stop_ids=jnp.full((b, self.config.max_stop_tokens), -1, jnp.int32),
        )

    def init_decode_state(self) -> DecodeState:
        return self._call(self._init)

    # ---------------------------------------------------------------------------------- prefill

    def bucket(self, length: int) -> int:
        for b in self.config.buckets():
            if length <= b:
                return b
        raise ValueError(
            f"Prompt of {length} tokens exceeds max_prefill_length ({self.config.max_prefill_length})."
        )

    def _prefill_impl(self, params: Any, tokens_T: jax.Array) -> tuple[tuple, tuple]:
        k, v = self._prefill_rows(self._model(params), tokens_T[None])
        return tuple(x[0] for x in k), tuple(x[0] for x in v)

    def prefill(self, params: Any, tokens: tuple[int, ...] | list[int]) -> Prefix:
        """Computes the KV of one prompt, padded to its length bucket (one compile per bucket)."""
        n = len(tokens)
        if n < 1:
            raise ValueError("prefill needs a prompt of at least one token.")
        bucket = self.bucket(n)
        padded = np.zeros((bucket,), np.int32)
        padded[:n] = tokens
        k, v = self._call(self._prefill, params, jnp.asarray(padded))
        return Prefix(k=k, v=v, length=n, last_token=int(tokens[-1]))

    # ----------------------------------------------------------------------------------- insert

    def _insert_impl(
        self,
        kv: tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]],
        state: DecodeState,
        slots_G: jax.Array,
        samples_G: jax.Array,
        ids: jax.Array,
        sampling: jax.Array,
        stop_ids: jax.Array,
    ) -> DecodeState:
        """Everything that varies per request is traced: one compile per (bucket, slot count)."""
        g = slots_G.shape[0]
        prefix_k, prefix_v = kv
        rows = lambda kv: tuple(jnp.broadcast_to(x[None], (g, *x.shape)) for x in kv)
        cache = state.cache.put(slots_G, rows(prefix_k), rows(prefix_v))
        seed, rnd, uid, max_new, length, last_token = (ids[i] for i in range(6))
        base = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), rnd), uid)
        keys_G = jax.vmap(lambda s: jax.random.fold_in(base, s))(samples_G)
        fill = lambda arr, value: arr.at[slots_G].set(value)
        return DecodeState(
            cache=cache,
            tokens=fill(state.tokens, last_token),
            positions=fill(state.positions, length - 1),
            active=fill(state.active, True),
            last_position=fill(state.last_position, length - 1 + max_new),
            keys=state.keys.at[slots_G].set(keys_G),
            temperature=fill(state.temperature, sampling[0]),
            top_k=fill(state.top_k, sampling[1].astype(jnp.int32)),
            top_p=fill(state.top_p, sampling[2]),
            stop_ids=state.stop_ids.at[slots_G].set(
                jnp.broadcast_to(stop_ids[None], (g, stop_ids.shape[0]))
            ),
        )

    def validate(self, request: Request) -> None:
        """Raises a clear error if `request` can never run on this engine."""
        p, c, n = request.params, self.config, len(request.prompt)
        if n > c.max_prefill_length:
            raise ValueError(
                f"Request uid={request.uid}: prompt of {n} tokens exceeds max_prefill_length "
                f"({c.max_prefill_length})."
            )
        if n + p.max_new_tokens > c.max_length:
            raise ValueError(
                f"Request uid={request.uid}: prompt ({n}) + max_new_tokens ({p.max_new_tokens}) "
                f"exceeds the engine's max_length ({c.max_length})."
            )
        if request.group_size > c.max_slots:
            raise ValueError(
                f"Request uid={request.uid}: group_size {request.group_size} exceeds max_slots "
                f"({c.max_slots}); a group is admitted whole."
            )
        if len(p.stop_token_ids) > c.max_stop_tokens:
            raise ValueError(
                f"Request uid={request.uid} has {len(p.stop_token_ids)} stop tokens; the engine "
                f"allows max_stop_tokens={c.max_stop_tokens}."
            )
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in request.prompt):
            raise ValueError(
                f"Request uid={request.uid}: prompt token ids must be in [0, {vocab})."
            )

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

    def _check_insert(
        self,
        slots: Sequence[int],
        request: Request,
        samples: Sequence[int] | None,
    ) -> tuple[int, ...]:
        """Validates one request's insertion; returns its sample indices (default 0..G-1)."""
        samples = tuple(range(request.group_size)) if samples is None else tuple(samples)
        if len(slots) != len(samples):
            raise ValueError(
                f"bulk_insert got {len(slots)} slots for {len(samples)} samples {list(samples)}; "
                "expected one slot per sample."
            )
        if len(set(samples)) != len(samples) or not all(
            0 <= i < request.group_size for i in samples
        ):
            raise ValueError(
                f"bulk_insert samples must be distinct and in [0, {request.group_size}) (the "
                f"group size of request uid={request.uid}); received {list(samples)}."
            )
        if len(set(slots)) != len(slots) or not all(0 <= s < self.config.max_slots for s in slots):
            raise ValueError(
                f"bulk_insert slots must be distinct and in [0, {self.config.max_slots}); "
                f"received {list(slots)}."
            )
        self.validate(request)
        return samples

    # --------------------------------------------------------------------- batched prefill+insert

    def _prefill_rows(self, model: Transformer, tokens_PxT: jax.Array) -> tuple[tuple, tuple]:
        """Keys/values (P, T, K, H) per layer of P prompts, in chunks of `_PREFILL_CHUNK` prompts.

        A prompt's keys/values must not depend on which prompts share its call (sampling is
        independent of the batch), and a matmul's rounding on XLA:CPU can depend on its row
        count; so every chunk has the same shape (padded with empty prompts) and the chunks go
        through `lax.map`.
        """
        p, t = tokens_PxT.shape
        c = _PREFILL_CHUNK
        n = -(-p // c)
        chunks = jnp.pad(tokens_PxT, ((0, n * c - p), (0, 0))).reshape(n, c, t)

        def one(tokens_CxT: jax.Array) -> tuple[tuple, tuple]:
            _, (k, v) = model.prefill(tokens_CxT)
            cast = lambda x: x.astype(self.cache_dtype)
            return tuple(map(cast, k)), tuple(map(cast, v))

        k, v = jax.lax.map(one, chunks)
        unchunk = lambda x: x.reshape(n * c, *x.shape[2:])[:p]
        return tuple(map(unchunk, k)), tuple(map(unchunk, v))

    def _prefill_insert_impl(
        self,
        params: Any,
        state: DecodeState,
        tokens_PxT: jax.Array,
        rows_N: jax.Array,
        slots_N: jax.Array,
        ids_Nx6: jax.Array,
        sampling_Nx3: jax.Array,
        stop_NxS: jax.Array,
    ) -> DecodeState:
        """Prefills P prompts and writes prompt rows_N[i] into slots_N[i] (out of range: dropped)."""
        k, v = self._prefill_rows(self._model(params), tokens_PxT)
        rows = lambda kv: tuple(x[rows_N] for x in kv)
        cache = state.cache.put(slots_N, rows(k), rows(v), mode="drop")
        rnd, uid, sample, max_new, length, last_token = (ids_Nx6[:, i] for i in range(6))
        root = jax.random.key(self.config.seed)
        keys_N = jax.vmap(
            lambda r, u, i: jax.random.fold_in(
                jax.random.fold_in(jax.random.fold_in(root, r), u), i
            )
        )(rnd, uid, sample)
        fill = lambda arr, value: arr.at[slots_N].set(value, mode="drop")
        return DecodeState(
            cache=cache,
            tokens=fill(state.tokens, last_token),
            positions=fill(state.positions, length - 1),
            active=fill(state.active, True),
            last_position=fill(state.last_position, length - 1 + max_new),
            keys=fill(state.keys, keys_N),
            temperature=fill(state.temperature, sampling_Nx3[:, 0]),
            top_k=fill(state.top_k, sampling_Nx3[:, 1].astype(jnp.int32)),
            top_p=fill(state.top_p, sampling_Nx3[:, 2]),
            stop_ids=fill(state.stop_ids, stop_NxS),
        )

    def prefill_insert(
        self,
        params: Any,
        state: DecodeState,
        items: Sequence[tuple[Request, Sequence[int], Sequence[int] | None]],
    ) -> DecodeState:
        """Prefills the prompts of `items` and inserts them: one call per prompt-length bucket.

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
        by_bucket: dict[int, list] = {}
        for item in checked:
            by_bucket.setdefault(self.bucket(len(item[0].prompt)), []).append(item)
        for bucket, group in sorted(by_bucket.items()):
            state = self._prefill_insert_bucket(params, state, bucket, group)
        return state

    def _prefill_insert_bucket(
        self, params: Any, state: DecodeState, bucket: int, items: list
    ) -> DecodeState:
        pow2 = lambda n: 1 << (n - 1).bit_length()
        n_prompts, n_slots = len(items), sum(len(s) for _, s, _ in items)
        tokens = np.zeros((pow2(n_prompts), bucket), np.int32)
        rows = np.zeros((pow2(n_slots),), np.int32)
        slots = np.full((pow2(n_slots),), self.config.max_slots, np.int32)  # padding: dropped
        ids = np.zeros((pow2(n_slots), 6), np.int32)
        sampling = np.zeros((pow2(n_slots), 3), np.float32)
        stop = np.full((pow2(n_slots), self.config.max_stop_tokens), -1, np.int32)
        n = 0
        for row, (r, s, samples) in enumerate(items):
            p = r.params
            tokens[row, : len(r.prompt)] = r.prompt
            for slot, i in zip(s, samples, strict=True):
                rows[n], slots[n] = row, slot
                ids[n] = (r.round, r.uid, i, p.max_new_tokens, len(r.prompt), r.prompt[-1])
                sampling[n] = (p.temperature, p.top_k, p.top_p)
                stop[n, : len(p.stop_token_ids)] = p.stop_token_ids
                n += 1
        return self._call(
            self._prefill_insert,
            params,
            state,
            *(jnp.asarray(x) for x in (tokens, rows, slots, ids, sampling, stop)),
        )

    def reprefill(
        self,
        params: Any,
        state: DecodeState,
        slot: int,
        request: Request,
        sample: int,
        generated: tuple[int, ...] | list[int],
    ) -> DecodeState:
        """Recomputes a running sample's KV cache with `params` (AReaL interruptible generation).

        The prompt and the `generated` tokens so far are prefilled again into `slot`, which then
        continues as if it had decoded them with `params`: same random stream (the sample's key),
        same end (prompt length - 1 + max_new_tokens). Sequences longer than max_prefill_length
        use one prefill bucket of max_length.
        """
        tokens = (*request.prompt, *generated)
        left = request.params.max_new_tokens - len(generated)
        if left < 1:
            raise ValueError(
                f"reprefill: request uid={request.uid} sample {sample} has {len(generated)} tokens "
                f"of max_new_tokens={request.params.max_new_tokens}; expected fewer (it is done)."
            )
        if not 0 <= slot < self.config.max_slots:
            raise ValueError(
                f"reprefill: slot must be in [0, {self.config.max_slots}); received {slot}."
            )
        self.validate(request)
        bucket = next(
            (b for b in self.config.buckets() if len(tokens) <= b), self.config.max_length
        )
        padded = np.zeros((bucket,), np.int32)
        padded[: len(tokens)] = tokens
        k, v = self._call(self._prefill, params, jnp.asarray(padded))
        prefix = Prefix(k=k, v=v, length=len(tokens), last_token=int(tokens[-1]))
        return self._put(prefix, state, [slot], [sample], request, left)

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
        p = request.params
        stop = np.full((self.config.max_stop_tokens,), -1, np.int32)
        stop[: len(p.stop_token_ids)] = p.stop_token_ids
        c = self.config
        ids = [c.seed, request.round, request.uid, max_new, prefix.length, prefix.last_token]
        sampling = np.asarray([p.temperature, p.top_k, p.top_p], np.float32)
        return self._call(
            self._insert,
            (prefix.k, prefix.v),
            state,
            jnp.asarray(slots, jnp.int32),
            jnp.asarray(samples, jnp.int32),
            jnp.asarray(ids, jnp.int32),
            jnp.asarray(sampling),
            jnp.asarray(stop),
        )

    # --------------------------------------------------------------------------------- generate

    def _step(
        self, model: Transformer, state: DecodeState, blocks: int
    ) -> tuple[DecodeState, StepResult]:
        h, cache = model.decode_step(
            state.tokens,
            state.positions,
            state.cache,
            blocks=blocks,
            block=self.config.attention_block,
        )
        logits = model.logits(h)[:, 0]
        keys = jax.vmap(jax.random.fold_in)(state.keys, state.positions + 1)
        tok, logp = sample_tokens(logits, keys, state.temperature, state.top_k, state.top_p)
        valid = state.active
        stop = jnp.any(tok[:, None] == state.stop_ids, axis=-1)
        finished = valid & (stop | (state.positions + 1 >= state.last_position))
        state = dataclasses.replace(
            state,
            cache=cache,
            tokens=jnp.where(valid, tok, state.tokens),
            positions=jnp.where(valid, state.positions + 1, state.positions),
            active=valid & ~finished,
        )
        return state, StepResult(tokens=tok, logprobs=logp, valid=valid, finished=finished)

    def _generate_impl(
        self, params: Any, state: DecodeState, blocks: int
    ) -> tuple[DecodeState, StepResult]:
        model = self._model(params)
        return jax.lax.scan(
            lambda s, _: self._step(model, s, blocks),
            state,
            None,
            length=self.config.steps_per_call,
        )

    def live_blocks(self, state: DecodeState) -> int:
        """Attention blocks this generate call reads (0: the whole cache): enough for every active
        slot's last fed position, rounded up to a power of two (few compiles), at most the whole
        cache. With attention_block > 0 it reads three (B,) arrays to the host once per call."""
        if not self.config.attention_block:
            return 0  # the whole cache: no host read
        pos, active, last = jax.device_get((state.positions, state.active, state.last_position))
        k, block = self.config.steps_per_call, self.config.attention_block
        need = int(np.max(np.where(active, np.minimum(pos + k, last), 1), initial=1))
        blocks = 1 << (-(-need // block) - 1).bit_length()
        return min(blocks, self.cache_length // block)

    def generate(self, params: Any, state: DecodeState) -> tuple[DecodeState, StepResult]:
        """Runs `steps_per_call` decode steps for every slot; inactive slots produce nothing."""
        return self._call(self._generate, params, state, self.live_blocks(state))

    # ------------------------------------------------------------------------------------- free

    def _free_impl(self, state: DecodeState, slots: jax.Array) -> DecodeState:
        return dataclasses.replace(state, active=state.active.at[slots].set(False))

    def free(self, state: DecodeState, slots: list[int] | tuple[int, ...]) -> DecodeState:
        """Deactivates slots (abort); they can be inserted into again at once."""
        return self._call(self._free, state, jnp.asarray(slots, jnp.int32))

    # --------------------------------------------------------------------------------- migration

    def _export_impl(self, state: DecodeState, slots_N: jax.Array, length: int) -> SlotState:
        def rows(kind: str) -> Any:
            axis = self._cache_axes(kind).index("cache_length")
            return lambda c: jax.lax.slice_in_dim(c[slots_N], 0, length, axis=axis)

        return SlotState(
            k=tuple(map(rows("k"), state.cache.k)),
            v=tuple(map(rows("v"), state.cache.v)),
            **{name: getattr(state, name)[slots_N] for name in _PER_SLOT},
        )

    def export_slots(self, state: DecodeState, slots: Sequence[int]) -> SlotState:
        """Running slots' KV cache rows (up to their positions), positions, last tokens and
        sampling state, for `import_slots` on another engine (JigsawRL migration). The slots stay
        as they are here: `free` them once the state is taken.

        Args:
          state: this engine's decode state.
          slots: distinct running slots.
        """
        slots = list(slots)
        if not slots or len(set(slots)) != len(slots):
            raise ValueError(f"export_slots: expected distinct slots; received {slots}.")
        if not all(0 <= x < self.config.max_slots for x in slots):
            raise ValueError(
                f"export_slots: slots must be in [0, {self.config.max_slots}); received {slots}."
            )
        pos, active = jax.device_get((state.positions, state.active))
        if not all(active[slots]):
            raise ValueError(f"export_slots: slots {slots} must all be running; some are not.")
        # positions 0..pos are written; the length is bucketed (a power-of-two count of
        # EXPORT_BLOCK positions) so that few export shapes compile
        need = int(np.max(pos[slots])) + 1
        blocks = 1 << (-(-need // EXPORT_BLOCK) - 1).bit_length()
        length = min(EXPORT_BLOCK * blocks, self.cache_length)
        n = 1 << (len(slots) - 1).bit_length()
        padded = np.asarray(slots + [slots[0]] * (n - len(slots)), np.int32)
        out = self._call(self._export, state, jnp.asarray(padded), length)
        return dataclasses.replace(out, count=len(slots))

    def _import_impl(self, state: DecodeState, moved: SlotState, slots_N: jax.Array) -> DecodeState:
        def put(kind: str) -> Any:
            axis = self._cache_axes(kind).index("cache_length")

            def one(cache: jax.Array, rows: jax.Array) -> jax.Array:
                index = [slots_N] + [slice(None)] * (cache.ndim - 1)
                index[axis] = slice(0, rows.shape[axis])
                return cache.at[tuple(index)].set(rows.astype(cache.dtype), mode="drop")

            return one

        return DecodeState(
            cache=HeadMajorKVCache(
                k=tuple(map(put("k"), state.cache.k, moved.k)),
                v=tuple(map(put("v"), state.cache.v, moved.v)),
            ),
            **{
                name: getattr(state, name).at[slots_N].set(getattr(moved, name), mode="drop")
                for name in _PER_SLOT
            },
        )

    def import_slots(
        self, state: DecodeState, moved: SlotState, slots: Sequence[int]
    ) -> DecodeState:
        """Writes exported slots (another engine's `export_slots`, on any devices) into free
        `slots` here, row i into slots[i]; they continue decoding with exactly the tokens they
        would have produced there (a slot's random stream is its request's and sample's)."""
        slots = list(slots)
        if len(slots) != moved.count or len(set(slots)) != len(slots):
            raise ValueError(
                f"import_slots: expected {moved.count} distinct slots; received {slots}."
            )
        if not all(0 <= x < self.config.max_slots for x in slots):
            raise ValueError(
                f"import_slots: slots must be in [0, {self.config.max_slots}); received {slots}."
            )
        length = moved.v[0].shape[self._cache_axes("v").index("cache_length")]
        if length > self.cache_length or len(moved.k) != len(state.cache.k):
            raise ValueError(
                f"import_slots: {len(moved.k)} layers of {length} positions do not "
                f"fit this engine's {len(state.cache.k)} layers of {self.cache_length}."
            )
        if jax.device_get(state.active)[slots].any():
            raise ValueError(f"import_slots: slots {slots} must be free; some are running.")
        n = moved.tokens.shape[0]
        padded = np.asarray(slots + [self.config.max_slots] * (n - len(slots)), np.int32)
        target = (
            jax.devices()[0]
            if self.mesh is None
            else NamedSharding(self.mesh, jax.sharding.PartitionSpec())
        )
        moved = jax.device_put(moved, target)
        return self._call(self._import, state, moved, jnp.asarray(padded))

    def place_params(self, params: Any) -> Any:
        """`params` (published for any mesh) on this engine's devices, with its shardings."""
        if self.mesh is None:
            return params
        return jax.device_put(params, self._param_shardings)
