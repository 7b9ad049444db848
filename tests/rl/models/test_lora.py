"""LoRA adapters: the base is untouched, the sampler decodes base + adapter as the merged model,
an export merges, and a bad config names what it expected."""

import functools

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from rl.models import create_model, get_preset
from rl.models.build import build_model
from rl.models.config import LoraConfig
from rl.models.hf_io import load_hf, save_hf
from rl.models.lora import has_adapters, lora_config_from, merge_adapters, split_trainable
from rl.types import Request, SamplingParams
from sampler.engine import Engine, EngineConfig
from tests.sampler.test_engine import _prompts, _run

TOL = 1e-5  # float32, absolute and relative (logits reach ~10 here)


def tuned(cfg, seed=0, scale=0.3):
    """A model with adapters whose B is not zero (a fresh adapter changes nothing)."""
    model = create_model(cfg, seed=seed)
    graphdef, params = nnx.split(model)
    adapters, base = split_trainable(params)
    keys = iter(jax.random.split(jax.random.key(seed + 1), len(jax.tree.leaves(adapters))))
    adapters = jax.tree.map(lambda x: x + scale * jax.random.normal(next(keys), x.shape), adapters)
    return nnx.merge(graphdef, adapters, base)


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, state, tokens):
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    return nnx.merge(graphdef, state)(tokens, positions, jnp.ones_like(tokens))


def _logits(model, tokens):
    return _forward(*nnx.split(model), tokens)


def test_adapters_leave_the_base_as_without_them_and_start_as_the_base():
    cfg = get_preset("tiny", init_std=0.3)
    plain = create_model(cfg, seed=3)
    adapted = create_model(cfg.replace(lora=LoraConfig(rank=4, targets=("q", "o", "down"))), seed=3)
    adapters, base = split_trainable(nnx.state(adapted))
    for a, b in zip(jax.tree.leaves(nnx.state(plain)), jax.tree.leaves(base), strict=True):
        np.testing.assert_array_equal(a, b)  # the same draws: adapters come after every weight
    # q, o, down in each layer: an A and a B each
    assert len(jax.tree.leaves(adapters)) == 2 * 3 * cfg.n_layers
    tokens = jnp.asarray([_prompts([12], seed=1)[0]])
    np.testing.assert_array_equal(_logits(plain, tokens), _logits(adapted, tokens))


def test_merging_adapters_gives_a_plain_model_with_the_same_logits():
    cfg = get_preset("tiny", init_std=0.3).replace(lora=LoraConfig(rank=4, alpha=8.0))
    model = tuned(cfg)
    merged = merge_adapters(model)
    assert merged.config.lora is None and not has_adapters(nnx.state(merged))
    tokens = jnp.asarray([_prompts([16], seed=2)[0]])
    got, want = _logits(model, tokens), _logits(merged, tokens)
    assert float(jnp.max(jnp.abs(got - _logits(create_model(cfg, seed=0), tokens)))) > 1e-2
    np.testing.assert_allclose(got, want, atol=TOL, rtol=TOL)


def test_the_engine_decodes_base_plus_adapter_as_the_merged_model():
    cfg = get_preset("tiny", init_std=0.3).replace(lora=LoraConfig(rank=4))
    model = tuned(cfg)
    merged = merge_adapters(model)
    ecfg = EngineConfig(max_slots=4, max_length=48, max_prefill_length=16)
    params = SamplingParams(temperature=1.0, max_new_tokens=12)
    requests = [
        Request(uid=i, prompt=p, group_size=2, params=params)
        for i, p in enumerate(_prompts([5, 11]))
    ]
    results = []
    for m in (model, merged):
        engine = Engine(m, ecfg)
        results.append(_run(engine, engine.load_params(m), requests)[0])
    adapted, plain = results
    for key, group in adapted.items():
        for a, b in zip(group.completions, plain[key].completions, strict=True):
            assert a.tokens == b.tokens
            np.testing.assert_allclose(a.logprobs, b.logprobs, atol=TOL, rtol=TOL)


@pytest.mark.slow  # ~18 s cold; the engine's merged-model test stays quick
def test_save_hf_writes_the_merged_weights(tmp_path):
    cfg = get_preset("tiny", init_std=0.3).replace(lora=LoraConfig(rank=2))
    model = tuned(cfg)
    save_hf(model, str(tmp_path))
    loaded = load_hf(str(tmp_path))
    assert loaded.config.lora is None
    tokens = jnp.asarray([_prompts([10], seed=4)[0]])
    np.testing.assert_allclose(_logits(loaded, tokens), _logits(model, tokens), atol=TOL, rtol=TOL)


def test_build_model_puts_adapters_on_local_hf_weights(tmp_path):
    base = create_model(get_preset("tiny", init_std=0.3), seed=5)
    save_hf(base, str(tmp_path))
    section = ml_collections.ConfigDict(
        dict(hf_path=str(tmp_path), lora=dict(rank=2, alpha=4.0, targets="v,up"))
    )
    model = build_model(section, seed=1)
    assert model.config.lora == LoraConfig(rank=2, alpha=4.0, targets=("v", "up"))
    adapters, frozen = split_trainable(nnx.state(model))
    assert len(jax.tree.leaves(adapters)) == 2 * 2 * base.config.n_layers
    for a, b in zip(jax.tree.leaves(nnx.state(base)), jax.tree.leaves(frozen), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
    "section, match",
    [
        (dict(rank=-1), "positive integer"),
        (dict(rank=4, alpha=0.0), "alpha must be > 0"),
        (dict(rank=4, targets="q,lm_head"), r"among \('q', 'k'"),
    ],
)
def test_a_bad_lora_section_names_what_it_expected(section, match):
    with pytest.raises(ValueError, match=f"config.model.lora: .*{match}"):
        lora_config_from(section)
    assert lora_config_from(dict(rank=0)) is None
