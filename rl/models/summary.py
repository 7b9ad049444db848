"""A model check a user runs first: build from config, print its size, run both call paths once."""

from __future__ import annotations

import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rl.models.build import build_model, param_count
from rl.models.sharding import normalize_rules
from rl.models.tokenizer import Tokenizer, load_tokenizer


def tokenizer_from(config: Any) -> Tokenizer:
    """The tokenizer a config names: `config.tokenizer`, else the model's local HF directory."""
    spec = config.tokenizer or config.model.hf_path
    if not spec:
        raise ValueError(
            "config.tokenizer and config.model.hf_path are both empty; expected config.tokenizer="
            "'byte' or a local tokenizer directory, or a model.hf_path that holds tokenizer.json."
        )
    return load_tokenizer(spec)


def summarize(config: Any, *, new_tokens: int = 8) -> dict[str, Any]:
    """Builds the configured model and tokenizer, runs a forward pass and a short greedy decode.

    Returns:
      A dict with the parameter count, the prompt's mean token log-prob under the full forward,
      the greedy continuation (through the KV-cache decode path) and the wall time.
    """
    start = time.perf_counter()
    tokenizer = tokenizer_from(config)
    model = build_model(config.model, seed=config.seed)
    cfg = model.config
    if tokenizer.vocab_size > cfg.vocab_size:
        raise ValueError(
            f"Tokenizer vocabulary ({tokenizer.vocab_size}) is larger than the model's "
            f"vocab_size ({cfg.vocab_size}); they must come from the same model."
        )
    normalize_rules(config.sharding_rules)
    ids = tokenizer.encode(config.prompt, add_bos=tokenizer.bos_id is not None)
    t = len(ids)
    tokens = jnp.asarray([ids], jnp.int32)
    positions = jnp.arange(t)[None]
    logp = jax.jit(
        lambda m, x, p: m.token_logprobs(x[:, :-1], p[:, :-1], jnp.ones_like(x[:, :-1]), x[:, 1:])
    )(model, tokens, positions)

    @jax.jit
    def step(m: Any, x: jax.Array, p: jax.Array, cache: Any) -> tuple[jax.Array, Any]:
        h, cache = m.decode(x, p, cache)
        return jnp.argmax(m.logits(h[:, -1:]), axis=-1), cache

    cache = model.init_cache(1, t + new_tokens)
    nxt, cache = step(model, tokens, positions, cache)
    out = [int(nxt[0, 0])]
    for i in range(new_tokens - 1):
        nxt, cache = step(model, nxt, jnp.full((1, 1), t + i), cache)
        out.append(int(nxt[0, 0]))
    n = param_count(model)
    return {
        "family": cfg.family,
        "params": n,
        "param_bytes": n * jnp.dtype(cfg.jnp_param_dtype).itemsize,
        "layers": cfg.n_layers,
        "d_model": cfg.d_model,
        "vocab_size": cfg.vocab_size,
        "devices": jax.device_count(),
        "prompt_tokens": t,
        "mean_logprob": float(np.mean(np.asarray(logp))),
        "greedy_continuation": tokenizer.decode(out),
        "seconds": time.perf_counter() - start,
    }
