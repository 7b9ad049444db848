"""Weights from the Ray learner worker to the sampler replicas: pulled device to device, or through
the object store (config.ray.weights).

- "transfer": the learner worker runs a `jax.experimental.transfer` server (the transfer service
  JAX ships for moving arrays between processes that share no job). A publish stages the params,
  cast to the sampler's dtype, whole on the learner's first device (`WeightServer.stage`: a copy
  on the devices; a learner of several processes replicates them over its mesh with a collective
  first, and rank 0 stages its copy) and hands the router a `Ticket`: the server's address, a
  version's id and the leaves' shapes. A replica given a ticket asks the worker to offer that version
  to it under a transfer id of its own (`LearnerWorker.offer`, on a thread of its own, so it
  answers while the worker trains), pulls the leaves onto its first device (`WeightPuller`) and places them on its mesh (a
  device_put inside its process). No byte goes through the object store, pickle or a numpy array.
  A pull is one-sided: each replica takes the weights when it is handed them (async replicas
  between decode steps), and a replica that joins later (the router's add_replica, a lent replica)
  pulls the same ticket; a collective would have every replica and the learner enter one program
  at the same instant. The socket transport stages through host memory inside PjRt on GPU (DCN on
  TPU); what it removes is the object store's put, its copies and Python's pickling. The sampler's
  last two staged versions are kept: one extra copy of the sampler-dtype params on the learner's
  first device. An evaluation's version is staged apart and dropped once offered (one replica
  pulls it, once), so an evaluation never pushes out a version a replica still pulls.
- "object_store": the params as host arrays, put in the object store once by the learner worker
  (rank 0, after a gather), got and placed by each replica.
- "auto" (the default): transfer where the learner worker's server starts, else the object store,
  with one logged line saying why.

`RaySync` is the Driver's WeightSync over either: the learner worker publishes and the router hands
what it returns (an ObjectRef or a Ticket) to every replica, whose `place` gets the arrays.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import ray
from jax.experimental import transfer
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from learner.publish import Published
from rl.runtime.ray_learner_client import RemoteParams

KEEP = 2  # staged versions a learner worker keeps for pulls (the newest and the one before)
# A pull whose bytes have not all arrived by then fails (a learner worker that died mid-pull would
# otherwise leave the replica waiting for ever): minutes, for a large model over a slow link.
PULL_TIMEOUT_S = 600.0


def start_server(host: str) -> Any:
    """A transfer server of this process's devices, listening on `host` (one transport per device).

    Raises whatever jaxlib raises where the transfer service is not available."""
    client = jax.local_devices()[0].client
    transports = [f"{host}:0"] * jax.local_device_count()
    return transfer.start_transfer_server(client, f"{host}:0", transports)


@dataclasses.dataclass(frozen=True)
class Ticket:
    """A published version a replica pulls from the learner worker's transfer server."""

    address: str  # the learner worker's transfer server
    uuid: int  # the id of this version's staged leaves (each pull gets a transfer id of its own)
    learner: Any  # the learner worker's actor handle (its `offer`)
    shapes: tuple[tuple[tuple[int, ...], str], ...]  # each leaf's shape and dtype, in tree order


def one_device(cast: Any, mesh: Any) -> list[jax.Array]:
    """The leaves of `cast` (the params in the sampler's dtype, in buffers of their own: the
    learner's next update donates its own) whole on the first device of `mesh` in this process.
    With a mesh over several processes it is a collective every learner process joins (each gets
    its copy)."""
    leaves = jax.tree.leaves(cast)
    if any(not x.is_fully_addressable for x in leaves):
        whole = jax.jit(lambda x: x, out_shardings=NamedSharding(mesh, PartitionSpec()))(leaves)
        leaves = [x.addressable_shards[0].data for x in whole]
    else:
        first = min(mesh.local_devices, key=lambda d: d.id)
        leaves = jax.device_put(leaves, SingleDeviceSharding(first))
    return jax.block_until_ready(leaves)


