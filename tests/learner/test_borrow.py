"""The learner on a mesh extended over borrowed sampler devices: same parameters, then back."""

import jax
import numpy as np
import pytest

from learner.config import LearnerConfig
from learner.learner import Learner
from learner.mesh import MeshConfig, make_meshes
from rl.models import create_model, get_preset
from tests.learner.test_learner import WELL_CONDITIONED, make_groups

# float32: the extended mesh reduces gradients over 8 shards instead of 4 (another summation
# order); measured max abs diff over the parameters after 3 updates ~1e-7 (see the report).
TOL = 1e-5


def _run(borrow_at: set[int], seed: int, kl: float = 0.0):
    # micro_batch_rows 8: the flush shape's 4 rows divide the learner's 4 batch shards, not the
    # extended mesh's 8, where an update's last micro-batch takes the full 8 (MicroBatches.on)
    cfg = LearnerConfig(optimizer=WELL_CONDITIONED, micro_batch_rows=8, old_logprobs="snapshot")
    if kl:
        import dataclasses

        cfg = dataclasses.replace(cfg, loss=dataclasses.replace(cfg.loss, kl_coef=kl))
    lm, sm = make_meshes(MeshConfig(learner_devices=4, sampler_devices=4))
    learner = Learner(create_model(get_preset("tiny"), seed=seed), cfg, mesh=lm)
    sampler_devices = list(sm.devices.flat)
    learner.begin_round(updates=3)
    for u in range(3):
        if u in borrow_at and not learner.borrowing:
            learner.borrow(sampler_devices)
            assert set(learner.mesh.devices.flat) == set(jax.devices()[:8])
        learner.add_groups(make_groups(2, seed=seed * 10 + u))
        if u == 1 and learner.borrowing:  # mid-update accumulator moves too
            learner.give_back()
        learner.add_groups(make_groups(2, seed=seed * 10 + u + 5))
        learner.update()
    if learner.borrowing:
        learner.give_back()
    assert set(learner.mesh.devices.flat) == set(lm.devices.flat)
    return learner


# Both in the slow tier (~35 s cold each: a learner on its own and on an extended mesh); the quick
# tier keeps borrowing's policy, lending and simulator tests.
@pytest.mark.slow
@pytest.mark.parametrize("seed,kl", [(0, 0.0), (1, 0.1)])  # kl: the reference moves too
def test_update_on_borrowed_mesh_equals_own_mesh_and_run_continues(seed, kl):
    own = _run(set(), seed, kl)
    borrowed = _run({0, 2}, seed, kl)  # borrow for update 0-1 (returned mid-update 1), again at 2
    diff = max(
        float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
        for a, b in zip(jax.tree.leaves(own.params), jax.tree.leaves(borrowed.params), strict=True)
    )
    assert diff <= TOL, diff
    assert own.step == borrowed.step == 3
    for leaf in jax.tree.leaves(borrowed.state):  # every leaf back on the learner's 4 devices
        assert len(leaf.sharding.device_set) <= 4
    # The borrowed steps compiled once, ahead, and were reused by the second switch.
    counts = borrowed.compile_counts()
    assert counts["apply@borrowed"] == 1 and counts["zero@borrowed"] == 1
    if kl:
        assert len(jax.tree.leaves(borrowed.ref_params)[0].sharding.device_set) <= 4
    with pytest.raises(ValueError, match="expected devices disjoint from the learner's"):
        borrowed.borrow(list(borrowed.mesh.devices.flat))
    with pytest.raises(RuntimeError, match="give_back called while not borrowing"):
        borrowed.give_back()
    print(f"seed {seed}: max abs parameter diff, borrowed vs own mesh: {diff:.3g}")


def _one_update(seed: int, hook_borrows: bool):
    """One update of 16 groups added at once; with `hook_borrows` the learner borrows from
    add_groups' `before_batch` at its second micro-batch (async borrowing's mid-Add switch)."""
    # unpacked rows of one sequence each: several micro-batches per Add
    cfg = LearnerConfig(optimizer=WELL_CONDITIONED, micro_batch_rows=8, packing=False)
    lm, sm = make_meshes(MeshConfig(learner_devices=4, sampler_devices=4))
    learner = Learner(create_model(get_preset("tiny"), seed=seed), cfg, mesh=lm)
    calls = []

    def before_batch():
        calls.append(learner.borrowing)
        if hook_borrows and len(calls) == 2:
            learner.borrow(list(sm.devices.flat))

    learner.begin_round(updates=1)
    groups = make_groups(16, seed=seed, max_response=60, prompt_len=40)
    learner.add_groups(groups, before_batch=before_batch)
    learner.update()
    if learner.borrowing:
        learner.give_back()
    return learner, calls


@pytest.mark.slow
def test_a_borrow_between_two_micro_batches_of_one_add_leaves_the_update_unchanged():
    own, calls = _one_update(0, hook_borrows=False)
    hooked, hooked_calls = _one_update(0, hook_borrows=True)
    assert len(calls) >= 3 and calls == [False] * len(calls)  # once per micro-batch
    assert hooked_calls[:3] == [False, False, True]  # moved before the second one
    for a, b in zip(jax.tree.leaves(own.params), jax.tree.leaves(hooked.params), strict=True):
        assert float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) <= TOL
