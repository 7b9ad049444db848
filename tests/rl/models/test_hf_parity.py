"""Logit parity with transformers (torch CPU) on tiny random Llama / Qwen2 / Qwen3 models."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch  # in setup.py's [test] extras: if missing or broken, fail (never skip)
import transformers  # in setup.py's [test] extras: if missing or broken, fail (never skip)

from rl.models import create_model, get_preset, load_hf, save_hf
from rl.models.hf_io import SINGLE_FILE

TOL = 1e-4  # max abs logit difference, float32

_COMMON = dict(
    vocab_size=97,
    hidden_size=48,
    intermediate_size=80,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)
_ROPE_LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
CASES = {
    "llama_untied": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(rope_parameters=_ROPE_LLAMA3, tie_word_embeddings=False),
    ),
    "llama_tied_bias": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(rope_parameters=_ROPE_LLAMA3, tie_word_embeddings=True, attention_bias=True),
    ),
    "qwen2_tied": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    ),
    "qwen2_untied": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=False)),
    "qwen3_tied": ("Qwen3Config", "Qwen3ForCausalLM", dict(tie_word_embeddings=True)),
    "qwen3_untied": ("Qwen3Config", "Qwen3ForCausalLM", dict(tie_word_embeddings=False)),
}


def _hf_model(case: str, path: str):
    config_cls, model_cls, extra = CASES[case]
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**_COMMON, **extra)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():  # random biases and norm scales, so that a mix-up shows in the logits
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    return model


def _batch():
    """Two rows, the second right-padded: tokens, positions, segment ids, HF attention mask."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, _COMMON["vocab_size"], size=(2, 11))
    lengths = np.array([11, 7])
    mask = (np.arange(11)[None, :] < lengths[:, None]).astype(np.int64)
    positions = np.broadcast_to(np.arange(11), (2, 11)).copy()
    return tokens, positions, mask


def _hf_logits(model, tokens, positions, mask):
    with torch.no_grad():
        out = model(
            input_ids=torch.tensor(tokens),
            attention_mask=torch.tensor(mask),
            position_ids=torch.tensor(positions),
        )
    return out.logits.float().numpy()


def _our_logits(model, tokens, positions, mask):
    return np.asarray(
        model(jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(mask, jnp.int32))
    )


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(case, tmp_path):
    hf_model = _hf_model(case, str(tmp_path))
    tokens, positions, mask = _batch()
    ours = load_hf(str(tmp_path), param_dtype="float32", dtype="float32")
    ref = _hf_logits(hf_model, tokens, positions, mask)
    got = _our_logits(ours, tokens, positions, mask)
    valid = mask.astype(bool)
    np.testing.assert_allclose(got[valid], ref[valid], atol=TOL, rtol=0)


@pytest.mark.parametrize("case", ["llama_untied", "qwen2_tied", "qwen3_untied"])
def test_save_round_trip_loads_in_transformers(case, tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    hf_model = _hf_model(case, str(src))
    ours = load_hf(str(src), param_dtype="float32")
    save_hf(ours, str(dst))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(dst)).eval()
    tokens, positions, mask = _batch()
    valid = mask.astype(bool)
    ref = _hf_logits(hf_model, tokens, positions, mask)
    np.testing.assert_allclose(
        _hf_logits(reloaded, tokens, positions, mask)[valid], ref[valid], atol=TOL, rtol=0
    )


def test_fresh_model_saves_sharded_and_reloads(tmp_path):
    """A model we create (never seen by transformers) saved in several shards loads back in both."""
    cfg = get_preset("tiny", family="llama", qk_norm=False, tie_embeddings=False)
    ours = create_model(cfg, seed=3)
    save_hf(ours, str(tmp_path), max_shard_bytes=40_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert not os.path.exists(tmp_path / SINGLE_FILE)
    tokens, positions, mask = _batch()
    tokens = tokens % cfg.vocab_size
    ref = _our_logits(ours, tokens, positions, mask)
    again = load_hf(str(tmp_path))
    np.testing.assert_allclose(_our_logits(again, tokens, positions, mask), ref, atol=1e-6, rtol=0)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    valid = mask.astype(bool)
    np.testing.assert_allclose(
        _hf_logits(hf, tokens, positions, mask)[valid], ref[valid], atol=TOL, rtol=0
    )


def test_load_onto_mesh_matches_unsharded(tmp_path):
    _hf_model("qwen3_untied", str(tmp_path))
    tokens, positions, mask = _batch()
    plain = load_hf(str(tmp_path))
    devices = np.array(jax.devices()[:8]).reshape(4, 2)
    mesh = jax.sharding.Mesh(devices, ("fsdp", "tp"))
    sharded = load_hf(str(tmp_path), mesh=mesh)
    q = sharded.layers[0].attn.q[...]
    assert q.sharding.spec == jax.sharding.PartitionSpec("fsdp", "tp", None)
    assert len(q.addressable_shards) == 8 and q.addressable_shards[0].data.shape == (12, 2, 16)
    with jax.set_mesh(mesh):
        got = jax.jit(lambda m, *a: m(*a))(sharded, *map(jnp.asarray, (tokens, positions, mask)))
    np.testing.assert_allclose(
        np.asarray(got), _our_logits(plain, tokens, positions, mask), atol=1e-5, rtol=0
    )
