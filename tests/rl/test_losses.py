"""Policy losses, KL estimators and aggregations agree with plain numpy references and with the
paper objectives' gradients; padding contributes nothing; aggregations are additive."""

import functools
import itertools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rl.aggregation import AGGREGATIONS, get_aggregation, masked_mean, register_aggregation
from rl.losses import (
    LOSS_OPTIONS,
    POLICY_LOSSES,
    DecoupledPpoOptions,
    GspoOptions,
    LossConfig,
    PpoClipOptions,
    TisOptions,
    get_policy_loss,
    kl_penalty,
    register_policy_loss,
)

TOL = dict(rtol=1e-5, atol=1e-6)  # float32 against a float64 reference
DAPO = LossConfig()  # the defaults: PPO clip [0.8, 1.28] (DAPO clip-higher)
PPO = LossConfig(  # symmetric clips
    ppo_clip=PpoClipOptions(clip_high=0.2), decoupled_ppo=DecoupledPpoOptions(clip_high=0.2)
)
LENGTHS = (7, 3, 1, 0, 5, 6)  # unequal response lengths; row 3 is batch padding
B, T = len(LENGTHS), max(LENGTHS)
NORM = 16.0  # the Dr. GRPO constant (max response length)


# Jitted entry points: eager op-by-op dispatch compiles every primitive and is slow on CPU.
@functools.partial(jax.jit, static_argnames=("name", "cfg"))
def _loss(logp, old, adv, mask, *, name, cfg):
    return get_policy_loss(name)(logp, old, adv, mask, cfg.options(name))


@functools.partial(jax.jit, static_argnames=("name", "norm_constant"))
def _agg(loss, mask, *, name, norm_constant=NORM):
    return get_aggregation(name)(loss, mask, norm_constant=norm_constant)


def _batch(seed: int = 0, scale: float = 0.5):
    """Right-padded responses; padding holds -inf / NaN log-probs that must not leak."""
    rng = np.random.default_rng(seed)
    mask = np.arange(T)[None, :] < np.array(LENGTHS)[:, None]
    logp = -rng.uniform(0.05, 3.0, size=(B, T)).astype(np.float32)
    old = (logp + scale * rng.normal(size=(B, T))).astype(np.float32)
    adv = rng.normal(size=B).astype(np.float32)
    logp[~mask], old[~mask] = -np.inf, np.nan
    return logp, old, adv, mask


# ---- numpy references, written token by token. -----------------------------------------------


def _ref_clip(ratio, a, low, high):
    unclipped, clipped = ratio * a, min(max(ratio, 1 - low), 1 + high) * a
    return -min(unclipped, clipped), float(clipped < unclipped)


def _ref_ppo_clip(logp, old, adv, mask, cfg):
    loss, m = np.zeros((B, T)), {"ratio": np.zeros((B, T)), "clip_frac": np.zeros((B, T))}
    for b in range(B):
        for t in range(T):
            if mask[b, t]:
                r = math.exp(float(logp[b, t]) - float(old[b, t]))
                lo, hi = cfg.ppo_clip.clip_low, cfg.ppo_clip.clip_high
                loss[b, t], m["clip_frac"][b, t] = _ref_clip(r, adv[b], lo, hi)
                m["ratio"][b, t] = r
    return loss, m


def _ref_gspo(logp, old, adv, mask, cfg):
    loss, m = np.zeros((B, T)), {"ratio": np.zeros((B, T)), "clip_frac": np.zeros((B, T))}
    for b in range(B):
        ts = [t for t in range(T) if mask[b, t]]
        if not ts:
            continue
        s = math.exp(sum(float(logp[b, t]) - float(old[b, t]) for t in ts) / len(ts))
        seq_loss, clipped = _ref_clip(s, adv[b], cfg.gspo.clip_low, cfg.gspo.clip_high)
        for t in ts:
            loss[b, t], m["clip_frac"][b, t], m["ratio"][b, t] = seq_loss, clipped, s
    return loss, m


