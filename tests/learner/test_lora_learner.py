"""A LoRA learner: it trains, checkpoints and publishes only the adapters, and its gradient is the
merged model's, taken through the low-rank product."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from learner.batching import make_batch
from learner.checkpoint import Checkpointer
from learner.config import LearnerConfig, OptimizerConfig
from learner.learner import Learner
from learner.publish import DevicePutSync
from learner.sft import SftTrainer
from learner.step import accumulate, zero_accum
from rl.models import ByteTokenizer, create_model, get_preset
from rl.models.config import LoraConfig
from rl.models.lora import merge_adapters, split_trainable
from rl.tasks.synthetic import addition_records
from tests.learner.test_learner import _advantages, _single_mesh, make_groups
from tests.rl.models.test_lora import tuned

LORA = LoraConfig(rank=4, alpha=8.0)
CFG = get_preset("tiny", init_std=0.3)


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


@pytest.mark.slow  # ~38 s cold; the quick tier keeps the adapter-only update and publish
def test_the_adapter_gradient_is_the_merged_models_through_the_low_rank_product():
    """dL/dA = s G B^T and dL/dB = s A^T G, with G the merged model's gradient on W (float32)."""
    cfg = LearnerConfig(policy_loss="ppo_clip", old_logprobs="sampler")
    model = tuned(CFG.replace(lora=LORA))
    graphdef, params = nnx.split(model)
    adapters, base = split_trainable(params)
    groups = make_groups(2, g=2)
    batch = make_batch(groups, _advantages(groups), rows=4)
    step = jax.jit(accumulate, static_argnames=("graphdef", "cfg"))
    got = step(zero_accum(adapters), adapters, batch, graphdef=graphdef, cfg=cfg, frozen=base)

    merged = merge_adapters(model)
    mgraph, mparams = nnx.split(merged)
    want = step(zero_accum(mparams), mparams, batch, graphdef=mgraph, cfg=cfg)
    assert float(got.numerator) == pytest.approx(float(want.numerator), rel=1e-5)
    s = LORA.scale
    checked = 0
    for i, block in enumerate(model.layers):
        for module_name in ("attn", "mlp"):
            module = getattr(block, module_name)
            for name, adapter in module.adapters.items():
                n_in = adapter.n_in
                g = want.grads["layers"][i][module_name][name][...]  # (*in, *out)
                a, b = adapter.a[...], adapter.b[...]
                out_axes = tuple(range(n_in, g.ndim))
                want_a = s * jnp.tensordot(g, b, axes=(out_axes, tuple(range(1, b.ndim))))
                want_b = s * jnp.tensordot(a, g, axes=(tuple(range(n_in)), tuple(range(n_in))))
                ours = got.grads["layers"][i][module_name]["adapters"][name]
                np.testing.assert_allclose(ours["a"][...], want_a, atol=1e-5, rtol=1e-4)
                np.testing.assert_allclose(ours["b"][...], want_b, atol=1e-5, rtol=1e-4)
                assert float(jnp.max(jnp.abs(want_b))) > 1e-4  # a gradient that says something
                checked += 1
    assert checked == 7 * CFG.n_layers


def test_a_lora_learner_updates_only_the_adapters_and_publishes_only_them():
    model = create_model(CFG.replace(lora=LORA), seed=0)
    cfg = LearnerConfig(optimizer=OptimizerConfig(lr=1e-2), micro_batch_rows=8)
    learner = Learner(model, cfg, mesh=_single_mesh())
    adapters, base = split_trainable(nnx.state(model))
    # the optimizer state mirrors the adapters only (Adam's mu and nu), nothing of the base
    n_opt = len(jax.tree.leaves(learner.state.opt_state))
    assert n_opt <= 2 * len(jax.tree.leaves(adapters)) + 4
    sync = DevicePutSync(learner.params, _single_mesh())
    first = sync.publish(learner.params, 0)
    full_bytes = sum(x.nbytes for x in jax.tree.leaves(learner.params))
    assert first.bytes == full_bytes
    learner.begin_round(updates=1)
    learner.add_groups(make_groups(2, seed=1))
    learner.update()
    after_base = learner.frozen
    for x, y in zip(_leaves(base), _leaves(after_base), strict=True):
        np.testing.assert_array_equal(x, y)
    changed = [
        not np.array_equal(x, y)
        for x, y in zip(_leaves(adapters), _leaves(learner.state.params), strict=True)
    ]
    assert any(changed)
    second = sync.publish(learner.params, 1)
    adapter_bytes = sum(x.nbytes for x in jax.tree.leaves(learner.state.params))
    assert second.bytes == adapter_bytes < full_bytes / 4
    for x, y in zip(_leaves(learner.params), _leaves(second.params), strict=True):
        np.testing.assert_array_equal(x, y)  # what the sampler holds is the whole new model


def test_a_lora_checkpoint_holds_the_adapters_and_restores_onto_a_rebuilt_base(tmp_path):
    cfg = LearnerConfig(optimizer=OptimizerConfig(lr=1e-2), micro_batch_rows=8)
    build = lambda: Learner(create_model(CFG.replace(lora=LORA), seed=0), cfg, mesh=_single_mesh())
    learner = build()
    learner.begin_round(updates=1)
    learner.add_groups(make_groups(2, seed=2))
    learner.update()
    ckpt = Checkpointer(tmp_path / "ckpt")
    ckpt.save(1, learner.state, {"round": 1})
    ckpt.close()
    params = learner.state.params
    assert set(jax.tree.leaves(jax.tree.map(lambda x: x.ndim, params))) == {2, 3}  # A/B factors
    fresh = build()
    state, meta = Checkpointer(tmp_path / "ckpt").restore(
        abstract_state=fresh.state, shardings=fresh.shardings
    )
    assert meta["round"] == 1
    restored = nnx.merge_state(fresh.frozen, state.params)
    for x, y in zip(_leaves(learner.params), _leaves(restored), strict=True):
        np.testing.assert_array_equal(x, y)


def test_sft_with_lora_trains_the_adapters_over_the_frozen_base():
    learner = Learner(
        create_model(CFG.replace(lora=LORA), seed=0),
        LearnerConfig(micro_batch_rows=8),
        mesh=_single_mesh(),
    )
    base = _leaves(learner.frozen)
    before = _leaves(learner.state.params)
    records = addition_records(16, digits=1, seed=0, split="train")
    sft = SftTrainer(
        learner,
        records,
        ByteTokenizer(),
        batch_size=8,
        lr=1e-2,
        warmup_steps=0,
        seed=0,
        min_length_bucket=16,
    )
    first = None
    for _ in range(5):
        sft.step()
        first = sft.loss() if first is None else first
    assert sft.loss() < first
    sft.commit()
    for x, y in zip(base, _leaves(learner.frozen), strict=True):
        np.testing.assert_array_equal(x, y)
    assert any(
        not np.array_equal(x, y) for x, y in zip(before, _leaves(learner.state.params), strict=True)
    )
