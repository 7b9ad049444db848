"""The policy model: a Llama/Qwen-family decoder in Flax NNX, its sharding, checkpoints, tokenizers."""

from rl.models.build import create_model, model_shardings, param_count
from rl.models.config import PRESETS, ModelConfig, RopeScaling, get_preset
from rl.models.hf_io import ARCHITECTURES, config_from_hf, config_to_hf, load_hf, save_hf
from rl.models.sharding import DEFAULT_RULES, axis_rules, constrain, logical_to_spec
from rl.models.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer
from rl.models.transformer import KVCache, Transformer, abstract_model, chunked_logprobs

__all__ = [
    "ARCHITECTURES",
    "ByteTokenizer",
    "HFTokenizer",
    "Tokenizer",
    "load_tokenizer",
    "DEFAULT_RULES",
    "PRESETS",
    "KVCache",
    "ModelConfig",
    "RopeScaling",
    "Transformer",
    "abstract_model",
    "axis_rules",
    "chunked_logprobs",
    "config_from_hf",
    "config_to_hf",
    "constrain",
    "create_model",
    "get_preset",
    "load_hf",
    "logical_to_spec",
    "model_shardings",
    "param_count",
    "save_hf",
]