def _ref_tis_reinforce(logp, old, adv, mask, cfg):
    loss, m = np.zeros((B, T)), {k: np.zeros((B, T)) for k in ("is_weight", "ratio", "clip_frac")}
    for b in range(B):
        for t in range(T):
            if mask[b, t]:
                r = math.exp(float(logp[b, t]) - float(old[b, t]))
                w = min(r, cfg.tis_reinforce.clip)
                loss[b, t] = -w * adv[b] * logp[b, t]
                m["is_weight"][b, t], m["ratio"][b, t] = w, r
                m["clip_frac"][b, t] = float(r > cfg.tis_reinforce.clip)
    return loss, m


def _ref_decoupled_ppo(logp, old, adv, mask, cfg):
    keys = ("behav_weight", "behav_clip_frac", "ratio", "clip_frac")
    loss, m = np.zeros((B, T)), {k: np.zeros((B, T)) for k in keys}
    for b in range(B):
        for t in range(T):
            if mask[b, t]:
                rb = math.exp(float(logp[b, t]) - float(old[b, t]))  # proximal = current params
                opts = cfg.decoupled_ppo
                w = min(rb, opts.behav_clip)
                ppo, clipped = _ref_clip(1.0, adv[b], opts.clip_low, opts.clip_high)
                loss[b, t] = w * ppo
                m["behav_weight"][b, t], m["behav_clip_frac"][b, t] = w, float(rb > opts.behav_clip)
                m["ratio"][b, t], m["clip_frac"][b, t] = 1.0, clipped
    return loss, m


LOSS_REFERENCES = {
    "ppo_clip": _ref_ppo_clip,
    "gspo": _ref_gspo,
    "tis_reinforce": _ref_tis_reinforce,
    "decoupled_ppo": _ref_decoupled_ppo,
}


def _ref_aggregate(name, loss, mask, norm_constant):
    loss, mask = np.asarray(loss, np.float64), np.asarray(mask, np.float64)
    if name == "token_mean":
        return (loss * mask).sum(), mask.sum()
    num, den = 0.0, 0
    for b in range(loss.shape[0]):
        n = mask[b].sum()
        if n > 0:
            s = (loss[b] * mask[b]).sum()
            divisor = {"seq_mean_token_mean": n, "seq_mean_token_sum": 1.0}.get(name, norm_constant)
            num += s / divisor
            den += 1
    return num, den


# ---- registries and config. ------------------------------------------------------------------


def test_every_registered_variant_has_a_reference():
    assert set(POLICY_LOSSES) == set(LOSS_REFERENCES)
    assert set(AGGREGATIONS) == {
        "token_mean",
        "seq_mean_token_mean",
        "seq_mean_token_sum",
        "seq_mean_token_sum_norm",
    }


@pytest.mark.parametrize(
    "getter, registry",
    [(get_policy_loss, POLICY_LOSSES), (get_aggregation, AGGREGATIONS)],
)
def test_unknown_name_lists_registered_ones(getter, registry):
    with pytest.raises(ValueError, match=re.escape(f"'nope'; expected one of {sorted(registry)}")):
        getter("nope")


@pytest.mark.parametrize(
    "register, registry, existing",
    [
        (register_policy_loss, POLICY_LOSSES, "ppo_clip"),
        (register_aggregation, AGGREGATIONS, "token_mean"),
    ],
)
def test_register_adds_new_names_and_refuses_duplicates(register, registry, existing):
    def fn(*args, **kwargs):
        return None

    register("test_only")(fn)
    try:
        assert registry["test_only"] is fn
        with pytest.raises(ValueError, match=f"'{existing}' is already registered"):
            register(existing)(fn)
    finally:
        del registry["test_only"]
        LOSS_OPTIONS.pop("test_only", None)


def test_loss_config_defaults():
    cfg = LossConfig()
    assert (cfg.ppo_clip.clip_low, cfg.ppo_clip.clip_high) == (0.2, 0.28)
    assert (cfg.gspo.clip_low, cfg.gspo.clip_high) == (3e-4, 4e-4)
    assert cfg.tis_reinforce.clip == 5.0
    assert (cfg.decoupled_ppo.clip_low, cfg.decoupled_ppo.behav_clip) == (0.2, 5.0)
    assert (cfg.kl_coef, cfg.kl_estimator) == (0.0, "k3")
    assert cfg.options("gspo") is cfg.gspo
    with pytest.raises(TypeError):
        LossConfig(0.2)  # kw_only


