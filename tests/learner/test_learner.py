"""The learner: accumulation equals one batch, sharding changes nothing, old log-probs, guards."""

import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import SingleDeviceSharding

from learner.batching import make_batch
from learner.config import LearnerConfig, OptimizerConfig
from learner.learner import Learner
from learner.mesh import MeshConfig, make_meshes
from learner.publish import DevicePutSync
from learner.state import create_train_state, make_lr_schedule, make_optimizer
from learner.step import accumulate, apply, train_step, zero_accum
from rl.advantages import get_advantage_estimator
from rl.models import create_model, get_preset
from rl.types import Completion, Group, Request
from tests.host_arrays import assert_bitwise_equal, host_arrays

TOL = 1e-5  # float32


def make_groups(n, g=4, seed=0, max_response=9, prompt_len=5):
    rng = np.random.default_rng(seed)
    out = []
    for uid in range(n):
        prompt = tuple(int(x) for x in rng.integers(0, 256, prompt_len))
        comps = []
        for s in range(g):
            k = int(rng.integers(1, max_response))
            comps.append(
                Completion(
                    uid=uid,
                    round=0,
                    sample=s,
                    prompt=prompt,
                    tokens=tuple(int(x) for x in rng.integers(0, 256, k)),
                    logprobs=tuple(float(x) for x in -rng.random(k) * 5),
                    versions=(0,) * k,
                    finish_reason="length",
                    reward=float(rng.integers(0, 2)),
                )
            )
        out.append(
            Group(request=Request(uid=uid, prompt=prompt, group_size=g), completions=tuple(comps))
        )
    return out


def _advantages(groups):
    est = get_advantage_estimator("grpo")
    return [tuple(np.asarray(est(np.asarray([g.rewards])))[0]) for g in groups]


def _single_mesh():
    return jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"))


# eps=1 keeps Adam's first steps Lipschitz in the gradient: with eps=1e-8 an update is ~lr*sign(g),
# which turns float32 rounding of near-zero gradient entries into O(lr) parameter differences.
WELL_CONDITIONED = OptimizerConfig(lr=1e-2, eps=1.0)


@pytest.mark.parametrize(
    "aggregation",
    [
        pytest.param("token_mean", marks=pytest.mark.slow),  # ~18 s cold; seq_mean_token_mean
        "seq_mean_token_mean",  # stays quick
        pytest.param("seq_mean_token_sum", marks=pytest.mark.slow),  # ~12 s cold
        pytest.param("seq_mean_token_sum_norm", marks=pytest.mark.slow),  # ~23 s cold
    ],
)
def test_accumulating_any_split_equals_one_batch(aggregation):
    cfg = LearnerConfig(
        optimizer=WELL_CONDITIONED,
        aggregation=aggregation,
        norm_constant=8.0 if aggregation == "seq_mean_token_sum_norm" else 0.0,
        policy_loss="ppo_clip",
        old_logprobs="sampler",
    )
    graphdef, params = nnx.split(create_model(get_preset("tiny"), seed=1))
    tx, schedule = make_optimizer(cfg.optimizer), make_lr_schedule(cfg.optimizer)
    groups = make_groups(4, g=2)
    advs = _advantages(groups)
    state, _ = create_train_state(params, tx, mesh=_single_mesh())
    # Every micro-batch is padded to the full batch's 8 rows: one compile, padding rows add nothing.
    # The state is an argument, not a constant the programs close over (closed-over weights make
    # each program distinct and slower to compile).
    acc_jit = jax.jit(lambda a, p, b: accumulate(a, p, b, graphdef=graphdef, cfg=cfg))
    acc_fn = lambda a, b: acc_jit(a, state.params, b)
    apply_jit = jax.jit(lambda s, a: apply(s, a, tx=tx, schedule=schedule))
    apply_fn = lambda a: apply_jit(state, a)
    full_acc = acc_fn(zero_accum(params), make_batch(groups, advs, rows=8))
    full_state, full_metrics = apply_fn(full_acc)
    if aggregation == "token_mean":  # train_step is exactly apply(accumulate(zero, ...))
        one = jax.jit(
            lambda s, b: train_step(s, b, graphdef=graphdef, cfg=cfg, tx=tx, schedule=schedule)
        )
        step_state, _ = one(state, make_batch(groups, advs, rows=8))
        for a, b in zip(
            jax.tree.leaves(step_state.params), jax.tree.leaves(full_state.params), strict=True
        ):
            np.testing.assert_allclose(a, b, atol=TOL, rtol=0)
    for parts in (2, 4):
        acc = zero_accum(params)
        k = len(groups) // parts
        for i in range(parts):
            acc = acc_fn(
                acc, make_batch(groups[i * k : (i + 1) * k], advs[i * k : (i + 1) * k], rows=8)
            )
        for g, g_full in zip(
            jax.tree.leaves(acc.grads), jax.tree.leaves(full_acc.grads), strict=True
        ):
            np.testing.assert_allclose(
                g / acc.denominator, g_full / full_acc.denominator, atol=TOL, rtol=0
            )
        new_state, metrics = apply_fn(acc)
        np.testing.assert_allclose(metrics["loss"], full_metrics["loss"], atol=TOL, rtol=0)
        for a, b in zip(
            jax.tree.leaves(new_state.params), jax.tree.leaves(full_state.params), strict=True
        ):
            np.testing.assert_allclose(a, b, atol=TOL, rtol=0, err_msg=f"{parts} micro-batches")