class WeightServer:
    """The learner worker's side of "transfer": its server and the last KEEP staged versions.

    `keep` runs on the worker's main thread (a publish), `offer` on its weights thread."""

    def __init__(self, host: str):
        self.server = start_server(host)
        self.address = self.server.address()
        self._staged: dict[int, list[jax.Array]] = {}
        self._evaluation: int | None = None  # the evaluation's version, dropped once offered
        self._next = 1
        self._lock = threading.Lock()

    def keep(self, leaves: list[jax.Array], *, evaluation: bool = False) -> int:
        """Stages `leaves` (on one device, in buffers of their own: `one_device`) for pulling;
        returns their id (a Ticket's). The sampler's versions older than its last KEEP are
        dropped. An `evaluation` version is pulled once, by the replica that evaluates: it is
        dropped once offered, and counts nowhere else, so evaluations never push out a version
        the sampler's replicas (one joining late included: ReplicaRouter.add_replica) pull."""
        with self._lock:
            uuid, self._next = self._next, self._next + 1
            self._staged[uuid] = leaves
            if evaluation:  # (one not offered, its evaluation failed, goes with the next)
                self._staged.pop(self._evaluation, None)
                self._evaluation = uuid
            else:
                sampler = sorted(u for u in self._staged if u != self._evaluation)
                for old in sampler[:-KEEP]:
                    del self._staged[old]
        return uuid

    @property
    def staged(self) -> list[int]:
        """The ids of the versions staged now."""
        with self._lock:
            return sorted(self._staged)

    def offer(self, uuid: int) -> int:
        """Lets one replica pull staged version `uuid`: under a transfer id of its own, returned
        (two pullers awaiting one id can cross and wait for ever)."""
        with self._lock:
            leaves = self._staged.get(uuid)
            if leaves is None:
                raise KeyError(
                    f"Weights transfer {uuid} is no longer staged on the learner worker (it keeps "
                    f"the sampler's last {KEEP}: {sorted(self._staged)}; an evaluation's until "
                    "it is offered once); expected a replica to pull a version before two newer "
                    "ones are published."
                )
            pull, self._next = self._next, self._next + 1
            if uuid == self._evaluation:  # (the server holds the leaves until they are pulled)
                self._evaluation = None
                del self._staged[uuid]
        self.server.await_pull(pull, leaves)
        return pull


class WeightPuller:
    """A replica's side of "transfer": pulls a Ticket's leaves onto this process's first device."""

    def __init__(
        self, params_like: Any, mesh: Any, host: str, *, timeout_s: float = PULL_TIMEOUT_S
    ):
        self._host = host
        self._timeout_s = timeout_s
        leaves, self._treedef = jax.tree.flatten(params_like)
        self._shapes = tuple((tuple(x.shape), str(np.dtype(x.dtype))) for x in leaves)
        self._device = min(mesh.local_devices, key=lambda d: d.id)
        self._server: Any = None
        self._connections: dict[str, Any] = {}

    def pull(self, ticket: Ticket) -> Any:
        """The ticket's params as a tree like `params_like`, on the first device of this mesh."""
        if ticket.shapes != self._shapes:
            raise ValueError(
                f"The published weights ({len(ticket.shapes)} leaves) do not match this replica's "
                f"model ({len(self._shapes)} leaves); expected the learner and the replicas to be "
                "built from one config. First difference: "
                + next(
                    (
                        f"{a} vs {b}"
                        for a, b in zip(ticket.shapes, self._shapes, strict=False)
                        if a != b
                    ),
                    "the number of leaves",
                )
            )
        if self._server is None:
            self._server = start_server(self._host)
        connection = self._connections.get(ticket.address)
        if connection is None:
            connection = self._connections[ticket.address] = self._server.connect(ticket.address)
        pull = ray.get(ticket.learner.offer.remote(ticket.uuid))
        sharding = SingleDeviceSharding(self._device)
        specs = [jax.ShapeDtypeStruct(s, jnp.dtype(d), sharding=sharding) for s, d in self._shapes]
        leaves = connection.pull(pull, specs)
        self._arrived(leaves, f"version {ticket.uuid} (pull {pull}) from {ticket.address}")
        return jax.tree.unflatten(self._treedef, leaves)

    def _arrived(self, leaves: list[jax.Array], what: str) -> None:
        """Waits until the pulled leaves are on the device, at most the timeout (the wait runs on
        a daemon thread: a transfer that never completes cannot be cancelled, only left; jaxlib
        then aborts the process at exit, after the error has reached the driver)."""
        error: list[BaseException] = []
        done = threading.Event()

        def wait() -> None:
            try:
                jax.block_until_ready(leaves)
            except BaseException as e:  # handed to the puller
                error.append(e)
            finally:
                done.set()

        threading.Thread(target=wait, name="weights-pull", daemon=True).start()
        if not done.wait(self._timeout_s):
            raise TimeoutError(
                f"The weights {what} did not arrive within {self._timeout_s:g} s; expected the "
                "learner worker to serve them (did it die mid-transfer?)."
            )
        if error:
            raise error[0]


class RaySync:
    """WeightSync of the Ray runtime: the learner worker publishes (a Ticket, or an ObjectRef of
    host arrays), the router hands that to every replica (module docstring).

    `Published.bytes` is what each replica receives; `object_store_bytes` sums what went through
    the object store (0 with "transfer")."""

    def __init__(self) -> None:
        self.object_store_bytes = 0

    def publish(self, params: Any, version: int) -> Published:
        if not isinstance(params, RemoteParams):
            raise TypeError(
                "RaySync.publish expects the learner worker's params (LearnerClient.params); "
                f"received {type(params).__name__}."
            )
        start = time.perf_counter()
        handle, nbytes = params.client.publish(version)
        if not isinstance(handle, Ticket):
            self.object_store_bytes += nbytes
        return Published(
            params=handle, version=version, seconds=time.perf_counter() - start, bytes=nbytes
        )