@pytest.mark.parametrize(
    "cls, where, field, value",
    [
        (PpoClipOptions, "ppo_clip", "clip_low", -0.1),
        (PpoClipOptions, "ppo_clip", "clip_low", 1.0),
        (PpoClipOptions, "ppo_clip", "clip_low", "0.2"),
        (PpoClipOptions, "ppo_clip", "clip_high", -0.01),
        (PpoClipOptions, "ppo_clip", "clip_high", float("inf")),
        (PpoClipOptions, "ppo_clip", "clip_high", True),
        (GspoOptions, "gspo", "clip_low", 1.5),
        (GspoOptions, "gspo", "clip_high", -4e-4),
        (TisOptions, "tis_reinforce", "clip", 0.0),
        (TisOptions, "tis_reinforce", "clip", float("nan")),
        (DecoupledPpoOptions, "decoupled_ppo", "behav_clip", -1.0),
        (LossConfig, "", "kl_coef", -0.1),
        (LossConfig, "", "kl_estimator", "k4"),
    ],
)
def test_bad_loss_config_says_field_and_value(cls, where, field, value):
    name = "learner.loss." + (f"{where}." if where else "") + field
    with pytest.raises(ValueError, match=re.escape(name) + r" must .*received "):
        cls(**{field: value})
    with pytest.raises(ValueError, match=re.escape(repr(value))):
        cls(**{field: value})


def test_loss_options_from_a_config_section_and_for_a_user_registered_loss():
    import dataclasses

    from rl.losses import loss_config_from

    cfg = loss_config_from({"kl_coef": 0.1, "gspo": {"clip_low": 0.01}, "tis_reinforce": {}})
    assert cfg.kl_coef == 0.1 and cfg.gspo == GspoOptions(clip_low=0.01)
    with pytest.raises(ValueError, match=r"learner.loss.gspo has no field\(s\) \['clip'\]"):
        loss_config_from({"gspo": {"clip": 0.1}})
    with pytest.raises(ValueError, match=r"learner.loss has no field 'clip_low'; expected kl_coef"):
        loss_config_from({"clip_low": 0.2})

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class HalfOptions:
        scale: float = 0.5

    try:
        register_policy_loss("test_half", options=HalfOptions)(
            lambda logp, old, adv, mask, opts: (opts.scale * logp, {})
        )
        assert LossConfig().options("test_half") == HalfOptions()
        cfg = loss_config_from({"test_half": {"scale": 2.0}})
        assert cfg.options("test_half") == HalfOptions(scale=2.0)
        loss, _ = get_policy_loss("test_half")(
            jnp.ones((1, 2)), None, None, None, cfg.options("test_half")
        )
        np.testing.assert_array_equal(loss, [[2.0, 2.0]])
    finally:
        POLICY_LOSSES.pop("test_half", None)
        LOSS_OPTIONS.pop("test_half", None)
    with pytest.raises(ValueError, match="options must be a dataclass type; received 3"):
        register_policy_loss("test_bad", options=3)


# ---- policy losses. --------------------------------------------------------------------------


@pytest.mark.parametrize("cfg", [PPO, DAPO], ids=["ppo", "dapo"])
@pytest.mark.parametrize("name", sorted(LOSS_REFERENCES))
def test_policy_loss_matches_reference(name, cfg):
    logp, old, adv, mask = _batch(seed=1, scale=0.5 if name != "gspo" else 1e-3)
    loss, metrics = _loss(logp, old, adv, mask, name=name, cfg=cfg)
    ref_loss, ref_metrics = LOSS_REFERENCES[name](logp, old, adv, mask, cfg)
    np.testing.assert_allclose(loss, ref_loss, **TOL)
    for key, ref in ref_metrics.items():
        np.testing.assert_allclose(metrics[key], ref, **TOL, err_msg=key)
    for key, value in metrics.items():
        assert value.shape == (B, T), key