@pytest.mark.slow  # ~28 s cold; the Ray bitwise run trains on a sharded mesh in the quick tier
def test_sharded_update_equals_unsharded():
    cfg = LearnerConfig(optimizer=WELL_CONDITIONED, micro_batch_rows=8, old_logprobs="sampler")
    model = create_model(get_preset("tiny"), seed=2)
    lm, _ = make_meshes(MeshConfig(learner_devices=8, learner_tp=2, colocated=True))
    assert dict(lm.shape) == {"fsdp": 4, "tp": 2}
    results = []
    for mesh in (_single_mesh(), lm):
        learner = Learner(model, cfg, mesh=mesh)
        learner.begin_round(updates=2)
        metrics = []
        for r in range(2):
            learner.add_groups(make_groups(2, seed=r))
            metrics.append(learner.update())
        results.append((learner.params, metrics))
    gate = results[1][0]["layers"][0]["mlp"]["gate"][...]
    assert gate.sharding.spec == jax.sharding.PartitionSpec("fsdp", "tp")
    for a, b in zip(jax.tree.leaves(results[0][0]), jax.tree.leaves(results[1][0]), strict=True):
        np.testing.assert_allclose(a, b, atol=TOL, rtol=0)
    for m0, m1 in zip(results[0][1], results[1][1], strict=True):
        np.testing.assert_allclose(m0["loss"], m1["loss"], atol=TOL)


def _on_policy_groups(model, groups, temperature=1.0):
    """The same groups with log-probs recomputed under `model` (as the sampler would report)."""
    batch = make_batch(groups, [(0.0,) * len(g.completions) for g in groups], rows=1)
    lp = np.asarray(
        jax.jit(
            lambda m, b: m.token_logprobs(
                b.inputs, b.positions, b.segments, b.targets, temperature=temperature
            )
        )(model, batch)
    )
    out, row = [], 0
    for g in groups:
        comps = []
        for c in g.completions:
            start = len(c.prompt) - 1
            logprobs = tuple(float(x) for x in lp[row, start : start + len(c.tokens)])
            comps.append(Completion(**{**c.__dict__, "logprobs": logprobs}))
            row += 1
        out.append(Group(request=g.request, completions=tuple(comps)))
    return out


@pytest.mark.slow  # ~30 s cold; test_decoupled_ppo_needs_the_samplers_logprobs stays quick
def test_later_updates_use_the_behavior_policy_not_the_updated_learner():
    model = create_model(get_preset("tiny"), seed=3)
    rounds = [_on_policy_groups(model, make_groups(2, seed=s)) for s in (10, 11)]
    params = {}
    for mode in ("snapshot", "sampler"):
        cfg = LearnerConfig(
            optimizer=OptimizerConfig(lr=1.0, eps=1.0), micro_batch_rows=8, old_logprobs=mode
        )
        learner = Learner(model, cfg, mesh=_single_mesh())
        learner.begin_round(updates=2)
        ratios = []
        for groups in rounds:
            learner.add_groups(groups)
            ratios.append(learner.update()["ratio"])
        params[mode] = learner.params
        assert ratios[0] == pytest.approx(1.0, abs=1e-5)
        assert abs(ratios[1] - 1.0) > 1e-3  # the learner has moved away from the behaviour policy
    for a, b in zip(
        jax.tree.leaves(params["snapshot"]), jax.tree.leaves(params["sampler"]), strict=True
    ):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=0)


