"""The compile budget: programs compiled ahead run without compiling; later compiles are counted."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from learner.config import LearnerConfig, OptimizerConfig
from learner.learner import Learner
from learner.mesh import MeshConfig, make_meshes
from rl.compiles import CompileCounter, compile_stats, round_compiles
from rl.models import create_model, get_preset
from tests.learner.test_learner import make_groups


def test_precompiled_programs_run_without_compiling_and_late_ones_warn_once(caplog):
    counter = CompileCounter()
    double = counter.jit("double", lambda x, *, y: x * 2 + y)
    abstract = jax.ShapeDtypeStruct((4,), jnp.float32)
    double.precompile(abstract, y=abstract)
    assert counter.counts() == {"double": 1} and counter.seconds()["double"] > 0
    counter.start()
    out = double(jnp.ones(4), y=jnp.ones(4))
    np.testing.assert_array_equal(out, np.full(4, 3.0))
    assert counter.after_start() == {"double": 0}  # the precompiled executable ran
    with caplog.at_level(logging.WARNING, logger="rl.compiles"):
        double(jnp.ones(8), y=jnp.ones(8))  # a shape nobody compiled ahead
        double(jnp.ones(16), y=jnp.ones(16))
    assert counter.counts() == {"double": 3} and counter.after_start() == {"double": 2}
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "double compiled after start" in warnings[0]
    assert "float32[8]" in warnings[0]
    stats = compile_stats({"x": counter})
    assert stats["x.double"]["programs"] == 3 and stats["x.double"]["after_start"] == 2
    delta = round_compiles(stats, compile_stats({"x": CompileCounter()}))
    assert delta["compiles"] == 3 and delta["compiles_after_start"] == 2


@pytest.mark.slow
def test_learner_compiles_nothing_after_start_over_varied_lengths():
    """Random lengths from 1 to the cap, snapshot old log-probs and a colocated publish: every
    program a run calls is compiled by precompile, and there are few of them."""
    mesh, _ = make_meshes(MeshConfig(learner_devices=2, learner_tp=1, colocated=True))
    cfg = LearnerConfig(
        optimizer=OptimizerConfig(lr=1e-3),
        micro_batch_rows=2,
        min_length_bucket=16,
        max_length=64,
        old_logprobs="snapshot",
    )
    learner = Learner(create_model(get_preset("tiny")), cfg, mesh=mesh)
    assert learner.micro_batches.lengths == (16, 32, 64)
    learner.precompile(updates_per_round=2, shared_params=True)
    programs = sum(learner.compile_counts().values())
    # zero, copy, apply, apply_keep_params, and accumulate per length x {current, snapshot} (no
    # flush shape: its 1 row would not divide over the mesh's 2 batch shards)
    assert programs == 4 + 3 * 2
    learner.compiles.start()
    rng = np.random.default_rng(0)
    for r in range(4):
        learner.begin_round(updates=2)
        for u in range(2):
            groups = make_groups(3, g=4, seed=10 * r + u, max_response=int(rng.integers(2, 55)))
            learner.add_groups(groups)
            if u == 1:
                learner.share_params()  # a colocated publish: the next update keeps them
            assert learner.update()["tokens"] > 0
    assert all(v == 0 for v in learner.compiles.after_start().values()), learner.compile_counts()
    assert sum(learner.compile_counts().values()) == programs