@pytest.mark.parametrize("name", sorted(LOSS_REFERENCES))
def test_policy_loss_runs_eagerly_too(name):
    logp, old, adv, mask = _batch(seed=1, scale=1e-3)
    eager_loss, eager_metrics = get_policy_loss(name)(logp, old, adv, mask, DAPO.options(name))
    loss, metrics = _loss(logp, old, adv, mask, name=name, cfg=DAPO)
    np.testing.assert_allclose(eager_loss, loss, **TOL)
    assert set(eager_metrics) == set(metrics)


@pytest.mark.parametrize("name", sorted(LOSS_REFERENCES))
def test_padding_contributes_nothing(name):
    logp, old, adv, mask = _batch(seed=2)
    fn = get_policy_loss(name)

    def total(lp, old_lp):
        loss, metrics = fn(lp, old_lp, adv, mask, DAPO.options(name))
        return jnp.sum(loss), (loss, metrics)

    grad, (loss, metrics) = jax.jit(jax.grad(total, has_aux=True))(logp, old)
    assert np.isfinite(grad).all() and np.isfinite(loss).all()
    np.testing.assert_array_equal(np.asarray(grad)[~mask], 0.0)
    np.testing.assert_array_equal(np.asarray(loss)[~mask], 0.0)
    for key, value in metrics.items():
        np.testing.assert_array_equal(np.asarray(value)[~mask], 0.0, err_msg=key)
    # Other garbage in the padding, and a float mask, change nothing.
    logp2, old2 = logp.copy(), old.copy()
    logp2[~mask], old2[~mask] = 123.0, -7.0
    loss2, metrics2 = _loss(logp2, old2, adv, mask.astype(np.float32), name=name, cfg=DAPO)
    np.testing.assert_array_equal(loss2, loss)
    for key in metrics:
        np.testing.assert_array_equal(metrics2[key], metrics[key], err_msg=key)


def test_ppo_clip_fractions_on_each_side():
    # Columns: ratio 1.5 / 0.5 / 1.1 / 1.25 / 0.9; rows: A = +1, -1. DAPO clips at [0.8, 1.28].
    ratio = np.array([1.5, 0.5, 1.1, 1.25, 0.9], np.float32)
    old = np.zeros((2, 5), np.float32)
    logp = np.log(np.stack([ratio, ratio]))
    adv = np.array([1.0, -1.0], np.float32)
    loss, m = _loss(logp, old, adv, np.ones((2, 5)), name="ppo_clip", cfg=DAPO)
    np.testing.assert_array_equal(m["clip_frac_high"], [[1, 0, 0, 0, 0], [0, 0, 0, 0, 0]])
    np.testing.assert_array_equal(m["clip_frac_low"], [[0, 0, 0, 0, 0], [0, 1, 0, 0, 0]])
    np.testing.assert_array_equal(m["clip_frac"], m["clip_frac_high"] + m["clip_frac_low"])
    np.testing.assert_allclose(
        loss, [[-1.28, -0.5, -1.1, -1.25, -0.9], [1.5, 0.8, 1.1, 1.25, 0.9]], **TOL
    )
    # Clipped tokens get no gradient; the others get -A * ratio.
    grad = jax.jit(
        jax.grad(
            lambda lp: jnp.sum(_loss(lp, old, adv, np.ones((2, 5)), name="ppo_clip", cfg=DAPO)[0])
        )
    )(logp)
    expected = -adv[:, None] * np.stack([ratio, ratio]) * (1 - np.asarray(m["clip_frac"]))
    np.testing.assert_allclose(grad, expected, **TOL)