def _shift_logprobs(group, c):
    comps = tuple(
        Completion(**{**x.__dict__, "logprobs": tuple(v - c for v in x.logprobs)})
        for x in group.completions
    )
    return Group(request=group.request, completions=comps)


@pytest.mark.parametrize(
    "loss, keys",
    [
        pytest.param("tis_reinforce", {"is_weight"}, marks=pytest.mark.slow),  # ~16 s cold
        ("ppo_clip", {"clip_frac_low", "clip_frac_high"}),
    ],
)
def test_update_reports_every_loss_metric_the_sampler_mismatch_and_the_ess(loss, keys):
    model = create_model(get_preset("tiny"), seed=3)
    groups = _on_policy_groups(model, make_groups(2, seed=10))
    cfg = LearnerConfig(optimizer=OptimizerConfig(lr=1e-3), micro_batch_rows=8, policy_loss=loss)

    shapes = []

    def update(gs):
        learner = Learner(model, cfg, mesh=_single_mesh())
        shapes.append(learner.micro_batches)
        learner.begin_round(updates=1)
        learner.add_groups(gs)
        return learner.update()

    m = update(groups)
    assert keys <= set(m)  # the loss's own metrics reach the logs
    # the padded area the update computed: whole micro-batches of one token budget, the last
    # of them perhaps a flush shape (half the budget: learner.flush_halvings 1)
    budget = shapes[0].rows * shapes[0].lengths[-1]
    assert m["positions"] > 0 and m["positions"] % (budget // 2) == 0
    filled = sum(len(c.prompt) + len(c.tokens) - 1 for g in groups for c in g.completions)
    assert m["padded_fraction"] == pytest.approx(1 - filled / m["positions"])
    assert m["logprob_diff_abs"] < 1e-5 and abs(m["logprob_kl"]) < 1e-6  # on-policy: numerics
    assert m["ess"] == pytest.approx(1.0, abs=1e-5)
    # The sampler reports log-probs c lower for group 0: delta = +c on its n1 tokens, 0 elsewhere.
    c = 0.5
    n1 = sum(len(x.tokens) for x in groups[0].completions)
    n = n1 + sum(len(x.tokens) for x in groups[1].completions)
    m = update([_shift_logprobs(groups[0], c), groups[1]])
    w = np.exp(c)
    assert m["logprob_diff_abs"] == pytest.approx(c * n1 / n, rel=1e-4)
    assert m["logprob_kl"] == pytest.approx((w - 1 - c) * n1 / n, rel=1e-3)
    assert m["ess"] == pytest.approx((n1 * w + n - n1) ** 2 / (n * (n1 * w * w + n - n1)), rel=1e-4)


def test_decoupled_ppo_needs_the_samplers_logprobs_and_reports_its_weights():
    model = create_model(get_preset("tiny"), seed=3)
    with pytest.raises(ValueError, match="old_logprobs='snapshot'; expected 'sampler'"):
        Learner(model, LearnerConfig(policy_loss="decoupled_ppo"), mesh=_single_mesh())
    cfg = LearnerConfig(
        optimizer=OptimizerConfig(lr=1e-3),
        micro_batch_rows=8,
        policy_loss="decoupled_ppo",
        old_logprobs="sampler",
    )
    learner = Learner(model, cfg, mesh=_single_mesh())
    learner.begin_round(updates=1)
    learner.add_groups(_on_policy_groups(model, make_groups(2, seed=10)))
    m = learner.update()
    assert m["behav_weight"] == pytest.approx(1.0, abs=1e-4) and m["behav_clip_frac"] == 0.0


def test_nan_loss_stops_naming_step_and_metric_and_keeps_state():
    learner = Learner(
        create_model(get_preset("tiny")), LearnerConfig(micro_batch_rows=4), mesh=_single_mesh()
    )
    learner.begin_round(updates=1)
    groups = make_groups(1)
    bad = Group(
        request=groups[0].request,
        completions=tuple(
            Completion(**{**c.__dict__, "reward": float("nan")}) for c in groups[0].completions
        ),
    )
    before = jax.tree.map(np.asarray, learner.params)
    learner.add_groups([bad])
    with pytest.raises(FloatingPointError, match=r"Non-finite loss=nan at update 0"):
        learner.update()
    assert learner.step == 0
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(learner.params), strict=True):
        np.testing.assert_array_equal(a, b)


