"""The two call paths of the Transformer agree with each other and with plain references."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rl.models import ModelConfig, create_model, get_preset, param_count
from rl.models.attention import attend, attend_full, query_blocks
from rl.models.transformer import chunked_logprobs

DECODE_TOL = 1e-5  # float32, cached decode vs full forward
TOL = 1e-5

# Jitted entry points: eager op-by-op dispatch compiles every primitive and is slow on CPU.
fwd = jax.jit(lambda m, tokens, positions, segs: m(tokens, positions, segs))
logprobs = jax.jit(
    lambda m, tokens, positions, segs, targets, temperature: m.token_logprobs(
        tokens, positions, segs, targets, temperature=temperature, with_entropy=True
    ),
    static_argnums=5,
)


def _cfg(**kw) -> ModelConfig:
    return get_preset("tiny", **kw)


def _inputs(cfg: ModelConfig, b: int = 3, t: int = 12, seed: int = 0):
    tokens = jax.random.randint(jax.random.key(seed), (b, t), 0, cfg.vocab_size)
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    return tokens, positions, jnp.ones((b, t), jnp.int32)


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        dict(family="qwen2", qk_norm=False, qkv_bias=True, tie_embeddings=False),
        dict(family="llama", qk_norm=False, rope_theta=500000.0),
    ],
)
def test_cached_decode_matches_full_forward_position_by_position(overrides):
    cfg = _cfg(**overrides)
    model = create_model(cfg, seed=1)
    tokens, positions, segs = _inputs(cfg)
    full = fwd(model, tokens, positions, segs)
    # Rows prefill different prompt lengths (as slots do), padded to one bucket of 8, then decode
    # one token per step; each row's logits at each position must equal the full forward.
    prompt_len = np.array([3, 5, 8])
    cache = model.init_cache(3, 16)
    step = jax.jit(lambda m, tok, p, c: (lambda h, c: (m.logits(h), c))(*m.decode(tok, p, c)))
    logits, cache = step(model, tokens[:, :8], positions[:, :8], cache)
    got = {(b, int(prompt_len[b]) - 1): logits[b, prompt_len[b] - 1] for b in range(3)}
    pos = jnp.asarray(prompt_len)
    while int(pos.min()) < 12:
        p = jnp.minimum(pos, 11)
        tok = jnp.take_along_axis(tokens, p[:, None], axis=1)
        logits, cache = step(model, tok, p[:, None], cache)
        for b in range(3):
            if int(pos[b]) < 12:
                got[(b, int(pos[b]))] = logits[b, 0]
        pos = pos + 1
    assert len(got) == 3 * 12 - int(prompt_len.sum()) + 3
    for (b, t), v in got.items():
        np.testing.assert_allclose(
            v, full[b, t], atol=DECODE_TOL, rtol=0, err_msg=f"row {b} pos {t}"
        )


def test_padding_does_not_change_real_tokens():
    cfg = _cfg()
    model = create_model(cfg)
    tokens, positions, segs = _inputs(cfg, b=2, t=10)
    ref = fwd(model, tokens[:, :6], positions[:, :6], segs[:, :6])
    padded_segs = segs.at[:, 6:].set(0)
    got = fwd(model, tokens, positions, padded_segs)[:, :6]
    np.testing.assert_allclose(got, ref, atol=TOL, rtol=0)
    assert np.all(np.isfinite(fwd(model, tokens, positions, jnp.zeros_like(segs))))


def test_packed_segments_equal_separate_sequences():
    cfg = _cfg()
    model = create_model(cfg)
    a = jax.random.randint(jax.random.key(1), (1, 5), 0, cfg.vocab_size)
    b = jax.random.randint(jax.random.key(2), (1, 7), 0, cfg.vocab_size)
    packed = jnp.concatenate([a, b, jnp.zeros((1, 4), a.dtype)], axis=1)
    pos = jnp.concatenate([jnp.arange(5), jnp.arange(7), jnp.zeros(4, jnp.int32)])[None]
    seg = jnp.concatenate([jnp.full(5, 1), jnp.full(7, 2), jnp.zeros(4)]).astype(jnp.int32)[None]
    out = fwd(model, packed, pos, seg)
    ra = fwd(model, a, jnp.arange(5)[None], jnp.ones((1, 5), jnp.int32))
    rb = fwd(model, b, jnp.arange(7)[None], jnp.ones((1, 7), jnp.int32))
    np.testing.assert_allclose(out[:, :5], ra, atol=TOL, rtol=0)
    np.testing.assert_allclose(out[:, 5:12], rb, atol=TOL, rtol=0)


def test_query_block_counts():
    expected = {12: 1, 63: 1, 64: 2, 96: 2, 100: 2, 128: 4, 200: 4, 256: 8, 4096: 8}
    assert {t: query_blocks(t) for t in expected} == expected


@pytest.mark.parametrize("t", [64, 128])
def test_full_attention_in_query_blocks_equals_one_block(t):
    # Packed segments (one ends mid-block) and trailing padding: every causal mask training makes.
    b, n, k, h = 2, 4, 2, 8
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(kq, (b, t, n, h))
    keys = jax.random.normal(kk, (b, t, k, h))
    vals = jax.random.normal(kv, (b, t, k, h))
    cut = [t // 2 + 5, t - 9]
    seg = np.zeros((b, t), np.int32)
    seg[0, : cut[0]], seg[0, cut[0] :] = 1, 2
    seg[1, : cut[1]] = 1
    idx = np.arange(t)
    mask = jnp.asarray(
        (seg[:, :, None] == seg[:, None, :]) & (seg[:, None, :] > 0) & (idx[:, None] >= idx)[None]
    )
    assert query_blocks(t) > 1
    loss = lambda f, q, keys, vals: jnp.sum(jnp.sin(f(q, keys, vals, mask)))
    run = lambda f: jax.jit(jax.value_and_grad(lambda *a: loss(f, *a), (0, 1, 2)))(q, keys, vals)
    for got, ref in zip(
        jax.tree.leaves(run(attend_full)), jax.tree.leaves(run(attend)), strict=True
    ):
        np.testing.assert_allclose(got, ref, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("chunk", [1, 5, 12, 64])
def test_token_logprobs_match_log_softmax(chunk):
    cfg = _cfg(logits_chunk=chunk)
    model = create_model(cfg)
    tokens, positions, segs = _inputs(cfg)
    targets = jnp.roll(tokens, -1, axis=1)
    logits = fwd(model, tokens, positions, segs) / 0.7
    ref_lp = jnp.take_along_axis(jax.nn.log_softmax(logits), targets[:, :, None], axis=-1)[..., 0]
    p = jax.nn.softmax(logits)
    ref_ent = -jnp.sum(p * jax.nn.log_softmax(logits), axis=-1)
    lp, ent = logprobs(model, tokens, positions, segs, targets, 0.7)
    np.testing.assert_allclose(lp, ref_lp, atol=TOL, rtol=0)
    np.testing.assert_allclose(ent, ref_ent, atol=TOL, rtol=0)


@pytest.mark.parametrize("chunk", [4, 16])  # chunks under jax.checkpoint; one chunk, kept
@pytest.mark.parametrize("with_entropy", [False, True])  # the log-probs of the entropy path too
def test_chunked_logprob_gradients_match_dense(chunk, with_entropy):
    h = 3 * jax.random.normal(jax.random.key(0), (2, 9, 8))
    w = jax.random.normal(jax.random.key(1), (8, 11))
    tgt = jax.random.randint(jax.random.key(2), (2, 9), 0, 11)

    def dense(h, w):
        lp = jax.nn.log_softmax(jnp.einsum("btd,dv->btv", h, w))
        return jnp.take_along_axis(lp, tgt[:, :, None], axis=-1)[:, :, 0]

    def chunked(h, w):
        out = chunked_logprobs(h, w, tgt, chunk=chunk, with_entropy=with_entropy)
        return out[0] if with_entropy else out

    np.testing.assert_allclose(chunked(h, w), dense(h, w), atol=1e-5, rtol=0)
    for got, ref in zip(
        jax.grad(lambda h, w: chunked(h, w).sum(), (0, 1))(h, w),
        jax.grad(lambda h, w: dense(h, w).sum(), (0, 1))(h, w),
        strict=True,
    ):
        np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("remat", ["full", "dots"])
def test_remat_changes_memory_not_math(remat):
    cfg = _cfg()
    tokens, positions, segs = _inputs(cfg)

    def loss(model):
        return model.token_logprobs(tokens, positions, segs, tokens).mean()

    grads = [
        nnx.jit(nnx.grad(loss))(create_model(c, seed=2)) for c in (cfg, cfg.replace(remat=remat))
    ]
    for g0, g1 in zip(
        jax.tree.leaves(nnx.state(grads[0])), jax.tree.leaves(nnx.state(grads[1])), strict=True
    ):
        np.testing.assert_allclose(g0, g1, atol=1e-6, rtol=0)


def test_bfloat16_compute_is_close_to_float32():
    cfg = _cfg()
    model32 = create_model(cfg, seed=4)
    model16 = create_model(cfg.replace(dtype="bfloat16", param_dtype="bfloat16"), seed=4)
    assert model16.embed[...].dtype == jnp.bfloat16
    tokens, positions, segs = _inputs(cfg)
    out16 = fwd(model16, tokens, positions, segs)
    assert out16.dtype == jnp.float32
    # bf16 has ~3 significant digits; tiny random logits are O(0.1).
    np.testing.assert_allclose(out16, fwd(model32, tokens, positions, segs), atol=5e-2, rtol=0)


def test_param_count_matches_config_formula():
    for kw in [
        {},
        dict(family="qwen2", qk_norm=False, qkv_bias=True, tie_embeddings=False),
        dict(family="llama", qk_norm=False, qkv_bias=True, o_bias=True),
    ]:
        cfg = _cfg(**kw)
        assert param_count(create_model(cfg)) == cfg.num_params()


def test_presets_have_published_sizes():
    from rl.models import PRESETS

    # Published parameter counts (billions, embeddings included) rounded as the model names do.
    expected = {
        "qwen3-0.6b": 0.6,
        "qwen3-1.7b": 1.7,
        "qwen3-4b": 4.0,
        "qwen3-8b": 8.2,
        "qwen2.5-0.5b": 0.49,
        "qwen2.5-1.5b": 1.54,
        "qwen2.5-3b": 3.09,
        "qwen2.5-7b": 7.6,
        "llama-3.2-1b": 1.24,
        "llama-3.2-3b": 3.21,
        "llama-3.1-8b": 8.03,
    }
    for name, billions in expected.items():
        assert PRESETS[name].num_params() / 1e9 == pytest.approx(billions, rel=0.03), name


@pytest.mark.parametrize(
    "kw,msg",
    [
        (dict(n_kv_heads=3), "divisible by n_kv_heads"),
        (dict(head_dim=15), "even"),
        (dict(dtype="fp8"), "expected one of"),
        (dict(remat="some"), "remat"),
        (dict(family="gpt2"), "Unknown model family"),
        (dict(d_model=0), "positive"),
    ],
)
def test_bad_model_config_is_rejected(kw, msg):
    with pytest.raises(ValueError, match=msg):
        _cfg(**kw)