def test_gspo_gradient_equals_the_paper_sequence_objective():
    logp, old, adv, mask = _batch(seed=3, scale=0.02)
    # Per-row mean log-ratio and advantage sign chosen so that both branches occur: rows 1, 2
    # are clipped (zero gradient), rows 0, 4, 5 are not; row 3 is padding.
    shift = np.array([0.01, 0.3, -0.3, 0.0, 0.3, -0.3], np.float32)
    adv = np.array([1.0, 1.0, -1.0, 0.7, -1.0, 1.0], np.float32)
    old = old - shift[:, None]
    cfg = LossConfig(gspo=GspoOptions(clip_low=0.05, clip_high=0.06))
    lo, hi = 1 - cfg.gspo.clip_low, 1 + cfg.gspo.clip_high
    valid = mask.any(axis=1)

    def ours(lp):
        loss, metrics = _loss(lp, old, adv, mask, name="gspo", cfg=cfg)
        num, den = _agg(loss, mask, name="seq_mean_token_mean")
        return num / den, metrics

    def paper(lp):  # J = mean_i min(s_i A_i, clip(s_i) A_i), s_i = exp(mean_t(logp - old))
        d = jnp.where(mask, lp - old, 0.0)
        s = jnp.exp(jnp.sum(d, axis=1) / jnp.maximum(mask.sum(axis=1), 1))
        j = jnp.minimum(s * adv, jnp.clip(s, lo, hi) * adv)
        return -jnp.sum(jnp.where(valid, j, 0.0)) / valid.sum()

    (value, metrics), grad = jax.jit(jax.value_and_grad(ours, has_aux=True))(logp)
    paper_value, paper_grad = jax.jit(jax.value_and_grad(paper))(logp)
    np.testing.assert_allclose(value, paper_value, **TOL)
    np.testing.assert_allclose(grad, paper_grad, **TOL)
    np.testing.assert_array_equal(np.asarray(metrics["clip_frac"]).max(axis=1), [0, 1, 1, 0, 0, 0])
    assert np.abs(np.asarray(grad)[[0, 4, 5]]).max() > 1e-3  # unclipped rows do learn
    np.testing.assert_array_equal(np.asarray(grad)[[1, 2, 3]], 0.0)


def test_tis_weights_clamp_and_carry_no_gradient():
    logp, old, adv, mask = _batch(seed=4, scale=2.0)  # ratios up to e^6: many truncated
    cfg = LossConfig(tis_reinforce=TisOptions(clip=5.0))

    def total(lp):
        loss, metrics = _loss(lp, old, adv, mask, name="tis_reinforce", cfg=cfg)
        return jnp.sum(loss), metrics

    grad, metrics = jax.jit(jax.grad(total, has_aux=True))(logp)
    w = np.where(mask, np.minimum(np.exp(np.where(mask, logp - old, 0.0)), 5.0), 0.0)
    assert w.max() == 5.0 and (w[mask] < 5.0).any() and np.asarray(metrics["clip_frac"]).sum() > 0
    np.testing.assert_allclose(metrics["is_weight"], w, **TOL)
    np.testing.assert_allclose(grad, -w * adv[:, None] * mask, **TOL)
    assert np.all(np.asarray(metrics["is_weight"]) >= 0)


def test_decoupled_ppo_weights_by_the_behaviour_ratio_and_follows_tis_gradient():
    """The proximal policy is the update's start: the gradient is -w A d logp with the truncated
    behaviour weight, i.e. tis_reinforce's, while the loss value keeps the PPO form."""
    logp, old, adv, mask = _batch(seed=4, scale=2.0)
    cfg = LossConfig(tis_reinforce=TisOptions(clip=5.0), decoupled_ppo=DecoupledPpoOptions())

    def grad_of(name):
        def total(lp):
            return jnp.sum(_loss(lp, old, adv, mask, name=name, cfg=cfg)[0])

        return np.asarray(jax.jit(jax.grad(total))(logp))

    w = np.where(mask, np.minimum(np.exp(np.where(mask, logp - old, 0.0)), 5.0), 0.0)
    assert w.max() == 5.0 and (w[mask] < 5.0).any()
    np.testing.assert_allclose(grad_of("decoupled_ppo"), -w * adv[:, None] * mask, **TOL)
    np.testing.assert_allclose(grad_of("decoupled_ppo"), grad_of("tis_reinforce"), **TOL)


@pytest.mark.parametrize("name", sorted(LOSS_REFERENCES))
def test_bad_shapes_say_what_was_received(name):
    logp, old, adv, mask = _batch()
    fn = get_policy_loss(name)
    with pytest.raises(ValueError, match=r"received logp_BxT \(6, 7\).*adv_B \(5,\)"):
        fn(logp, old, adv[:5], mask, LossConfig().options(name))
    with pytest.raises(ValueError, match=r"mask_BxT must have shape \(6, 7\); received \(6, 6\)"):
        fn(logp, old, adv, mask[:, :6], LossConfig().options(name))