def test_published_weights_equal_learner_params_in_sampler_dtype():
    model = create_model(get_preset("tiny"))
    lm, sm = make_meshes(
        MeshConfig(learner_devices=4, learner_tp=2, sampler_devices=4, sampler_tp=2)
    )
    learner = Learner(model, LearnerConfig(micro_batch_rows=4), mesh=lm)
    learner.begin_round(updates=1)
    learner.add_groups(make_groups(1))
    learner.update()
    sync = DevicePutSync(learner.params, sm, dtype="bfloat16")
    pub = sync.publish(learner.params, version=1)
    assert pub.version == 1 and pub.seconds > 0
    q = pub.params["layers"][0]["attn"]["q"][...]
    assert q.dtype == jnp.bfloat16 and set(q.sharding.device_set) == set(sm.devices.flat)
    assert q.sharding.spec == jax.sharding.PartitionSpec(None, "tp", None)
    for a, b in zip(jax.tree.leaves(pub.params), jax.tree.leaves(learner.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b.astype(jnp.bfloat16)))


def test_colocated_publish_shares_the_arrays_and_the_next_update_leaves_them_intact():
    # Learner and sampler on the same 2 devices with the same tp sharding and dtype: publishing
    # hands over the learner's arrays; its next update must write new buffers, not donate them.
    model = create_model(get_preset("tiny"))
    lm, sm = make_meshes(
        MeshConfig(learner_devices=2, learner_tp=2, sampler_devices=2, sampler_tp=2, colocated=True)
    )
    runs = {}
    for share in (True, False):
        learner = Learner(model, LearnerConfig(micro_batch_rows=4), mesh=lm)
        sync = DevicePutSync(learner.params, sm, share_with=learner if share else None)
        published = []
        for step in range(2):
            leaves = jax.tree.leaves(learner.params)
            published.append(sync.publish(learner.params, version=step).params)
            shared = [x is y for x, y in zip(jax.tree.leaves(published[-1]), leaves, strict=True)]
            assert all(shared) if share else not any(shared)
            before = [np.asarray(x) for x in jax.tree.leaves(published[-1])]
            learner.begin_round(updates=1)
            learner.add_groups(make_groups(1, seed=step))
            learner.update()
            after = jax.tree.leaves(published[-1])  # still readable and unchanged
            for b, x in zip(before, after, strict=True):
                np.testing.assert_array_equal(np.asarray(x), b)
        assert sync.shared == (2 if share else 0)
        runs[share] = [np.asarray(x) for x in jax.tree.leaves(learner.params)]
    for a, b in zip(runs[True], runs[False], strict=True):  # sharing changes no number
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("share", [True, False])
def test_a_publish_onto_more_devices_than_the_learners_survives_its_next_update(share):
    # Colocated smoke with 2 sampler replicas: the learner on device 0, the sampler on 0 and 1.
    # jax.device_put(may_alias=False) of a one-device array onto a mesh holding that device keeps
    # the array's own buffer as that device's shard; the learner's update then donated it, and
    # replica 0 decoded with a deleted (donated) parameter buffer. The publish must copy.
    model = create_model(get_preset("tiny"))
    lm, sm = make_meshes(MeshConfig(learner_devices=1, sampler_devices=2, colocated=True))
    assert set(lm.devices.flat) < set(sm.devices.flat)
    learner = Learner(model, LearnerConfig(micro_batch_rows=4), mesh=lm)
    sync = DevicePutSync(learner.params, sm, share_with=learner if share else None)
    for step in range(2):
        published = sync.publish(learner.params, version=step).params
        # copies: on CPU np.asarray is a view that would keep a buffer from being donated
        before = [np.asarray(x).copy() for x in jax.tree.leaves(published)]
        learner.begin_round(updates=1)
        learner.add_groups(make_groups(1, seed=step))
        learner.update()
        after = jax.tree.leaves(published)
        assert not any(x.is_deleted() for x in after)
        for b, x in zip(before, after, strict=True):  # still readable and unchanged
            np.testing.assert_array_equal(np.asarray(x), b)
    assert sync.shared == 0  # different devices: a copy, never the learner's arrays


