"""The Ray runtime's weight transfer pieces that run without Ray (the end-to-end pulls: test_ray)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from rl.runtime.ray_weights import KEEP, Ticket, WeightPuller, WeightServer, one_device


def test_one_device_gathers_a_sharded_tree_whole_onto_the_first_device():
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("fsdp", "tp"))
    spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp", "tp"))
    x = jax.device_put(jnp.arange(32.0).reshape(4, 8), spec)
    (y,) = one_device({"w": x}, mesh)
    assert y.sharding.device_set == {mesh.devices.flat[0]}
    np.testing.assert_array_equal(np.asarray(y), np.arange(32.0).reshape(4, 8))


def test_the_server_keeps_the_last_versions_and_gives_each_pull_an_id_of_its_own():
    server = WeightServer("127.0.0.1")
    leaves = [jnp.ones((3,))]
    ids = [server.keep(leaves) for _ in range(KEEP + 1)]
    pulls = [server.offer(ids[-1]), server.offer(ids[-1])]
    assert len(set(pulls) | set(ids)) == KEEP + 3  # two pulls of one version: two transfer ids
    with pytest.raises(KeyError, match=r"no longer staged .* keeps the last 2"):
        server.offer(ids[0])


def test_a_ticket_of_another_model_is_refused_with_the_first_difference():
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    like = {"a": jax.ShapeDtypeStruct((2, 3), jnp.bfloat16)}
    puller = WeightPuller(like, mesh, "127.0.0.1")
    ticket = Ticket(address="127.0.0.1:1", uuid=1, learner=None, shapes=(((3, 2), "bfloat16"),))
    with pytest.raises(ValueError, match=r"do not match .* \(\(3, 2\), 'bfloat16'\) vs"):
        puller.pull(ticket)
