"""Creating a Transformer on a device mesh: fresh, or from a config (a preset or local HF weights)."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh

from rl.models.config import ModelConfig, get_preset
from rl.models.hf_io import hf_config, load_hf
from rl.models.lora import add_adapters, lora_config_from
from rl.models.sharding import Rules, tree_shardings
from rl.models.transformer import Transformer, abstract_model


def model_shardings(cfg: ModelConfig, mesh: Mesh, rules: Rules | None = None) -> Any:
    """An nnx State of NamedShardings matching `nnx.state(model)` for `cfg` on `mesh`."""
    return tree_shardings(nnx.state(abstract_model(cfg)), mesh, rules)


def create_model(
    cfg: ModelConfig, *, seed: int = 0, mesh: Mesh | None = None, rules: Rules | None = None
) -> Transformer:
    """A freshly initialised model; with `mesh`, each parameter is created already sharded."""
    graphdef, init = _initializer(cfg, mesh, rules)
    return nnx.merge(graphdef, init(jax.random.key(seed)))


@functools.lru_cache(maxsize=8)
def _initializer(cfg: ModelConfig, mesh: Mesh | None, rules: Rules | None) -> tuple[Any, Any]:
    """(graphdef, jitted init: key -> state) for one config and layout.

    One compiled program instead of eager op-by-op init, shared by every seed (the key is an
    argument, not a constant) and by every model of this config the process creates; with a mesh
    each parameter is created already sharded (no replicated copy first).
    """
    graphdef, abstract_state = nnx.split(abstract_model(cfg))

    def init(key: jax.Array) -> Any:
        return nnx.state(Transformer(cfg, rngs=nnx.Rngs(key)))

    out = {} if mesh is None else dict(out_shardings=tree_shardings(abstract_state, mesh, rules))
    return graphdef, jax.jit(init, **out)


def param_count(model: Transformer) -> int:
    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def model_config_from(model_cfg: Mapping[str, Any]) -> ModelConfig:
    """The typed ModelConfig for a `config.model` ConfigDict (preset + overrides, no weights)."""
    overrides = {k: model_cfg[k] for k in _OVERRIDABLE if k in model_cfg}
    overrides["lora"] = lora_config_from(model_cfg.get("lora"))
    if model_cfg.get("hf_path"):
        return hf_config(model_cfg["hf_path"], **overrides)
    shape = {k: model_cfg[k] for k in _SHAPE_FIELDS if model_cfg.get(k)}
    tie = model_cfg.get("tie_embeddings", "preset")
    if tie not in _TIE:
        raise ValueError(
            f"config.model.tie_embeddings={tie!r}; expected one of {tuple(_TIE)} (the output head "
            "shares the token embedding: as the preset says, always, or never)."
        )
    if _TIE[tie] is not None:
        shape["tie_embeddings"] = _TIE[tie]
    init_std = model_cfg.get("init_std", 0.0)
    if not isinstance(init_std, (int, float)) or init_std < 0:
        raise ValueError(
            f"config.model.init_std must be a number >= 0 (0: the preset's); received {init_std!r}."
        )
    if init_std:
        shape["init_std"] = float(init_std)
    return get_preset(model_cfg["preset"], **overrides, **shape)


def build_model(
    model_cfg: Mapping[str, Any],
    *,
    seed: int = 0,
    mesh: Mesh | None = None,
    rules: Rules | None = None,
) -> Transformer:
    """The model a `config.model` ConfigDict names: local HF weights if `hf_path`, else a fresh
    init; with `lora`, adapters on top (the base is the same as without them)."""
    cfg = model_config_from(model_cfg)
    if model_cfg.get("hf_path"):
        overrides = {k: model_cfg[k] for k in _OVERRIDABLE if k in model_cfg}
        base = load_hf(model_cfg["hf_path"], mesh=mesh, rules=rules, **overrides)
    else:
        base = create_model(cfg.replace(lora=None), seed=seed, mesh=mesh, rules=rules)
    if cfg.lora is None:
        return base
    return add_adapters(base, cfg.lora, seed=seed, mesh=mesh, rules=rules)


# ConfigDict fields applied on top of a preset or checkpoint config.
_OVERRIDABLE = ("param_dtype", "dtype", "remat", "logits_chunk")
# Shape fields a preset may be changed in (0 or absent: keep the preset's).
_SHAPE_FIELDS = ("d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "mlp_dim")
# config.model.tie_embeddings -> ModelConfig.tie_embeddings (None: the preset's); presets only.
_TIE = {"preset": None, "tied": True, "untied": False}