def test_threads_place_one_publish_on_their_replicas_at_once():
    # A ReplicaSampler's replicas (and a replica joining mid-round) place a publish on their own
    # devices from several threads; jaxlib lists an array's per-device buffers lazily, and two
    # threads listing them first made one array of twice its shards (a multiplexed test failed
    # in CI: "safe_zip() argument 1 has length 3 but argument 0 has length 6").
    lm, sm = make_meshes(MeshConfig(learner_devices=1, sampler_devices=3, colocated=True))
    learner = Learner(create_model(get_preset("tiny")), LearnerConfig(), mesh=lm)
    sync = DevicePutSync(learner.params, sm)
    errors = []

    def place(published, device, start):
        start.wait()
        try:
            for x in jax.tree.leaves(published):
                jax.block_until_ready(jax.device_put(x, SingleDeviceSharding(device)))
        except ValueError as e:
            errors.append(e)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # the threads take turns often: the race gets its chances
    try:
        for version in range(10):  # new arrays each time: the race is on their first listing
            published = sync.publish(jax.tree.map(lambda x: x + 0, learner.params), version)
            start = threading.Barrier(3)
            threads = [
                threading.Thread(target=place, args=(published.params, d, start))
                for d in sm.devices.flat
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
    finally:
        sys.setswitchinterval(interval)
    assert not errors, errors


def test_bad_input_gets_clear_errors():
    groups = make_groups(1)
    with pytest.raises(ValueError, match="empty group list"):
        make_batch([], [], rows=4)
    empty = Group(
        request=groups[0].request,
        completions=tuple(
            Completion(**{**c.__dict__, "tokens": (), "logprobs": (), "versions": ()})
            for c in groups[0].completions
        ),
    )
    with pytest.raises(ValueError, match="hold no response tokens"):
        make_batch([empty], [(0.0,) * 4], rows=4)
    learner = Learner(
        create_model(get_preset("tiny")), LearnerConfig(micro_batch_rows=4), mesh=_single_mesh()
    )
    with pytest.raises(ValueError, match="no groups accumulated"):
        learner.update()
    lm, _ = make_meshes(MeshConfig(learner_devices=4, learner_tp=1, colocated=True))
    with pytest.raises(
        ValueError, match=r"micro_batch_rows \(6\) must be divisible .* \(4: fsdp\)"
    ):
        Learner(create_model(get_preset("tiny")), LearnerConfig(micro_batch_rows=6), mesh=lm)
    with pytest.raises(ValueError, match="Too few devices: the learner needs 6 and the sampler 4"):
        make_meshes(MeshConfig(learner_devices=6, sampler_devices=4))
    with pytest.raises(ValueError, match="learner_tp=3 does not divide"):
        make_meshes(MeshConfig(learner_devices=4, learner_tp=3))
    with pytest.raises(ValueError, match="Only 1 device"):
        make_meshes(MeshConfig(), devices=jax.devices()[:1])
    with pytest.raises(ValueError, match="needs norm_constant > 0"):
        LearnerConfig(aggregation="seq_mean_token_sum_norm")
    with pytest.raises(ValueError, match="Unknown policy loss 'ppo'"):
        LearnerConfig(policy_loss="ppo")


def test_training_raises_logprob_of_rewarded_responses():
    model = create_model(get_preset("tiny"), seed=4)
    groups = _on_policy_groups(model, make_groups(2, seed=7))
    learner = Learner(
        model,
        LearnerConfig(optimizer=OptimizerConfig(lr=1e-2), micro_batch_rows=8),
        mesh=_single_mesh(),
    )
    for _ in range(5):
        learner.begin_round(updates=1)
        learner.add_groups(groups)
        learner.update()
    after = _on_policy_groups(nnx.merge(learner.graphdef, learner.params), groups)
    for g0, g1 in zip(groups, after, strict=True):
        for c0, c1, a in zip(g0.completions, g1.completions, _advantages([g0])[0], strict=True):
            if abs(a) > 0.1:
                assert np.sign(sum(c1.logprobs) - sum(c0.logprobs)) == np.sign(a)


def test_update_that_overflows_the_parameters_is_not_applied_and_names_the_leaf():
    # Finite loss and gradients, but lr=1e39 (inf in float32) overflows the optimizer step: the
    # guard must look at the updated parameters and optimizer state, not only at loss and grad norm.
    learner = Learner(
        create_model(get_preset("tiny")),
        LearnerConfig(micro_batch_rows=4, optimizer=OptimizerConfig(lr=1e39)),
        mesh=_single_mesh(),
    )

    before = host_arrays(learner.state)
    learner.begin_round(updates=1)
    learner.add_groups(make_groups(1))
    with pytest.raises(
        FloatingPointError, match=r"Non-finite values in params/\S+ after update 0 \(loss="
    ):
        learner.update()
    assert learner.step == 0
    assert_bitwise_equal(learner.state, before)  # params, opt state, step, rng


def _with_reasons(group, reasons):
    return Group(
        request=group.request,
        completions=tuple(
            Completion(**{**c.__dict__, "finish_reason": r})
            for c, r in zip(group.completions, reasons, strict=True)
        ),
    )


@pytest.mark.slow  # its own learner shapes (~30 s cold)
def test_overlong_filter_masks_truncated_responses_out_of_the_loss():
    g = make_groups(1, g=4, seed=3)[0]
    kept = _with_reasons(g, ["stop", "length", "stop", "length"])
    # The filtered update equals one where the truncated rows' advantages are zero (their loss is
    # then 0) and the token count omits them: compare loss, tokens and the parameters.
    cfg = LearnerConfig(optimizer=WELL_CONDITIONED, micro_batch_rows=4, aggregation="token_mean")
    filtered = Learner(
        create_model(get_preset("tiny"), seed=2),
        LearnerConfig(
            optimizer=WELL_CONDITIONED,
            micro_batch_rows=4,
            aggregation="token_mean",
            overlong_filter=True,
        ),
        mesh=_single_mesh(),
    )
    filtered.begin_round(updates=1)
    filtered.add_groups([kept])
    m = filtered.update()
    lengths = [len(c.tokens) for c in g.completions]
    assert m["overlong_filtered"] == 2.0
    assert m["tokens"] == lengths[0] + lengths[2]
    assert m["sequences"] == 2.0

    graphdef, params = nnx.split(create_model(get_preset("tiny"), seed=2))
    tx, schedule = make_optimizer(cfg.optimizer), make_lr_schedule(cfg.optimizer)
    state, _ = create_train_state(params, tx, mesh=_single_mesh())
    batch = make_batch([g], _advantages([g]), rows=4, min_length_bucket=32)
    batch.loss_mask[[1, 3]] = 0.0  # by hand: rows 1 and 3 are the truncated completions
    ref_state, ref = train_step(state, batch, graphdef=graphdef, cfg=cfg, tx=tx, schedule=schedule)
    assert m["loss"] == pytest.approx(float(ref["loss"]), abs=TOL)
    for a, b in zip(
        jax.tree.leaves(filtered.params), jax.tree.leaves(ref_state.params), strict=True
    ):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=TOL)


