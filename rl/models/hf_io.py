"""Hugging Face checkpoint I/O: local directories in, local directories out, never a hub.

`load_hf` reads config.json and model.safetensors (or a sharded model.safetensors.index.json) and
places each tensor straight onto its mesh sharding, one tensor at a time: a device receives only
its own slice (`jax.make_array_from_callback`), and the host holds one tensor at a time.
`save_hf` writes a directory that `transformers.AutoModelForCausalLM.from_pretrained` loads.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import nnx
from jax.sharding import Mesh
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from rl.models.config import DTYPES, ModelConfig, RopeScaling
from rl.models.lora import merge_adapters
from rl.models.sharding import Rules, tree_shardings
from rl.models.transformer import Transformer, abstract_model

ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
_FAMILY_TO_ARCH = {v: k for k, v in ARCHITECTURES.items()}
_TORCH_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


# ----------------------------------------------------------------------------------------- config


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} not found; a Hugging Face model directory needs it.")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(
            f"{path} holds a JSON {type(data).__name__}; expected a JSON object at the top level."
        )
    return data


def config_from_hf(
    hf: dict[str, Any], *, source: str = "config.json", **overrides: Any
) -> ModelConfig:
    """ModelConfig from a Hugging Face config dict; `overrides` replace fields (e.g. dtype)."""
    archs = hf.get("architectures") or []
    if not archs:
        raise ValueError(
            f"{source} has no 'architectures' field; expected one of {sorted(ARCHITECTURES)}."
        )
    arch = archs[0]
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"{source}: unsupported architecture {arch!r} (model_type {hf.get('model_type')!r}); "
            f"supported: {sorted(ARCHITECTURES)}."
        )
    family = ARCHITECTURES[arch]

    def need(key: str) -> Any:
        if key not in hf:
            raise ValueError(f"{source}: missing required field {key!r} for {arch}.")
        return hf[key]

    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(
            f"{source}: hidden_act={hf['hidden_act']!r} is not supported; expected 'silu'."
        )
    if hf.get("mlp_bias", False):
        raise ValueError(f"{source}: mlp_bias=true is not supported.")
    if hf.get("use_sliding_window", False):
        raise ValueError(
            f"{source}: use_sliding_window=true is not supported (full attention only)."
        )
    rope = dict(hf.get("rope_parameters") or {})
    legacy = hf.get("rope_scaling") or {}
    rope = {**legacy, **rope}
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type in (None, "default"):
        scaling = None
    elif rope_type == "llama3":
        scaling = RopeScaling(
            factor=float(rope["factor"]),
            low_freq_factor=float(rope["low_freq_factor"]),
            high_freq_factor=float(rope["high_freq_factor"]),
            original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
        )
    else:
        raise ValueError(
            f"{source}: rope_type {rope_type!r} is not supported; expected 'default' or 'llama3'."
        )
    heads = need("num_attention_heads")
    attention_bias = bool(hf.get("attention_bias", False))
    torch_dtype = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    fields: dict[str, Any] = dict(
        family=family,
        vocab_size=need("vocab_size"),
        d_model=need("hidden_size"),
        n_layers=need("num_hidden_layers"),
        n_heads=heads,
        n_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or need("hidden_size") // heads,
        mlp_dim=need("intermediate_size"),
        rms_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=float(theta),
        rope_scaling=scaling,
        max_position_embeddings=hf.get("max_position_embeddings", 32768),
        qkv_bias=True if family == "qwen2" else attention_bias,
        o_bias=False if family == "qwen2" else attention_bias,
        qk_norm=family == "qwen3",
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        param_dtype=_TORCH_DTYPES.get(str(torch_dtype), "float32"),
    )
    fields.update(overrides)
    return ModelConfig(**fields)


def config_to_hf(cfg: ModelConfig, *, dtype: str | None = None) -> dict[str, Any]:
    """A Hugging Face config dict for `cfg` (what config.json holds)."""
    hf: dict[str, Any] = {
        "architectures": [_FAMILY_TO_ARCH[cfg.family]],
        "model_type": cfg.family,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.mlp_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_embeddings,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "torch_dtype": dtype or cfg.param_dtype,
    }
    if cfg.rope_scaling is not None:
        hf["rope_scaling"] = {"rope_type": "llama3", **dataclasses.asdict(cfg.rope_scaling)}
    if cfg.family == "qwen2":
        if not cfg.qkv_bias or cfg.o_bias:
            raise ValueError(
                "A qwen2 checkpoint has q/k/v biases and no o_proj bias; the config differs."
            )
        hf["use_sliding_window"] = False
    else:
        if cfg.qkv_bias != cfg.o_bias:
            raise ValueError(f"{cfg.family}: attention_bias puts biases on q, k, v and o together.")
        hf["attention_bias"] = cfg.qkv_bias
    if cfg.qk_norm != (cfg.family == "qwen3"):
        raise ValueError(
            f"qk_norm={cfg.qk_norm} does not match family {cfg.family!r} (only qwen3 has it)."
        )
    return hf


# ---------------------------------------------------------------------------------------- weights


@dataclasses.dataclass(frozen=True)
class _Entry:
    path: tuple[Any, ...]  # nnx state path
    name: str  # Hugging Face tensor name
    to_ours: Callable[[np.ndarray], np.ndarray]
    to_hf: Callable[[np.ndarray], np.ndarray]


def _weight_map(cfg: ModelConfig) -> list[_Entry]:
    d, n, k, h = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    same = lambda x: x
    transpose = lambda x: x.T

    def heads_in(heads: int) -> Callable[[np.ndarray], np.ndarray]:  # (heads*h, d) -> (d, heads, h)
        return lambda x: x.T.reshape(d, heads, h)

    def heads_bias(heads: int) -> Callable[[np.ndarray], np.ndarray]:
        return lambda x: x.reshape(heads, h)

    flat_in = lambda x: x.reshape(d, -1).T  # (d, heads, h) -> (heads*h, d)
    flat = lambda x: x.reshape(-1)
    out = [
        _Entry(("embed",), "model.embed_tokens.weight", same, same),
        _Entry(("final_norm", "scale"), "model.norm.weight", same, same),
    ]
    if not cfg.tie_embeddings:
        out.append(_Entry(("lm_head",), "lm_head.weight", transpose, transpose))
    for i in range(cfg.n_layers):
        p, a = f"model.layers.{i}.", ("layers", i)
        out += [
            _Entry((*a, "attn_norm", "scale"), p + "input_layernorm.weight", same, same),
            _Entry((*a, "mlp_norm", "scale"), p + "post_attention_layernorm.weight", same, same),
            _Entry((*a, "attn", "q"), p + "self_attn.q_proj.weight", heads_in(n), flat_in),
            _Entry((*a, "attn", "k"), p + "self_attn.k_proj.weight", heads_in(k), flat_in),
            _Entry((*a, "attn", "v"), p + "self_attn.v_proj.weight", heads_in(k), flat_in),
            _Entry(
                (*a, "attn", "o"),
                p + "self_attn.o_proj.weight",
                lambda x: x.T.reshape(n, h, d),
                lambda x: x.reshape(n * h, d).T,
            ),
            _Entry((*a, "mlp", "gate"), p + "mlp.gate_proj.weight", transpose, transpose),
            _Entry((*a, "mlp", "up"), p + "mlp.up_proj.weight", transpose, transpose),
            _Entry((*a, "mlp", "down"), p + "mlp.down_proj.weight", transpose, transpose),
        ]
        if cfg.qkv_bias:
            out += [
                _Entry((*a, "attn", "q_bias"), p + "self_attn.q_proj.bias", heads_bias(n), flat),
                _Entry((*a, "attn", "k_bias"), p + "self_attn.k_proj.bias", heads_bias(k), flat),
                _Entry((*a, "attn", "v_bias"), p + "self_attn.v_proj.bias", heads_bias(k), flat),
            ]
        if cfg.o_bias:
            out.append(_Entry((*a, "attn", "o_bias"), p + "self_attn.o_proj.bias", same, same))
        if cfg.qk_norm:
            out += [
                _Entry((*a, "attn", "q_norm", "scale"), p + "self_attn.q_norm.weight", same, same),
                _Entry((*a, "attn", "k_norm", "scale"), p + "self_attn.k_norm.weight", same, same),
            ]
    return out


class _TensorReader:
    """Reads named tensors from one safetensors file or a sharded index, one at a time."""

    def __init__(self, path: str):
        single, index = os.path.join(path, SINGLE_FILE), os.path.join(path, INDEX_FILE)
        self.index = index
        if os.path.isfile(index):
            weight_map = _read_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ValueError(
                    f"{index} has no 'weight_map' object mapping tensor names to files."
                )
            self.files = {name: os.path.join(path, f) for name, f in weight_map.items()}
        elif os.path.isfile(single):
            self.files = None
            self.single = single
        else:
            raise FileNotFoundError(
                f"No weights in {path}: expected {SINGLE_FILE} or {INDEX_FILE}."
            )
        self._handles: dict[str, Any] = {}

    def _open(self, file: str) -> Any:
        if file not in self._handles:
            if not os.path.isfile(file):
                raise FileNotFoundError(
                    f"Safetensors shard {file} (named in {INDEX_FILE}) does not exist."
                )
            try:
                self._handles[file] = safe_open(file, framework="numpy")
            except (SafetensorError, OSError, ValueError) as e:
                raise ValueError(f"Could not read safetensors file {file}: {e}") from e
        return self._handles[file]

    def names(self) -> set[str]:
        if self.files is not None:
            return set(self.files)
        return set(self._open(self.single).keys())

    def read(self, name: str) -> np.ndarray:
        file = self.single if self.files is None else self.files.get(name)
        if file is None or name not in self._open(file).keys():
            raise ValueError(
                f"Tensor {name!r} is missing from the checkpoint ({file or INDEX_FILE})."
            )
        try:
            return self._open(file).get_tensor(name)
        except (SafetensorError, OSError, ValueError) as e:
            raise ValueError(f"Could not read tensor {name!r} from {file}: {e}") from e


def hf_config(path: str, **overrides: Any) -> ModelConfig:
    """The ModelConfig of a local Hugging Face directory (its config.json), with `overrides`."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"Model directory {path!r} does not exist.")
    config_path = os.path.join(path, "config.json")
    return config_from_hf(_read_json(config_path), source=config_path, **overrides)


