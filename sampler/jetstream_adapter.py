"""Our slot Engine behind JetStream's `engine_api.Engine`, so a JetStream orchestrator can drive it.

    js = make_jetstream_engine(engine, model, sampling=SamplingParams(temperature=0.0))
    prefix, first = js.prefill(params=params, padded_tokens=padded, true_length=n)
    state = js.insert(prefix, state, slot=3)         # the tuple itself is accepted as well
    state, result = js.generate(params, state)       # ResultTokens, (max_slots, 2k + 1)

JetStream is optional (`pip install -e '.[jetstream]'`, which pulls TensorFlow via seqio) and is
imported only inside `make_jetstream_engine`.

Decisions, where the two designs differ:
  * First token: our engine draws every response token, the first included, in `generate` (see
    sampler/prefill.py), so `prefill` has none to give. Its ResultTokens has zero token columns and
    length 0: JetStream's `process_result_tokens` then emits nothing and does not mark the request
    complete (an invalid token would end the request before it starts).
  * generate: one call runs `steps_per_call` = k fused steps. They come back as JetStream's
    speculation columns: data is (B, 2k + 1) int32 = [tokens (k) | valid (k) | length (1)], row b
    is slot b (samples_per_slot = 1). A consumer stops a slot at its first invalid column.
  * length: response tokens generated so far, after this call: positions - (prompt length - 1),
    with the prompt length of each slot kept on the host at insert.
  * Randomness: every insert becomes a Request with group_size 1, the adapter's SamplingParams and
    uid = first_uid, first_uid + 1, ... in insert order; the PRNG keys derive from (seed, round,
    uid, position), so a stream reproduces when the same prompts are inserted in the same order.
  * Not supported: `existing_prefix` (chunked prefill), several samples per slot. `get_tokenizer`
    reports `tokenizer_path`; `build_tokenizer` returns `tokenizer` if one is given.
"""

from __future__ import annotations

import importlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from rl.types import Request, SamplingParams
from sampler.cache import DecodeState
from sampler.engine import Engine
from sampler.prefill import Prefix

_INSTALL_HINT = (
    "make_jetstream_engine needs JetStream: pip install -e '.[jetstream]'; it pulls TensorFlow via "
    "seqio, so it is an optional extra."
)


@jax.jit
def _pack(
    tokens_KxB: jax.Array, valid_KxB: jax.Array, positions_B: jax.Array, start_B: jax.Array
) -> jax.Array:
    """[tokens | valid | length] per slot: the ResultTokens data array, (B, 2k + 1) int32."""
    lengths_B = positions_B - start_B
    return jnp.concatenate(
        [tokens_KxB.T.astype(jnp.int32), valid_KxB.T.astype(jnp.int32), lengths_B[:, None]], axis=1
    )