# ---- KL. -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "estimator, ref",
    [
        ("k1", lambda lp, rf: lp - rf),
        ("k2", lambda lp, rf: 0.5 * (lp - rf) ** 2),
        ("k3", lambda lp, rf: np.exp(rf - lp) - (rf - lp) - 1),
    ],
)
def test_kl_estimators_match_numpy(estimator, ref):
    rng = np.random.default_rng(5)
    logp = -rng.uniform(0.1, 3.0, size=(4, 6)).astype(np.float32)
    ref_logp = (logp + rng.normal(scale=0.5, size=(4, 6))).astype(np.float32)
    expected = ref(logp.astype(np.float64), ref_logp.astype(np.float64))
    np.testing.assert_allclose(kl_penalty(logp, ref_logp, estimator), expected, **TOL)
    mask = np.arange(6)[None, :] < np.array([6, 2, 0, 4])[:, None]
    logp[~mask], ref_logp[~mask] = -np.inf, np.nan
    kl, grad = jax.jit(
        jax.value_and_grad(lambda lp: jnp.sum(kl_penalty(lp, ref_logp, estimator, mask_BxT=mask)))
    )(logp)
    np.testing.assert_allclose(kl, np.where(mask, expected, 0.0).sum(), **TOL)
    np.testing.assert_array_equal(np.asarray(grad)[~mask], 0.0)


def test_k3_is_nonnegative_and_exact_near_zero():
    logp = np.array([[-1.0, -1.0, -2.0]], np.float32)
    ref_logp = np.array([[-1.0, -1.0 + 1e-4, -0.5]], np.float32)
    kl = np.asarray(kl_penalty(logp, ref_logp, "k3"))
    d = ref_logp.astype(np.float64) - logp.astype(np.float64)
    # exp(d) - d - 1 ~ d^2 / 2 cancels catastrophically in float32 for |d| ~ 1e-4; expm1 does not.
    np.testing.assert_allclose(kl, np.expm1(d) - d, rtol=1e-5)
    assert (kl >= 0).all() and kl[0, 0] == 0.0


def test_kl_rejects_unknown_estimator_and_shape_mismatch():
    with pytest.raises(ValueError, match=re.escape("'k5'; expected one of ['k1', 'k2', 'k3']")):
        kl_penalty(np.zeros((2, 3)), np.zeros((2, 3)), "k5")
    with pytest.raises(ValueError, match=r"received \(2, 3\) and \(2, 4\)"):
        kl_penalty(np.zeros((2, 3)), np.zeros((2, 4)), "k1")


# ---- aggregation. ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(AGGREGATIONS))
def test_aggregation_matches_reference(name):
    logp, old, adv, mask = _batch(seed=6)
    loss, _ = _loss(logp, old, adv, mask, name="ppo_clip", cfg=DAPO)
    num, den = _agg(loss, mask, name=name)
    ref_num, ref_den = _ref_aggregate(name, loss, mask, NORM)
    np.testing.assert_allclose(num, ref_num, **TOL)
    assert float(den) == ref_den


def test_aggregations_weigh_sequences_as_documented():
    loss = np.array([[1.0, 1.0, 1.0, 1.0], [4.0, 0.0, 0.0, 0.0], [9.0, 9.0, 9.0, 9.0]], np.float32)
    mask = np.array([[1, 1, 1, 1], [1, 0, 0, 0], [0, 0, 0, 0]], np.float32)

    def value(name):
        num, den = _agg(loss, mask, name=name, norm_constant=4.0)
        return float(num / den)

    assert value("token_mean") == pytest.approx(8 / 5, **{"rel": 1e-6})
    assert value("seq_mean_token_mean") == pytest.approx((1 + 4) / 2, rel=1e-6)
    assert value("seq_mean_token_sum") == pytest.approx((4 + 4) / 2, rel=1e-6)
    assert value("seq_mean_token_sum_norm") == pytest.approx((4 / 4 + 4 / 4) / 2, rel=1e-6)