def test_overlong_filter_with_every_response_truncated_skips_the_step():
    g = _with_reasons(make_groups(1, g=2, seed=4)[0], ["length", "length"])
    learner = Learner(
        create_model(get_preset("tiny")),
        LearnerConfig(micro_batch_rows=2, overlong_filter=True),
        mesh=_single_mesh(),
    )
    before = [np.asarray(x) for x in jax.tree.leaves(learner.params)]
    learner.begin_round(updates=1)
    learner.add_groups([g])
    m = learner.update()
    assert m["tokens"] == 0.0 and m["overlong_filtered"] == 2.0 and m["loss"] == 0.0
    assert learner.step == 0
    for a, b in zip(before, jax.tree.leaves(learner.params), strict=True):
        np.testing.assert_array_equal(a, np.asarray(b))


@pytest.mark.parametrize("loss", ["ppo_clip", "gspo", "tis_reinforce", "decoupled_ppo"])
def test_every_metric_a_loss_returns_and_the_ratio_extremes_reach_update_metrics(loss):
    from learner.step import sum_keys

    model = create_model(get_preset("tiny"), seed=3)
    groups = _on_policy_groups(model, make_groups(2, seed=10))
    cfg = LearnerConfig(
        optimizer=OptimizerConfig(lr=1e-3),
        micro_batch_rows=8,
        policy_loss=loss,
        old_logprobs="sampler",
    )
    learner = Learner(model, cfg, mesh=_single_mesh())
    learner.begin_round(updates=1)
    c = 0.5  # the sampler reports log-probs c lower for group 0: its ratio is e^c, group 1's 1
    learner.add_groups([_shift_logprobs(groups[0], c), groups[1]])
    m = learner.update()
    returned = set(sum_keys(cfg)) - {"tokens", "sequences", "ess_w", "ess_w2"}
    assert returned - {"clip_frac", "entropy", "kl", "ratio"}  # the loss's own metrics
    assert returned <= set(m)
    if loss in ("ppo_clip", "tis_reinforce"):  # token ratios
        assert m["ratio_max"] == pytest.approx(np.exp(c), rel=1e-4)
        assert m["ratio_min"] == pytest.approx(1.0, abs=1e-4)
    elif loss == "gspo":  # each sequence's ratio exp(mean log-ratio): the same two values
        assert m["ratio_max"] == pytest.approx(np.exp(c), rel=1e-4)
        assert m["ratio_min"] == pytest.approx(1.0, abs=1e-4)
    else:  # decoupled: the proximal ratio is 1; the behaviour weight carries e^c
        assert m["ratio_max"] == pytest.approx(1.0, abs=1e-6) == m["ratio_min"]
        assert m["behav_weight"] > 1.0