def load_hf(
    path: str, *, mesh: Mesh | None = None, rules: Rules | None = None, **overrides: Any
) -> Transformer:
    """Loads a local Hugging Face checkpoint directory into a Transformer.

    Args:
      path: directory with config.json and model.safetensors (or model.safetensors.index.json).
      mesh: if given, each parameter is placed directly with its NamedSharding on this mesh.
      rules: logical-axis rules (default rl.models.sharding.DEFAULT_RULES).
      **overrides: ModelConfig fields to replace, e.g. param_dtype="float32", dtype="bfloat16".

    Returns:
      The model; `model.config` is the parsed ModelConfig.
    """
    cfg = hf_config(path, **overrides)
    config_path = os.path.join(path, "config.json")
    reader = _TensorReader(path)
    graphdef, abstract_state = nnx.split(abstract_model(cfg))
    shardings = (
        nnx.to_flat_state(tree_shardings(abstract_state, mesh, rules)) if mesh is not None else None
    )
    shardings = dict(shardings) if shardings is not None else None
    flat = dict(nnx.to_flat_state(abstract_state))
    entries = _weight_map(cfg)
    for e in entries:
        var = flat[e.path]
        raw = reader.read(e.name)
        # The shape config.json implies, in the checkpoint's layout (a zero-stride view, no memory).
        expected = e.to_hf(np.broadcast_to(np.zeros((), np.int8), var.get_value().shape)).shape
        if raw.shape != expected:
            raise ValueError(
                f"{path}: tensor {e.name!r} has shape {tuple(raw.shape)}, but {config_path} "
                f"implies {tuple(expected)}."
            )
        arr = e.to_ours(raw)
        if not np.isfinite(arr).all():
            raise ValueError(f"{path}: tensor {e.name!r} contains NaN or inf.")
        arr = arr.astype(var.get_value().dtype)
        if shardings is None:
            value = jnp.asarray(arr)
        else:
            value = jax.make_array_from_callback(
                arr.shape, shardings[e.path].get_value(), lambda idx, a=arr: a[idx]
            )
        flat[e.path] = var.replace(value)
    unused = reader.names() - {e.name for e in entries} - {"lm_head.weight"}
    if unused:
        logging.warning(
            "%s: ignoring %d checkpoint tensors, e.g. %s", path, len(unused), sorted(unused)[:3]
        )
    return nnx.merge(graphdef, nnx.from_flat_state(list(flat.items())))


