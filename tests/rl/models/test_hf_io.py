"""load_hf on bad checkpoints (errors name the file or tensor and the problem); round trips."""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from rl.models import (
    ARCHITECTURES,
    PRESETS,
    config_from_hf,
    config_to_hf,
    create_model,
    get_preset,
    load_hf,
    save_hf,
)
from rl.models.hf_io import INDEX_FILE, SINGLE_FILE

Q_PROJ = "model.layers.0.self_attn.q_proj.weight"
DOWN_PROJ = "model.layers.1.mlp.down_proj.weight"


def _raises(exc_type, fn, *needles):
    """Runs fn, asserts it raises exactly exc_type and that the message holds every needle."""
    with pytest.raises(exc_type) as info:
        fn()
    assert type(info.value) is exc_type, f"raised {type(info.value).__name__}: {info.value}"
    msg = str(info.value)
    for needle in needles:
        assert str(needle) in msg, f"{needle!r} not in error message: {msg}"
    return msg


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A valid single-file checkpoint of the tiny preset, written by save_hf (no torch)."""
    path = tmp_path_factory.mktemp("tiny") / "ckpt"
    save_hf(create_model(get_preset("tiny"), seed=0), str(path))
    return path


@pytest.fixture(scope="module")
def sharded_dir(tmp_path_factory):
    """The tiny preset saved in several shards with an index."""
    path = tmp_path_factory.mktemp("sharded") / "ckpt"
    save_hf(create_model(get_preset("tiny"), seed=0), str(path), max_shard_bytes=40_000)
    return path


@pytest.fixture
def ckpt(tiny_dir, tmp_path):
    """A fresh copy of the tiny checkpoint that a test may corrupt."""
    return shutil.copytree(tiny_dir, tmp_path / "ckpt")


@pytest.fixture
def sharded(sharded_dir, tmp_path):
    return shutil.copytree(sharded_dir, tmp_path / "ckpt")


def _edit_config(path, **changes):
    config_path = path / "config.json"
    hf = json.loads(config_path.read_text())
    hf.update(changes)
    config_path.write_text(json.dumps(hf))
    return config_path


def _edit_tensors(path, edit):
    weights = path / SINGLE_FILE
    tensors = load_file(str(weights))
    edit(tensors)
    save_file(tensors, str(weights), metadata={"format": "pt"})


def test_valid_checkpoint_loads(ckpt):
    """Sanity check: the uncorrupted copy the error tests start from loads."""
    model = load_hf(str(ckpt))
    assert model.config == get_preset("tiny")


# ------------------------------------------------------------------------------ directory, config


def test_missing_directory(tmp_path):
    path = tmp_path / "no_such_model"
    _raises(FileNotFoundError, lambda: load_hf(str(path)), str(path), "does not exist")


def test_missing_config(ckpt):
    os.remove(ckpt / "config.json")
    _raises(FileNotFoundError, lambda: load_hf(str(ckpt)), str(ckpt / "config.json"), "not found")


@pytest.mark.parametrize(
    "content",
    [b'{"architectures": ["Qwen3ForCausalLM"],', b"\xff\xfe\x00garbage\x80\x81"],
    ids=["truncated_text", "binary"],
)
def test_config_not_json(ckpt, content):
    (ckpt / "config.json").write_bytes(content)
    _raises(ValueError, lambda: load_hf(str(ckpt)), str(ckpt / "config.json"), "not valid JSON")


def test_config_not_an_object(ckpt):
    (ckpt / "config.json").write_text("[1, 2]")
    _raises(ValueError, lambda: load_hf(str(ckpt)), str(ckpt / "config.json"), "JSON object")


def test_unknown_architecture(ckpt):
    config_path = _edit_config(ckpt, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    msg = _raises(
        ValueError, lambda: load_hf(str(ckpt)), str(config_path), "'GPT2LMHeadModel'", "supported"
    )
    for arch in ARCHITECTURES:
        assert arch in msg, f"supported architecture {arch} not listed in: {msg}"


_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048}


@pytest.mark.parametrize(
    "changes, needles",
    [
        (dict(rope_scaling=_YARN), ["'yarn'", "not supported", "'llama3'"]),
        (dict(rope_parameters={**_YARN, "rope_theta": 1e4}), ["'yarn'", "not supported"]),
        (dict(use_sliding_window=True), ["use_sliding_window", "not supported"]),
        (dict(hidden_act="gelu"), ["hidden_act='gelu'", "not supported", "'silu'"]),
    ],
    ids=["rope_scaling_yarn", "rope_parameters_yarn", "sliding_window", "gelu"],
)
def test_unsupported_config_feature(ckpt, changes, needles):
    config_path = _edit_config(ckpt, **changes)
    _raises(ValueError, lambda: load_hf(str(ckpt)), str(config_path), *needles)


# ----------------------------------------------------------------------------------------- weights


def test_no_weights_file(ckpt):
    os.remove(ckpt / SINGLE_FILE)
    _raises(FileNotFoundError, lambda: load_hf(str(ckpt)), str(ckpt), SINGLE_FILE, INDEX_FILE)


def test_random_bytes_weights(ckpt):
    (ckpt / SINGLE_FILE).write_bytes(np.random.default_rng(0).bytes(4096))
    _raises(ValueError, lambda: load_hf(str(ckpt)), str(ckpt / SINGLE_FILE), "Could not read")


@pytest.mark.parametrize("keep", [lambda n: n - 1, lambda n: n // 2, lambda n: 4, lambda n: 0])
def test_truncated_weights(ckpt, keep):
    weights = ckpt / SINGLE_FILE
    data = weights.read_bytes()
    weights.write_bytes(data[: keep(len(data))])
    _raises(ValueError, lambda: load_hf(str(ckpt)), str(weights), "Could not read")


def test_missing_tensor(ckpt):
    _edit_tensors(ckpt, lambda t: t.pop(Q_PROJ))
    weights = ckpt / SINGLE_FILE
    _raises(ValueError, lambda: load_hf(str(ckpt)), repr(Q_PROJ), "missing", str(weights))


@pytest.mark.parametrize(
    "changes, tensor, got, implied",
    [  # tiny: d_model=64, mlp_dim=128, n_heads=4, n_kv_heads=2, head_dim=16
        (dict(intermediate_size=96), "model.layers.0.mlp.gate_proj.weight", (128, 64), (96, 64)),
        (dict(num_key_value_heads=4), "model.layers.0.self_attn.k_proj.weight", (32, 64), (64, 64)),
    ],
    ids=["intermediate_size", "num_key_value_heads"],
)
def test_config_weight_shape_mismatch(ckpt, changes, tensor, got, implied):
    config_path = _edit_config(ckpt, **changes)
    load = lambda: load_hf(str(ckpt))
    _raises(ValueError, load, repr(tensor), str(got), str(implied), str(config_path))


@pytest.mark.parametrize("bad", [np.nan, np.inf], ids=["nan", "inf"])
def test_non_finite_tensor(ckpt, bad):
    def poison(tensors):
        tensors[DOWN_PROJ][3, 5] = bad

    _edit_tensors(ckpt, poison)
    _raises(ValueError, lambda: load_hf(str(ckpt)), repr(DOWN_PROJ), "NaN or inf", str(ckpt))


# ----------------------------------------------------------------------------------------- sharded


def test_sharded_checkpoint_loads(sharded):
    """Sanity check: the sharded fixture has several shards and loads."""
    index = json.loads((sharded / INDEX_FILE).read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert load_hf(str(sharded)).config == get_preset("tiny")


def test_index_names_missing_shard(sharded):
    index = json.loads((sharded / INDEX_FILE).read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]
    os.remove(sharded / shard)
    _raises(
        FileNotFoundError, lambda: load_hf(str(sharded)), str(sharded / shard), INDEX_FILE, "not"
    )


def test_index_without_weight_map(sharded):
    (sharded / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": 1}}))
    _raises(ValueError, lambda: load_hf(str(sharded)), str(sharded / INDEX_FILE), "'weight_map'")


def test_index_not_json(sharded):
    (sharded / INDEX_FILE).write_text("{")
    _raises(ValueError, lambda: load_hf(str(sharded)), str(sharded / INDEX_FILE), "not valid JSON")


# ---------------------------------------------------------------------------- positive round trips


@pytest.mark.parametrize("name", sorted(PRESETS))
@pytest.mark.parametrize("param_dtype", ["float32", "bfloat16"])
def test_config_round_trip(name, param_dtype):
    cfg = PRESETS[name].replace(param_dtype=param_dtype)
    hf = config_to_hf(cfg)
    assert hf["torch_dtype"] == param_dtype
    assert config_from_hf(hf) == cfg
    assert config_from_hf(json.loads(json.dumps(hf))) == cfg  # as written to config.json


def _new_rope_format(hf):
    """`hf` (legacy: top-level rope_theta, rope_scaling) rewritten with rope_parameters."""
    hf = dict(hf)
    rope = {"rope_type": "default", "rope_theta": hf.pop("rope_theta")}
    rope.update(hf.pop("rope_scaling") or {})
    return {**hf, "rope_parameters": rope}


@pytest.mark.parametrize("name", ["llama-3.1-8b", "llama-3.2-1b", "qwen3-8b", "qwen2.5-7b"])
def test_legacy_and_new_rope_formats_agree(name):
    cfg = PRESETS[name]
    legacy = config_to_hf(cfg)
    if cfg.rope_scaling is not None:
        assert legacy["rope_scaling"]["rope_type"] == "llama3"
    assert "rope_theta" in legacy and "rope_parameters" not in legacy
    new = _new_rope_format(legacy)
    assert "rope_theta" not in new and "rope_scaling" not in new
    assert config_from_hf(new) == config_from_hf(legacy) == cfg


def test_legacy_rope_scaling_type_key():
    """Older configs spell the key `type` instead of `rope_type`."""
    cfg = PRESETS["llama-3.1-8b"]
    hf = config_to_hf(cfg)
    hf["rope_scaling"]["type"] = hf["rope_scaling"].pop("rope_type")
    assert config_from_hf(hf) == cfg


def test_bf16_round_trip(tmp_path):
    model = create_model(get_preset("tiny", family="llama", qk_norm=False), seed=1)
    save_hf(model, str(tmp_path), dtype="bfloat16")
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    loaded = load_hf(str(tmp_path))
    assert loaded.config == model.config.replace(param_dtype="bfloat16")
    want = dict(nnx.to_flat_state(nnx.state(model)))
    got = dict(nnx.to_flat_state(nnx.state(loaded)))
    assert got.keys() == want.keys()
    for path, var in want.items():
        g = got[path].get_value()
        assert g.dtype == jnp.bfloat16, path
        w = var.get_value().astype(jnp.bfloat16)
        np.testing.assert_array_equal(
            np.asarray(jax.device_get(g)).view(np.uint16),  # bitwise: a bf16 cast is exact
            np.asarray(jax.device_get(w)).view(np.uint16),
            err_msg=str(path),
        )
