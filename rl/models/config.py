"""Model configuration: one frozen dataclass for the Llama 3.x / Qwen2 / Qwen3 decoder family, and presets."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import jax.numpy as jnp

Family = Literal["llama", "qwen2", "qwen3"]
FAMILIES: tuple[str, ...] = ("llama", "qwen2", "qwen3")
REMAT_POLICIES: tuple[str, ...] = ("none", "full", "dots")
DTYPES: dict[str, Any] = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """Llama-3 style RoPE frequency scaling (`rope_type: llama3` in Hugging Face configs)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self):
        if self.factor < 1.0 or self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                f"Invalid llama3 rope scaling: received factor={self.factor}, low_freq_factor="
                f"{self.low_freq_factor}, high_freq_factor={self.high_freq_factor}; expected factor >= 1"
                " and high_freq_factor > low_freq_factor."
            )


LORA_TARGETS: tuple[str, ...] = ("q", "k", "v", "o", "gate", "up", "down")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoraConfig:
    """Low-rank adapters (LoRA) on the projections named in `targets`: each weight W becomes
    W + (alpha / rank) * A @ B with A (in, rank) and B (rank, out); B starts at zero, so the model
    starts as its base (rl/models/lora.py)."""

    rank: int
    alpha: float = 16.0
    targets: tuple[str, ...] = LORA_TARGETS

    def __post_init__(self):
        if not isinstance(self.rank, int) or self.rank <= 0:
            raise ValueError(f"LoRA rank must be a positive integer; received {self.rank!r}.")
        if not self.alpha > 0:
            raise ValueError(f"LoRA alpha must be > 0; received {self.alpha!r}.")
        unknown = [t for t in self.targets if t not in LORA_TARGETS]
        if unknown or not self.targets or len(set(self.targets)) != len(self.targets):
            raise ValueError(
                f"LoRA targets {tuple(self.targets)!r}; expected distinct names among "
                f"{LORA_TARGETS} (attention q/k/v/o, MLP gate/up/down)."
            )

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shapes and numerics of a decoder-only transformer.

    `family` fixes the layer details that differ between Hugging Face architectures (attention
    biases, q/k norms) and is what the checkpoint writer names as the architecture.
    """

    family: Family = "qwen3"  # llama | qwen2 | qwen3
    vocab_size: int
    d_model: int  # hidden_size
    n_layers: int
    n_heads: int  # query heads
    n_kv_heads: int  # key/value heads (grouped-query attention)
    head_dim: int
    mlp_dim: int  # intermediate_size of the SwiGLU MLP
    rms_eps: float = 1e-6
    rope_theta: float = 1e6
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 32768
    qkv_bias: bool = False  # Qwen2/2.5: bias on q, k, v projections
    o_bias: bool = False  # Llama `attention_bias=True` also puts a bias on o_proj
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    tie_embeddings: bool = False  # lm_head shares the token embedding matrix
    param_dtype: str = "float32"  # storage dtype of parameters
    dtype: str = "float32"  # compute dtype of activations (logits and softmax stay float32)
    remat: str = "none"  # per-layer rematerialisation: none | full | dots (save matmul outputs)
    logits_chunk: int = 512  # sequence chunk for log-prob computation (bounds B*chunk*V memory)
    init_std: float = 0.02  # normal init std for freshly created weights
    lora: LoraConfig | None = None  # low-rank adapters: only they train (rl/models/lora.py)

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"Unknown model family {self.family!r}; expected one of {FAMILIES}.")
        for name in (
            "vocab_size",
            "d_model",
            "n_layers",
            "n_heads",
            "n_kv_heads",
            "head_dim",
            "mlp_dim",
            "max_position_embeddings",
            "logits_chunk",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(
                    f"ModelConfig.{name} must be positive; received {getattr(self, name)}."
                )
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.n_kv_heads}) for "
                "grouped-query attention."
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE; received {self.head_dim}.")
        for name in ("param_dtype", "dtype"):
            if getattr(self, name) not in DTYPES:
                raise ValueError(
                    f"ModelConfig.{name}={getattr(self, name)!r}; expected one of {tuple(DTYPES)}."
                )
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"ModelConfig.remat={self.remat!r}; expected one of {REMAT_POLICIES}.")

    @property
    def jnp_param_dtype(self) -> Any:
        return DTYPES[self.param_dtype]

    @property
    def jnp_dtype(self) -> Any:
        return DTYPES[self.dtype]

    def replace(self, **kwargs: Any) -> ModelConfig:
        return dataclasses.replace(self, **kwargs)

    def num_params(self) -> int:
        """Parameter count (embeddings counted once when tied)."""
        d, h = self.d_model, self.head_dim
        attn = d * h * (2 * self.n_heads + 2 * self.n_kv_heads)
        attn += (self.n_heads + 2 * self.n_kv_heads) * h if self.qkv_bias else 0
        attn += d if self.o_bias else 0
        attn += 2 * h if self.qk_norm else 0
        layer = attn + 3 * d * self.mlp_dim + 2 * d
        embed = self.vocab_size * d * (1 if self.tie_embeddings else 2)
        return self.n_layers * layer + embed + d


def _qwen3(**kw: Any) -> ModelConfig:
    return ModelConfig(
        family="qwen3",
        vocab_size=151936,
        head_dim=128,
        qk_norm=True,
        rms_eps=1e-6,
        rope_theta=1e6,
        max_position_embeddings=40960,
        **kw,
    )


def _qwen25(**kw: Any) -> ModelConfig:
    kw.setdefault("vocab_size", 151936)
    return ModelConfig(
        family="qwen2",
        qkv_bias=True,
        rms_eps=1e-6,
        rope_theta=1e6,
        max_position_embeddings=32768,
        **kw,
    )


def _llama3(*, factor: float, **kw: Any) -> ModelConfig:
    scaling = RopeScaling(
        factor=factor,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    )
    return ModelConfig(
        family="llama",
        vocab_size=128256,
        rms_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=scaling,
        max_position_embeddings=131072,
        **kw,
    )


# Shapes only: weights come from the user's local Hugging Face directory (rl.models.load_hf).
PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(
        family="qwen3",
        vocab_size=259,
        d_model=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        mlp_dim=128,
        qk_norm=True,
        tie_embeddings=True,
        max_position_embeddings=2048,
        rope_theta=10000.0,
    ),
    "qwen3-0.6b": _qwen3(
        d_model=1024, n_layers=28, n_heads=16, n_kv_heads=8, mlp_dim=3072, tie_embeddings=True
    ),
    "qwen3-1.7b": _qwen3(
        d_model=2048, n_layers=28, n_heads=16, n_kv_heads=8, mlp_dim=6144, tie_embeddings=True
    ),
    "qwen3-4b": _qwen3(
        d_model=2560, n_layers=36, n_heads=32, n_kv_heads=8, mlp_dim=9728, tie_embeddings=True
    ),
    "qwen3-8b": _qwen3(d_model=4096, n_layers=36, n_heads=32, n_kv_heads=8, mlp_dim=12288),
    "qwen2.5-0.5b": _qwen25(
        d_model=896,
        n_layers=24,
        n_heads=14,
        n_kv_heads=2,
        head_dim=64,
        mlp_dim=4864,
        tie_embeddings=True,
    ),
    "qwen2.5-1.5b": _qwen25(
        d_model=1536,
        n_layers=28,
        n_heads=12,
        n_kv_heads=2,
        head_dim=128,
        mlp_dim=8960,
        tie_embeddings=True,
    ),
    "qwen2.5-3b": _qwen25(
        d_model=2048,
        n_layers=36,
        n_heads=16,
        n_kv_heads=2,
        head_dim=128,
        mlp_dim=11008,
        tie_embeddings=True,
    ),
    "qwen2.5-7b": _qwen25(
        vocab_size=152064,
        d_model=3584,
        n_layers=28,
        n_heads=28,
        n_kv_heads=4,
        head_dim=128,
        mlp_dim=18944,
    ),
    "llama-3.2-1b": _llama3(
        factor=32.0,
        d_model=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        head_dim=64,
        mlp_dim=8192,
        tie_embeddings=True,
    ),
    "llama-3.2-3b": _llama3(
        factor=32.0,
        d_model=3072,
        n_layers=28,
        n_heads=24,
        n_kv_heads=8,
        head_dim=128,
        mlp_dim=8192,
        tie_embeddings=True,
    ),
    "llama-3.1-8b": _llama3(
        factor=8.0, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128, mlp_dim=14336
    ),
}


def get_preset(name: str, **overrides: Any) -> ModelConfig:
    """Returns the named preset with `overrides` applied (e.g. dtype="bfloat16")."""
    if name not in PRESETS:
        raise ValueError(f"Unknown model preset {name!r}; expected one of {sorted(PRESETS)}.")
    return PRESETS[name].replace(**overrides)
