"""The JetStream adapter: an optional import, and the same tokens as our own loop.

JetStream itself is not installed in tests (it pulls TensorFlow); a minimal stand-in for
`jetstream.engine.engine_api` with the same abstract methods is injected into sys.modules instead.
"""

import abc
import os
import pathlib
import subprocess
import sys
import types

import jax.numpy as jnp
import numpy as np
import pytest
from flax import struct

from rl.admission import FCFS
from rl.types import Request, SamplingParams
from sampler.engine import Engine, EngineConfig
from sampler.jetstream_adapter import make_jetstream_engine
from sampler.loop import SamplerLoop
from sampler.reference import greedy_nocache

REPO = pathlib.Path(__file__).resolve().parents[2]
MAX_LENGTH = 32
PROMPTS = [(5, 17, 99, 3), (250, 1, 42, 7, 7, 128, 64, 9, 11)]


def _fake_jetstream() -> dict[str, types.ModuleType]:
    """jetstream.engine.{engine_api, tokenizer_pb2} with the 0.2.2 API surface the adapter uses."""
    api = types.ModuleType("jetstream.engine.engine_api")

    @struct.dataclass
    class SlotData:
        tokens: np.ndarray
        valid: np.ndarray
        lengths: np.ndarray

    @struct.dataclass
    class ResultTokens:
        data: np.ndarray
        tokens_idx: tuple[int, int] = struct.field(pytree_node=False)
        valid_idx: tuple[int, int] = struct.field(pytree_node=False)
        length_idx: tuple[int, int] = struct.field(pytree_node=False)
        samples_per_slot: int = struct.field(pytree_node=False)

        def get_result_at_slot(self, slot: int) -> SlotData:
            rows = np.asarray(self.data)[
                slot * self.samples_per_slot : (slot + 1) * self.samples_per_slot
            ]
            return SlotData(
                tokens=rows[:, slice(*self.tokens_idx)],
                valid=rows[:, slice(*self.valid_idx)],
                lengths=rows[:, slice(*self.length_idx)][:, 0],
            )

    class Engine(abc.ABC):
        @abc.abstractmethod
        def prefill(self, *, params, existing_prefix=None, padded_tokens, true_length): ...

        @abc.abstractmethod
        def generate(self, params, decode_state): ...

        @abc.abstractmethod
        def insert(self, prefix, decode_state, slot): ...

        @abc.abstractmethod
        def load_params(self, *args, **kwargs): ...

        @abc.abstractmethod
        def get_prefix_destination_sharding(self): ...

        @abc.abstractmethod
        def get_tokenizer(self): ...

        def build_tokenizer(self, metadata):
            return ("sentencepiece", metadata.path)

        @abc.abstractmethod
        def init_decode_state(self, *args, **kwargs): ...

        max_concurrent_decodes = property(abc.abstractmethod(lambda self: None))
        samples_per_slot = property(abc.abstractmethod(lambda self: None))
        max_prefill_length = property(abc.abstractmethod(lambda self: None))
        mesh = property(abc.abstractmethod(lambda self: None))
        colocated_cpus = property(abc.abstractmethod(lambda self: None))

    assert len(Engine.__abstractmethods__) == 12
    api.Engine, api.ResultTokens, api.SlotData = Engine, ResultTokens, SlotData

    pb2 = types.ModuleType("jetstream.engine.tokenizer_pb2")
    pb2.TokenizerParameters = lambda path="", extra_ids=0: types.SimpleNamespace(
        path=path, extra_ids=extra_ids
    )
    pkg, sub = types.ModuleType("jetstream"), types.ModuleType("jetstream.engine")
    pkg.engine, sub.engine_api, sub.tokenizer_pb2 = sub, api, pb2
    return {
        "jetstream": pkg,
        "jetstream.engine": sub,
        "jetstream.engine.engine_api": api,
        "jetstream.engine.tokenizer_pb2": pb2,
    }


@pytest.fixture
def fake_api(monkeypatch):
    mods = _fake_jetstream()
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    return mods["jetstream.engine.engine_api"]


@pytest.fixture(scope="module")
def engine(model):
    return Engine(
        model,
        EngineConfig(max_slots=2, max_length=MAX_LENGTH, max_prefill_length=16, steps_per_call=3),
    )


def _padded(prompt, n=16):
    return jnp.asarray(list(prompt) + [0] * (n - len(prompt)), jnp.int32)