def _flat(group, reward=1.0):
    """The group with every reward equal: zero GRPO advantages, so the policy loss is 0."""
    return Group(
        request=group.request,
        completions=tuple(
            Completion(**{**c.__dict__, "reward": reward}) for c in group.completions
        ),
    )


@pytest.mark.parametrize(
    "estimator",
    [pytest.param(k, marks=pytest.mark.slow) for k in ("k1", "k3")],  # ~23 s cold each
)
def test_kl_to_reference_builds_the_reference_and_penalises_drift_from_it(estimator):
    from rl.losses import KL_ESTIMATORS, LossConfig

    model = create_model(get_preset("tiny"), seed=5)
    graphdef = nnx.split(model)[0]
    coef = 0.5
    cfg = LearnerConfig(
        optimizer=OptimizerConfig(lr=3e-2),
        micro_batch_rows=8,
        loss=LossConfig(kl_coef=coef, kl_estimator=estimator),
    )
    learner = Learner(model, cfg, mesh=_single_mesh())
    assert learner.ref_params is not None  # the reference model is built (a frozen copy)
    ref0 = [np.asarray(x) for x in jax.tree.leaves(learner.ref_params)]
    groups = make_groups(2, seed=11)
    learner.begin_round(updates=1)
    learner.add_groups(groups)  # mixed rewards: the policy moves away from the reference
    m0 = learner.update()
    assert m0["kl"] == pytest.approx(0.0, abs=1e-6)  # policy == reference at the first update

    flat = [_flat(g) for g in groups]
    batch = make_batch(flat, _advantages(flat), rows=8)

    def logp(params):
        mdl = nnx.merge(graphdef, params)
        return np.asarray(
            mdl.token_logprobs(batch.inputs, batch.positions, batch.segments, batch.targets)
        )

    mask = batch.loss_mask > 0
    d = logp(learner.params) - logp(learner.ref_params)
    expected_kl = float(np.asarray(KL_ESTIMATORS[estimator](jnp.asarray(d)))[mask].mean())
    assert abs(expected_kl) > 1e-6  # the policy did drift
    learner.begin_round(updates=1)
    learner.add_groups(flat)  # zero advantages: the loss is the KL term alone
    m1 = learner.update()
    assert m1["kl"] == pytest.approx(expected_kl, rel=1e-4, abs=1e-7)
    assert m1["loss"] == pytest.approx(coef * expected_kl, rel=1e-4, abs=1e-7)  # token_mean
    for a, b in zip(ref0, jax.tree.leaves(learner.ref_params), strict=True):
        np.testing.assert_array_equal(a, np.asarray(b))  # the reference never moves
