"""The Ray runtime's weight transfer pieces that run without Ray (the end-to-end pulls: test_ray)."""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from rl.runtime import ray_weights
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
    with pytest.raises(KeyError, match=r"no longer staged .* keeps the sampler's last 2"):
        server.offer(ids[0])


def test_evaluations_never_push_out_a_version_the_sampler_still_pulls():
    server = WeightServer("127.0.0.1")
    leaves = [jnp.ones((3,))]
    current = server.keep(leaves)
    evaluations = [server.keep(leaves, evaluation=True) for _ in range(KEEP + 1)]
    server.offer(current)  # (a replica joining late pulls the sampler's version)
    with pytest.raises(KeyError, match="no longer staged"):
        server.offer(evaluations[0])  # one not offered goes with the next evaluation's
    server.offer(evaluations[-1])
    with pytest.raises(KeyError, match="no longer staged"):
        server.offer(evaluations[-1])  # pulled once
    assert server.staged == [current]


def test_a_ticket_of_another_model_is_refused_with_the_first_difference():
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    like = {"a": jax.ShapeDtypeStruct((2, 3), jnp.bfloat16)}
    puller = WeightPuller(like, mesh, "127.0.0.1")
    ticket = Ticket(address="127.0.0.1:1", uuid=1, learner=None, shapes=(((3, 2), "bfloat16"),))
    with pytest.raises(ValueError, match=r"do not match .* \(\(3, 2\), 'bfloat16'\) vs"):
        puller.pull(ticket)


class _Learner:
    """The learner worker's `offer` as a replica calls it (`offer.remote`), in this process."""

    def __init__(self, offer):
        self.offer = type("Method", (), {"remote": staticmethod(offer)})()


def test_a_pull_from_a_server_in_this_process_and_one_that_never_arrives(monkeypatch):
    monkeypatch.setattr(ray_weights.ray, "get", lambda x: x)  # offer answers in place, not a ref
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    params = {"a": jnp.arange(6.0).reshape(2, 3), "b": jnp.ones((4,), jnp.bfloat16)}
    server = WeightServer("127.0.0.1")
    uuid = server.keep(jax.tree.leaves(params))
    shapes = tuple((tuple(x.shape), str(x.dtype)) for x in jax.tree.leaves(params))
    ticket = Ticket(server.address, uuid, _Learner(server.offer), shapes)
    puller = WeightPuller(params, mesh, "127.0.0.1", timeout_s=30)
    got = puller.pull(ticket)
    jax.tree.map(np.testing.assert_array_equal, got, params)
    # an evaluation's version leaves the books as it is offered; the pull still gets it whole
    once = server.keep([x + 1 for x in jax.tree.leaves(params)], evaluation=True)
    got = puller.pull(Ticket(server.address, once, _Learner(server.offer), shapes))
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b + 1), got, params)
    assert once not in server.staged
    # a learner that hands out a pull and dies before serving it: an error, not a wait for ever
    ticket = Ticket(server.address, uuid, _Learner(lambda uuid: 10**6), shapes)
    puller = WeightPuller(params, mesh, "127.0.0.1", timeout_s=1)
    with pytest.raises(TimeoutError, match=r"version \d+ \(pull 1000000\) .* did not arrive"):
        puller.pull(ticket)
    # serve the dangling pull late, so that no transfer is left pending when the process exits
    server.server.await_pull(10**6, jax.tree.leaves(params))
    for thread in threading.enumerate():
        if thread.name == "weights-pull":
            thread.join(30)
            assert not thread.is_alive()