def _decode(js, params, prompts, slots):
    """Prefill + insert each prompt, then generate until every slot is done, as JetStream would:
    a slot's tokens are its valid columns up to the first invalid one."""
    state = js.init_decode_state()
    for prompt, slot in zip(prompts, slots, strict=True):
        prefix, first = js.prefill(
            params=params, padded_tokens=_padded(prompt), true_length=len(prompt)
        )
        first_slot = first.get_result_at_slot(0)
        assert first_slot.tokens.shape == (1, 0) and list(first_slot.lengths) == [0]
        state = js.insert((prefix, first) if slot == 0 else prefix, state, slot=slot)
    out, done = {s: [] for s in slots}, set()
    for _ in range(MAX_LENGTH):
        state, result = js.generate(params, state)
        for s in set(slots) - done:
            r = result.get_result_at_slot(s)
            for tok, ok in zip(r.tokens[0], r.valid[0], strict=True):
                if not ok:
                    done.add(s)
                    break
                out[s].append(int(tok))
            assert r.lengths[0] == len(out[s]), "length = response tokens so far"
        if done == set(slots):
            return [out[s] for s in slots]
    raise AssertionError("slots never finished")


def _loop_tokens(engine, params, requests):
    groups = []
    loop = SamplerLoop(
        engine, params, admission=FCFS(), reward_fn=lambda r, c: 0.0, emit=groups.append
    )
    loop.submit(requests)
    loop.run_until_idle(max_steps=100)
    by_uid = {g.request.uid: list(g.completions[0].tokens) for g in groups}
    return [by_uid[r.uid] for r in requests]


def test_library_imports_never_import_jetstream():
    code = (
        "import sys, rl, sampler.engine, sampler.loop, sampler.jetstream_adapter\n"
        "assert not [m for m in sys.modules if m.split('.')[0] == 'jetstream'], 'jetstream imported'"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr


def test_missing_jetstream_raises_import_error_naming_the_extra(monkeypatch, engine, model):
    for name in ("jetstream", "jetstream.engine", "jetstream.engine.engine_api"):
        monkeypatch.setitem(sys.modules, name, None)  # makes `import` fail even where installed
    with pytest.raises(ImportError, match=r"\.\[jetstream\]'.*TensorFlow"):
        make_jetstream_engine(engine, model, sampling=SamplingParams())


def test_greedy_tokens_match_loop_and_nocache_reference(fake_api, engine, model):
    new = 7
    sampling = SamplingParams(temperature=0.0, max_new_tokens=new)
    js = make_jetstream_engine(engine, model, sampling=sampling, tokenizer_path="tok.model")
    assert isinstance(js, fake_api.Engine)
    assert (js.max_concurrent_decodes, js.samples_per_slot, js.max_prefill_length) == (2, 1, 16)
    assert js.get_tokenizer().path == "tok.model" and js.colocated_cpus is None
    assert js.build_tokenizer(js.get_tokenizer()) == ("sentencepiece", "tok.model")
    params = js.load_params()

    got = _decode(js, params, PROMPTS, slots=[1, 0])
    ref = greedy_nocache(model, PROMPTS, [new] * len(PROMPTS), max_length=MAX_LENGTH)
    requests = [Request(uid=i, prompt=p, params=sampling) for i, p in enumerate(PROMPTS)]
    assert got == ref
    assert got == _loop_tokens(engine, params, requests)


def test_sampled_tokens_follow_insert_order_uids(fake_api, engine, model):
    sampling = SamplingParams(temperature=1.0, max_new_tokens=6)
    js = make_jetstream_engine(engine, model, sampling=sampling, round=3, first_uid=10)
    params = js.load_params()
    got = _decode(js, params, PROMPTS, slots=[0, 1])
    requests = [
        Request(uid=10 + i, round=3, prompt=p, params=sampling) for i, p in enumerate(PROMPTS)
    ]
    assert got == _loop_tokens(engine, params, requests)  # slot-independent: keyed by uid only
    assert js.next_uid == 12


def test_bad_prefill_inputs_are_rejected(fake_api, engine, model):
    js = make_jetstream_engine(engine, model, sampling=SamplingParams(max_new_tokens=8))
    params = js.load_params()
    with pytest.raises(NotImplementedError, match="existing_prefix"):
        js.prefill(
            params=params, existing_prefix=object(), padded_tokens=_padded([1]), true_length=1
        )
    with pytest.raises(ValueError, match="true_length=17"):
        js.prefill(params=params, padded_tokens=_padded([1]), true_length=17)
    with pytest.raises(ValueError, match="token ids must be in"):
        js.prefill(params=params, padded_tokens=_padded([10**6]), true_length=1)
    prefix, _ = js.prefill(params=params, padded_tokens=_padded([1, 2]), true_length=2)
    with pytest.raises(ValueError, match=r"slot must be in \[0, 2\); received 2"):
        js.insert(prefix, js.init_decode_state(), slot=2)
