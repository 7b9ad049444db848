"""Device split: the learner mesh and the sampler replicas' meshes (learner/mesh.py)."""

import jax
import pytest

from learner.mesh import MeshConfig, make_meshes, replica_meshes


def ids(mesh):
    return sorted(d.id for d in mesh.devices.flatten())


def test_sampler_replicas_get_disjoint_devices():
    learner, sampler = make_meshes(MeshConfig(sampler_replicas=2))  # 8 devices: 4 + 2 x 2
    parts = replica_meshes(sampler, 2)
    assert ids(learner) == [0, 1, 2, 3]
    assert [ids(m) for m in parts] == [[4, 5], [6, 7]]
    assert all(m.axis_names == ("data", "tp") for m in parts)
    _, sampler = make_meshes(MeshConfig(sampler_devices=1, sampler_replicas=3, sampler_tp=1))
    assert [ids(m) for m in replica_meshes(sampler, 3)] == [[5], [6], [7]]  # per replica: 1
    _, sampler = make_meshes(MeshConfig(sampler_devices=2, sampler_tp=2, sampler_replicas=2))
    assert [m.shape["tp"] for m in replica_meshes(sampler, 2)] == [2, 2]
    assert len(jax.devices()) == 8


@pytest.mark.parametrize(
    "cfg, match",
    [
        (dict(sampler_replicas=3), r"sampler_replicas=3 does not divide the sampler's 4 devices"),
        (dict(sampler_replicas=0), r"mesh.sampler_replicas must be >= 1; received 0"),
        (dict(sampler_routing="random"), r"mesh.sampler_routing='random'; expected one of"),
        (
            dict(sampler_replicas=2, sampler_tp=4),
            r"sampler_tp=4 does not divide the sampler's 2 devices \(per replica\)",
        ),
    ],
)
def test_bad_replica_splits_are_named(cfg, match):
    with pytest.raises(ValueError, match=match):
        make_meshes(MeshConfig(**cfg))
