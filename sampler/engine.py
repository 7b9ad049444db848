"""Slot-based continuous-batching decode engine, in the shape of JetStream's Engine API.

    engine = Engine(model, EngineConfig(max_slots=32, max_length=512), mesh=sampler_mesh)
    params = engine.load_params(model)            # placed on the sampler mesh
    state = engine.init_decode_state()            # KV cache + per-slot sampling state, a pytree
    prefix = engine.prefill(params, prompt)       # one prefill per prompt ...
    state = engine.bulk_insert(prefix, state, slots, request)  # ... copied into its G slots
    state, result = engine.generate(params, state)            # k decode steps for all slots
    state = engine.free(state, slots)             # abort

Cache index == token position. A request's prompt of length L is prefilled at positions 0..L-1;
insert leaves the slot about to feed prompt[L-1] at position L-1, so every response token,
the first included, is drawn by `generate` from the same code path. The token drawn after feeding
position p sits at position p+1 and uses the PRNG key
    fold_in(fold_in(fold_in(fold_in(key(seed), round), uid), sample), p + 1),
so it does not depend on the slot or on the other requests in the batch.

Memory: the KV cache takes 2 * n_layers * max_length * n_kv_heads * head_dim * itemsize bytes per
slot (`cache_bytes_per_slot`), sharded over `data` (slots) and `tp` (kv heads).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from rl.models.config import DTYPES
from rl.models.sharding import Rules, axis_rules, current_rules, logical_to_spec, tree_shardings
from rl.models.transformer import CACHE_AXES, KVCache, Transformer
from rl.types import Request
from sampler.sampling import sample_tokens


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

    cache: KVCache
    tokens: jax.Array  # (B,) int32: the token to feed next
    positions: jax.Array  # (B,) int32: its position
    active: jax.Array  # (B,) bool: slot holds an unfinished sequence
    last_position: jax.Array  # (B,) int32: position of the final allowed response token
    keys: jax.Array  # (B,) PRNG keys of the slot's request and sample
    temperature: jax.Array  # (B,) float32
    top_k: jax.Array  # (B,) int32
    top_p: jax.Array  # (B,) float32
    stop_ids: jax.Array  # (B, max_stop_tokens) int32, -1 padded


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
        self.model_config = model.config
        self.mesh = mesh
        self.rules = current_rules() if rules is None else rules
        self._graphdef, abstract = nnx.split(nnx.eval_shape(lambda: model))
        self._param_shardings = None if mesh is None else tree_shardings(abstract, mesh, self.rules)
        cfg = model.config
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
        self._check_memory()
        self._state_shardings = None if mesh is None else self._decode_state_shardings()
        donate = dict(donate_argnums=(1,))
        out = {} if mesh is None else dict(out_shardings=self._state_shardings)
        self._init = jax.jit(self._init_impl, **out)
        self._prefill = jax.jit(self._prefill_impl, static_argnums=(2,))
        self._insert = jax.jit(self._insert_impl, donate_argnums=(1,), **out)
        gen_out = {} if mesh is None else dict(out_shardings=(self._state_shardings, None))
        self._generate = jax.jit(self._generate_impl, **donate, **gen_out)
        self._free = jax.jit(self._free_impl, donate_argnums=(0,), **out)
        self.prefill_count = 0

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
        return 2 * c.n_layers * self.config.max_length * c.n_kv_heads * c.head_dim * itemsize

    def compile_counts(self) -> dict[str, int]:
        """How many programs each jitted entry point has compiled (prefill: one per bucket)."""
        fns = dict(
            init=self._init,
            prefill=self._prefill,
            insert=self._insert,
            generate=self._generate,
            free=self._free,
        )
        return {k: f._cache_size() for k, f in fns.items()}

    def _check_memory(self) -> None:
        devices = self.mesh.devices.flatten() if self.mesh is not None else jax.devices()[:1]
        stats = devices[0].memory_stats() or {}
        limit = self.config.memory_budget_bytes or stats.get("bytes_limit")
        if not limit:
            return  # the CPU backend reports no limit
        shards = 1
        if self.mesh is not None:
            spec = logical_to_spec(
                CACHE_AXES,
                self.mesh,
                self.rules,
                shape=(
                    self.config.max_slots,
                    self.config.max_length,
                    self.model_config.n_kv_heads,
                    self.model_config.head_dim,
                ),
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

        cache = jax.tree.map(lambda x: named(x, CACHE_AXES), abstract.cache)
        per_slot = {
            f.name: named(
                getattr(abstract, f.name),
                ("batch",) + (None,) * (getattr(abstract, f.name).ndim - 1),
            )
            for f in dataclasses.fields(DecodeState)
            if f.name != "cache"
        }
        return DecodeState(cache=cache, **per_slot)

    def _init_impl(self) -> DecodeState:
        b, c = self.config.max_slots, self.model_config
        shape = (b, self.config.max_length, c.n_kv_heads, c.head_dim)
        zeros = lambda: jnp.zeros(shape, self.cache_dtype)
        return DecodeState(
            cache=KVCache(
                k=tuple(zeros() for _ in range(c.n_layers)),
                v=tuple(zeros() for _ in range(c.n_layers)),
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

    def _prefill_impl(self, params: Any, tokens_T: jax.Array, bucket: int) -> tuple[tuple, tuple]:
        model = self._model(params)
        cache = model.init_cache(1, bucket, self.cache_dtype)
        _, cache = model.decode(tokens_T[None], jnp.arange(bucket)[None], cache)
        return tuple(k[0] for k in cache.k), tuple(v[0] for v in cache.v)

    def prefill(self, params: Any, tokens: tuple[int, ...] | list[int]) -> Prefix:
        """Computes the KV of one prompt, padded to its length bucket (one compile per bucket)."""
        n = len(tokens)
        if n < 1:
            raise ValueError("prefill needs a prompt of at least one token.")
        bucket = self.bucket(n)
        padded = np.zeros((bucket,), np.int32)
        padded[:n] = tokens
        k, v = self._call(self._prefill, params, jnp.asarray(padded), bucket)
        self.prefill_count += 1
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
        bucket = prefix_k[0].shape[0]

        def put(cache: jax.Array, kv: jax.Array) -> jax.Array:
            return cache.at[slots_G, :bucket].set(
                jnp.broadcast_to(kv[None], (g, *kv.shape)).astype(cache.dtype)
            )

        cache = KVCache(
            k=tuple(put(c, p) for c, p in zip(state.cache.k, prefix_k, strict=True)),
            v=tuple(put(c, p) for c, p in zip(state.cache.v, prefix_v, strict=True)),
        )
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
        p = request.params
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
        if len(request.prompt) != prefix.length:
            raise ValueError(
                f"bulk_insert: the prefix holds {prefix.length} tokens but request "
                f"uid={request.uid} has a prompt of {len(request.prompt)}."
            )
        self.validate(request)
        return self._put(prefix, state, slots, samples, request, p.max_new_tokens)

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
        k, v = self._call(self._prefill, params, jnp.asarray(padded), bucket)
        self.prefill_count += 1
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

    def _step(self, model: Transformer, state: DecodeState) -> tuple[DecodeState, StepResult]:
        h, cache = model.decode(state.tokens[:, None], state.positions[:, None], state.cache)
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

    def _generate_impl(self, params: Any, state: DecodeState) -> tuple[DecodeState, StepResult]:
        model = self._model(params)
        return jax.lax.scan(
            lambda s, _: self._step(model, s), state, None, length=self.config.steps_per_call
        )

    def generate(self, params: Any, state: DecodeState) -> tuple[DecodeState, StepResult]:
        """Runs `steps_per_call` decode steps for every slot; inactive slots produce nothing."""
        return self._call(self._generate, params, state)

    # ------------------------------------------------------------------------------------- free

    def _free_impl(self, state: DecodeState, slots: jax.Array) -> DecodeState:
        return dataclasses.replace(state, active=state.active.at[slots].set(False))

    def free(self, state: DecodeState, slots: list[int] | tuple[int, ...]) -> DecodeState:
        """Deactivates slots (abort); they can be inserted into again at once."""
        return self._call(self._free, state, jnp.asarray(slots, jnp.int32))