def test_seq_mean_token_sum_norm_needs_a_positive_norm_constant():
    for bad in (None, 0, -3.0):
        with pytest.raises(
            ValueError, match=r"norm_constant > 0.*received " + re.escape(repr(bad))
        ):
            get_aggregation("seq_mean_token_sum_norm")(
                np.ones((2, 3)), np.ones((2, 3)), norm_constant=bad
            )


def test_aggregation_shape_mismatch_says_what_was_received():
    with pytest.raises(ValueError, match=r"token_mean.*received \(2, 3\) and \(2, 4\)"):
        get_aggregation("token_mean")(np.ones((2, 3)), np.ones((2, 4)))


MICRO_ROWS = 8  # micro-batches are padded to a fixed number of rows, as a jitted trainer does


@jax.jit
def _all_aggs(loss, mask):
    return {name: _agg(loss, mask, name=name) for name in sorted(AGGREGATIONS)}


@settings(max_examples=60, deadline=None)
@given(
    b=st.integers(1, MICRO_ROWS),
    t=st.sampled_from([1, 5]),
    seed=st.integers(0, 2**32 - 1),
    data=st.data(),
)
def test_aggregation_is_additive_over_any_micro_batch_split(b, t, seed, data):
    rng = np.random.default_rng(seed)
    loss = rng.normal(size=(b, t)).astype(np.float32)
    mask = rng.random((b, t)) < 0.6
    mask[rng.random(b) < 0.25] = False  # some padding rows
    cuts = sorted(data.draw(st.sets(st.integers(1, b - 1), max_size=b - 1))) if b > 1 else []
    num, den = dict.fromkeys(AGGREGATIONS, 0.0), dict.fromkeys(AGGREGATIONS, 0.0)
    for lo, hi in itertools.pairwise([0, *cuts, b]):
        pad = ((0, MICRO_ROWS - (hi - lo)), (0, 0))
        parts = _all_aggs(np.pad(loss[lo:hi], pad), np.pad(mask[lo:hi], pad))
        for name, (n, d) in parts.items():
            num[name] += float(n)
            den[name] += float(d)
    for name in AGGREGATIONS:
        full_num, full_den = _ref_aggregate(name, loss, mask, NORM)
        assert den[name] == full_den, name
        np.testing.assert_allclose(num[name], full_num, **TOL, err_msg=name)
        if full_den > 0:
            np.testing.assert_allclose(
                num[name] / den[name], full_num / full_den, **TOL, err_msg=name
            )


@pytest.mark.parametrize("name", sorted(AGGREGATIONS))
def test_gradient_accumulation_equals_the_full_batch(name):
    logp, old, adv, mask = _batch(seed=7)

    @jax.jit
    @functools.partial(jax.value_and_grad, has_aux=True)
    def num_and_grad(lp, o, a, m):
        loss, _ = _loss(lp, o, a, m, name="ppo_clip", cfg=DAPO)
        return _agg(loss, m, name=name)

    (full_num, full_den), full_grad = num_and_grad(logp, old, adv, mask)
    grads, num, den = [], 0.0, 0.0
    for lo, hi in [(0, 2), (2, 3), (3, 6)]:  # unequal micro-batches; (3, 4) is padding only
        (n, d), g = num_and_grad(logp[lo:hi], old[lo:hi], adv[lo:hi], mask[lo:hi])
        grads.append(g)
        num, den = num + float(n), den + float(d)
    assert den == float(full_den)
    np.testing.assert_allclose(num, full_num, **TOL)
    np.testing.assert_allclose(np.concatenate(grads) / den, full_grad / full_den, **TOL)


def test_masked_mean():
    x = np.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], np.float32)
    mask = np.array([[1, 0, 1], [0, 0, 0]])
    assert float(masked_mean(x, mask)) == pytest.approx(2.0)
    np.testing.assert_allclose(masked_mean(x, mask, axis=1), [2.0, 0.0], **TOL)
    assert float(masked_mean(x, np.zeros_like(mask))) == 0.0
    x[1, 1] = np.nan  # masked NaN does not leak
    assert float(masked_mean(x, mask)) == pytest.approx(2.0)
    with pytest.raises(ValueError, match=r"received \(2, 2\)"):
        masked_mean(x, mask[:, :2])
