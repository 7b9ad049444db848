"""Logical-axis rules and creating the model directly on a mesh."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from rl.models import DEFAULT_RULES, axis_rules, create_model, get_preset, logical_to_spec
from rl.models.sharding import normalize_rules


def _mesh(shape, names):
    return Mesh(np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape), names)


LEARNER = _mesh((4, 2), ("fsdp", "tp"))
SAMPLER = _mesh((4, 2), ("data", "tp"))


@pytest.mark.parametrize(
    "mesh,names,shape,expected",
    [
        (LEARNER, ("embed", "mlp"), (64, 128), P("fsdp", "tp")),
        (LEARNER, ("q_heads", "head_dim", "embed"), (4, 16, 64), P("tp", None, "fsdp")),
        # activations: batch takes fsdp first, so embed stays unsharded
        (LEARNER, ("batch", "length", "embed"), (8, 5, 64), P("fsdp", None, None)),
        (SAMPLER, ("embed", "mlp"), (64, 128), P(None, "tp")),
        (
            SAMPLER,
            ("batch", "cache_length", "kv_heads", "head_dim"),
            (8, 32, 2, 16),
            P("data", None, "tp", None),
        ),
        # a 259-token byte vocabulary does not divide by tp=2: replicated rather than an error
        (LEARNER, ("vocab", "embed"), (259, 64), P(None, "fsdp")),
        (LEARNER, (None, "unknown"), (3, 4), P(None, None)),
    ],
)
def test_logical_to_spec(mesh, names, shape, expected):
    assert logical_to_spec(names, mesh, DEFAULT_RULES, shape=shape) == expected


def test_batch_uses_both_data_and_fsdp_on_a_combined_mesh():
    mesh = _mesh((2, 2, 2), ("data", "fsdp", "tp"))
    assert logical_to_spec(("batch", "embed"), mesh, DEFAULT_RULES) == P(("data", "fsdp"), None)


def test_bad_rules_are_rejected():
    with pytest.raises(ValueError, match="Sharding rule #1"):
        normalize_rules([("embed", "fsdp"), ("mlp",)])
    assert normalize_rules([["mlp", ["tp"]]]) == (("mlp", ("tp",)),)


@pytest.mark.parametrize("mesh", [LEARNER, SAMPLER], ids=["learner", "sampler"])
def test_create_model_on_mesh_matches_unsharded(mesh):
    cfg = get_preset("tiny")
    plain = create_model(cfg, seed=5)
    sharded = create_model(cfg, seed=5, mesh=mesh)
    flat_plain = dict(nnx.to_flat_state(nnx.state(plain)))
    for path, var in nnx.to_flat_state(nnx.state(sharded)):
        value = var[...]
        names = var.get_metadata()["logical_axes"]
        assert value.sharding.spec == logical_to_spec(names, mesh, shape=value.shape), path
        # same random numbers; jit may fuse `std * normal` differently from eager (1 ulp)
        np.testing.assert_allclose(
            value, flat_plain[path][...], rtol=1e-6, atol=0, err_msg=str(path)
        )
    mlp = sharded.layers[0].mlp.gate[...]
    assert {s.data.shape for s in mlp.addressable_shards} == (
        {(16, 64)} if "fsdp" in mesh.axis_names else {(64, 64)}
    )
    tokens = jax.random.randint(jax.random.key(0), (8, 6), 0, cfg.vocab_size)
    positions = jnp.broadcast_to(jnp.arange(6), (8, 6))
    segs = jnp.ones((8, 6), jnp.int32)
    fwd = jax.jit(lambda m, *a: m(*a))
    ref = fwd(plain, tokens, positions, segs)
    with jax.set_mesh(mesh), axis_rules(DEFAULT_RULES):
        got = fwd(sharded, tokens, positions, segs)
    np.testing.assert_allclose(got, ref, atol=1e-5, rtol=0)