class _Adapter:
    """The engine_api.Engine methods over our Engine; mixed into a subclass of engine_api.Engine."""

    _api: Any  # jetstream.engine.engine_api and tokenizer_pb2, set by make_jetstream_engine
    _pb2: Any

    def __init__(
        self,
        engine: Engine,
        model: Any,
        sampling: SamplingParams,
        round: int,
        first_uid: int,
        tokenizer_path: str,
        tokenizer: Any,
    ):
        self.engine, self.model, self.sampling = engine, model, sampling
        self.round, self.next_uid = round, first_uid
        self._tokenizer_path, self._tokenizer = tokenizer_path, tokenizer
        self._start_B = np.zeros((engine.max_concurrent_decodes,), np.int32)  # prompt length - 1

    def _result(self, data: Any, k: int) -> Any:
        idx = dict(tokens_idx=(0, k), valid_idx=(k, 2 * k), length_idx=(2 * k, 2 * k + 1))
        return self._api.ResultTokens(data=data, samples_per_slot=1, **idx)

    def load_params(self, model: Any = None) -> Any:
        return self.engine.load_params(self.model if model is None else model)

    def init_decode_state(self, *args: Any, **kwargs: Any) -> DecodeState:
        self._start_B[:] = 0
        return self.engine.init_decode_state()

    def prefill(
        self, *, params: Any, existing_prefix: Any = None, padded_tokens: Any, true_length: int
    ) -> tuple[Prefix, Any]:
        """Our Prefix of padded_tokens[:true_length], and a ResultTokens holding no token."""
        if existing_prefix is not None:
            raise NotImplementedError("existing_prefix (chunked prefill) is not supported.")
        tokens_T = np.asarray(padded_tokens)
        if tokens_T.ndim != 1 or not 1 <= true_length <= tokens_T.shape[0]:
            raise ValueError(
                f"prefill expects 1-D padded_tokens and 1 <= true_length <= their length; received "
                f"shape {tokens_T.shape} and true_length={true_length}."
            )
        prompt = tuple(int(t) for t in tokens_T[:true_length])
        self.engine.validate(Request(uid=0, round=self.round, prompt=prompt, params=self.sampling))
        prefix = self.engine.prefill(params, prompt)
        return prefix, self._result(np.zeros((1, 1), np.int32), 0)

    def insert(
        self, prefix: Prefix | tuple[Prefix, Any], decode_state: DecodeState, slot: int
    ) -> DecodeState:
        """Starts the prompt in `slot` as a new request with the next uid."""
        if isinstance(prefix, tuple):  # JetStream 0.2.2's orchestrator passes prefill's output on
            prefix = prefix[0]
        if not 0 <= slot < self.max_concurrent_decodes:
            raise ValueError(
                f"slot must be in [0, {self.max_concurrent_decodes}); received {slot}."
            )
        # The prompt was checked in prefill; bulk_insert reads only its length from this one.
        prompt = (prefix.last_token,) * prefix.length
        request = Request(uid=self.next_uid, round=self.round, prompt=prompt, params=self.sampling)
        state = self.engine.bulk_insert(prefix, decode_state, [slot], request)
        self.next_uid += 1
        self._start_B[slot] = prefix.length - 1
        return state

    def generate(self, params: Any, decode_state: DecodeState) -> tuple[DecodeState, Any]:
        """steps_per_call decode steps for every slot, returned as k token columns."""
        state, result = self.engine.generate(params, decode_state)
        data = _pack(result.tokens, result.valid, state.positions, jnp.asarray(self._start_B))
        return state, self._result(data, result.tokens.shape[0])

    def get_prefix_destination_sharding(self) -> Any:
        mesh = self.engine.mesh
        return None if mesh is None else NamedSharding(mesh, PartitionSpec())

    def get_tokenizer(self) -> Any:
        return self._pb2.TokenizerParameters(path=self._tokenizer_path)

    def build_tokenizer(self, metadata: Any) -> Any:
        if self._tokenizer is not None:
            return self._tokenizer
        return super().build_tokenizer(metadata)  # JetStream's SentencePiece default

    @property
    def max_concurrent_decodes(self) -> int:
        return self.engine.max_concurrent_decodes

    @property
    def samples_per_slot(self) -> int:
        return 1

    @property
    def max_prefill_length(self) -> int:
        return self.engine.max_prefill_length

    @property
    def mesh(self) -> Any:
        return self.engine.mesh

    @property
    def colocated_cpus(self) -> None:
        return None


def make_jetstream_engine(
    engine: Engine,
    model: Any,
    *,
    sampling: SamplingParams,
    round: int = 0,
    first_uid: int = 0,
    tokenizer_path: str = "",
    tokenizer: Any = None,
) -> Any:
    """Wraps `engine` as a `jetstream.engine.engine_api.Engine` (see the module docstring).

    Args:
      engine: our slot engine; its steps_per_call sets the token columns per generate.
      model: the Transformer that `load_params()` without arguments loads.
      sampling: how every inserted request is decoded.
      round: the Request.round of every request (part of the PRNG keys).
      first_uid: the uid of the first insert; later inserts count up from it.
      tokenizer_path: what `get_tokenizer` reports.
      tokenizer: if given, what `build_tokenizer` returns.

    Returns:
      An instance of a subclass of engine_api.Engine.
    """
    try:
        api = importlib.import_module("jetstream.engine.engine_api")
        tokenizer_pb2 = importlib.import_module("jetstream.engine.tokenizer_pb2")
    except ImportError as e:
        raise ImportError(_INSTALL_HINT) from e
    if not isinstance(sampling, SamplingParams):
        raise TypeError(f"sampling must be a SamplingParams; received {type(sampling).__name__}.")
    Request(uid=first_uid, round=round, prompt=(0,), params=sampling)  # range-checks uid and round
    attrs = {"_api": api, "_pb2": tokenizer_pb2, "__module__": __name__}
    cls = type("JetStreamEngine", (_Adapter, api.Engine), attrs)
    return cls(engine, model, sampling, round, first_uid, tokenizer_path, tokenizer)