def _to_host(x: jax.Array) -> np.ndarray:
    if not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))


def _plan_files(
    entries: list[_Entry], flat: dict[Any, Any], itemsize: int, max_bytes: int
) -> list[list[_Entry]]:
    """Groups tensors into files of at most `max_bytes` (a larger single tensor gets its own file)."""
    files: list[list[_Entry]] = [[]]
    size = 0
    for e in entries:
        nbytes = int(np.prod(flat[e.path].get_value().shape)) * itemsize
        if files[-1] and size + nbytes > max_bytes:
            files.append([])
            size = 0
        files[-1].append(e)
        size += nbytes
    return files


def save_hf(
    model: Transformer,
    path: str,
    *,
    dtype: str | None = None,
    max_shard_bytes: int = 5 * 2**30,
    extra_config: dict[str, Any] | None = None,
) -> None:
    """Writes `model` as a Hugging Face directory (config.json + safetensors, sharded past max_shard_bytes).

    Args:
      model: the model (sharded or not); LoRA adapters are merged into their weights.
      path: output directory (created).
      dtype: tensor dtype on disk (default: the model's param dtype).
      max_shard_bytes: size bound of one safetensors file.
      extra_config: entries merged into config.json (e.g. bos_token_id, eos_token_id).
    """
    model = merge_adapters(model)
    cfg = model.config
    dtype = dtype or cfg.param_dtype
    if dtype not in DTYPES:
        raise ValueError(f"save_hf dtype={dtype!r}; expected one of {tuple(DTYPES)}.")
    hf = {**config_to_hf(cfg, dtype=dtype), **(extra_config or {})}
    flat = dict(nnx.to_flat_state(nnx.state(model)))
    entries = _weight_map(cfg)
    np_dtype = np.dtype(DTYPES[dtype])
    files = _plan_files(entries, flat, np_dtype.itemsize, max_shard_bytes)
    writer = jax.process_index() == 0  # every process takes part in the gathers; one writes
    if writer:
        os.makedirs(path, exist_ok=True)
    weight_map: dict[str, str] = {}
    for i, group in enumerate(files):
        tensors = {
            e.name: np.ascontiguousarray(
                e.to_hf(_to_host(flat[e.path].get_value())).astype(np_dtype)
            )
            for e in group
        }
        name = (
            SINGLE_FILE if len(files) == 1 else f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        )
        if writer:
            save_file(tensors, os.path.join(path, name), metadata={"format": "pt"})
        weight_map.update({k: name for k in tensors})
    if not writer:
        return
    if len(files) > 1:
        total = sum(
            int(np.prod(flat[e.path].get_value().shape)) * np_dtype.itemsize for e in entries
        )
        with open(os.path.join(path, INDEX_FILE), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f, indent=2)
