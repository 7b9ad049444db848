"""The Ray runtime's learner worker: the Learner (and its checkpoints) in a Ray actor.

`LearnerWorker` builds the Learner from the run's config through the composition root
(rl.runtime.compose) on the devices its process sees; rl.runtime.ray_learner_client.LearnerClient
is the Driver's view of it. A dead worker surfaces in the caller as ray.exceptions.RayActorError,
which the client turns into LearnerDied.

The learner is one worker, or (config.ray.learner_workers > 1, one per host) a group of them forming
one jax.distributed job whose mesh spans the group (learner/distributed.py): rank 0 serves the
job's coordinator, LearnerClient sends every call to each worker and takes rank 0's answer, and
collectives (publishing, fetching the state) run in every worker.

Weights: `publish` stages the params for the replicas to pull (config.ray.weights "transfer": a
transfer server, `serve_weights`, and `offer` on a thread of its own) or puts them in the object
store (rl.runtime.ray_weights).

Elastic devices: the worker lends its devices to the sampler (`lend`: sampler replicas,
rl.runtime.ray_replica.ReplicaCore, hosted here) and borrows the replicas' devices
(`prepare_borrow` / `borrow` / `give_back`: learner.Learner's, over the learner's job).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import ray

from learner.checkpoint import Checkpointer
from learner.distributed import coordinator_address_here, gather_to_host, init_learner_group
from learner.mesh import lent_meshes
from learner.publish import EVALUATION
from rl.models.config import DTYPES
from rl.runtime.compose import (
    Setup,
    build_checked_model,
    build_learner,
    build_sft,
    export_policy,
    updates_per_round,
)
from rl.runtime.ray_cluster import actor_repr
from rl.runtime.ray_process import job_devices, join_job, local_mesh, pin, worker_config
from rl.runtime.ray_replica import ReplicaCore
from rl.runtime.ray_weights import Ticket, WeightServer, one_device


@ray.remote(concurrency_groups={"weights": 1})
class LearnerWorker:
    """Owns the Learner (and its checkpoints) on this process's devices; with several workers,
    this one is process `rank` of the learner's jax.distributed job (learner/distributed.py)."""

    def __repr__(self) -> str:  # its role, in Ray's error messages (rl.runtime.worker_errors)
        return actor_repr(self)

    def __init__(self, payload: dict[str, Any], total_updates: int, rank: int = 0):
        # the run's config and registrations (ray_process.worker_payload)
        self._payload, self._total_updates, self.rank = payload, total_updates, rank
        self.group = 1
        self.learner = None
        self.ckpt = None
        self.sft = None  # the SFT warm start (learner.sft.SftTrainer), while it runs
        self.lendable: list[ReplicaCore] = []  # replicas on its devices, built at start (lend)
        self.transfer = False  # publishes stage for pulls (config.ray.weights); else object store
        self.weights: WeightServer | None = None  # rank 0's transfer server, with "transfer"

    def coordinator(self) -> str:
        """A "host:port" on this worker's node for the job's coordinator (rank 0 serves it)."""

        return coordinator_address_here(ray.util.get_node_ip_address())

    def build(self, coordinator: str, group: int, lenders: int = 0) -> int:
        """Builds the Learner: on this process's devices (group 1), or joins the `group`-process
        job at `coordinator` first, its mesh over every worker's devices. With `lenders` (group
        1), the job is this worker and that many replicas that lend it their devices (rank 0
        here; ReplicaCore's `job`). Returns the step."""

        config = worker_config(self._payload)
        setup = Setup.from_config(config)
        if group > 1:
            dist = config.learner.distributed
            dist.coordinator_address, dist.num_processes = coordinator, group
            dist.process_id = self.rank
            mesh = init_learner_group(config)
        else:
            if lenders:
                join_job(config, (coordinator, 1 + lenders, 0))
            mesh = local_mesh(config, "learner")
        self.group = group
        model = build_checked_model(config, setup, mesh)
        self.learner = build_learner(config, setup, model, mesh, total_updates=self._total_updates)
        self.learner.precompile(updates_per_round=updates_per_round(config))
        self.config, self.setup = config, setup
        dtype = DTYPES[config.sampler_dtype] if config.sampler_dtype else None
        # The cast DevicePutSync makes, on the learner's devices (a replica gets the same bits),
        # into buffers of their own: the next update donates the learner's.
        self._cast = jax.jit(
            lambda p: jax.tree.map(
                lambda x: jnp.copy(
                    x.astype(dtype) if dtype and jnp.issubdtype(x.dtype, jnp.floating) else x
                ),
                p,
            )
        )
        return self.learner.step

    def _to_host(self, tree: Any) -> Any:
        """`tree` as host arrays; with several processes a collective every worker joins."""

        return gather_to_host(tree) if self.group > 1 else jax.device_get(tree)

    def pin(self, cores: list[int]) -> list[int]:
        return pin(cores)

    def step(self) -> int:
        return self.learner.step

    def devices(self) -> int:
        """The learner mesh's devices in this process."""
        return len(self.learner.mesh.devices.flat)

    def compile_stats(self) -> dict[str, dict[str, float]]:
        """The learner's programs: compiled, seconds, after start (rl/compiles.py)."""
        return self.learner.compiles.stats("learner")

    def start_compile_budget(self) -> None:
        self.learner.compiles.start()

    def begin_round(self, updates: int) -> int:
        self.learner.begin_round(updates=updates)
        return self.learner.step

    def add_groups(self, groups: list[Any]) -> int:
        self.learner.add_groups(groups)
        return self.learner.step

    def update(self) -> tuple[dict[str, float], int]:
        return self.learner.update(), self.learner.step

    def serve_weights(self, weights: str) -> str:
        """Chooses how publishes reach the replicas (config.ray.weights, rl.runtime.ray_weights):
        with "transfer" or "auto", rank 0 starts a transfer server. Returns "" when publishes go
        by transfer, else why they go through the object store. Raises where "transfer" was
        asked for and the server cannot start."""
        self.transfer = weights != "object_store"
        if not self.transfer or self.rank:
            return "" if self.transfer else "config.ray.weights='object_store'"
        try:
            self.weights = WeightServer(ray.util.get_node_ip_address())
        except Exception as e:  # noqa: BLE001 - jaxlib's error, reported or raised below
            if weights == "transfer":
                raise RuntimeError(
                    f"config.ray.weights='transfer', but the learner worker's transfer server "
                    f"(jax.experimental.transfer) did not start: {type(e).__name__}: {e}. "
                    "Expected a jaxlib with the transfer service, or config.ray.weights="
                    "'object_store' / 'auto'."
                ) from e
            self.transfer = False
            return f"the transfer server did not start ({type(e).__name__}: {e})"
        return ""

    def use_transfer(self, on: bool) -> None:
        """Publishes go by transfer (`on`, once `serve_weights` started the server) or through
        the object store (rank 0's server did not start; launch.bench_publish alternates)."""
        self.transfer = on

    def publish(self, version: int) -> list[Any]:
        """The params, cast to the sampler's dtype, staged for the replicas' pulls (a Ticket) or
        put in the object store once; returns [ticket or ref, bytes] (in a list, so Ray hands
        the caller the reference, not the arrays). Every publish moves the whole model, a LoRA
        run's base included (learner/publish.py's DevicePutSync moves only what changed)."""
        cast = self._cast(self.learner.params)
        if self.transfer:
            leaves = one_device(cast, self.learner.mesh)  # with several workers: a collective
            nbytes = sum(x.nbytes for x in leaves)
            if self.weights is None:  # rank > 0
                return [None, nbytes]
            ticket = Ticket(
                address=self.weights.address,
                uuid=self.weights.keep(leaves, evaluation=version == EVALUATION),
                learner=ray.get_runtime_context().current_actor,
                shapes=tuple((tuple(x.shape), str(x.dtype)) for x in leaves),
            )
            return [ticket, nbytes]
        host = self._to_host(cast)
        nbytes = sum(x.nbytes for x in jax.tree.leaves(host))
        return [ray.put(host) if self.rank == 0 else None, nbytes]  # rank 0 puts

    @ray.method(concurrency_group="weights")
    def offer(self, uuid: int) -> int:
        """Lets one replica pull staged version `uuid`; returns its transfer id (a thread of its
        own: answers while the worker trains)."""
        return self.weights.offer(uuid)

    def sft_begin(self, records: list[Any]) -> None:
        """Starts the SFT warm start (rl.runtime.compose.build_sft) on `records`."""

        self.sft = build_sft(self.config, self.setup, self.learner, records)

    def sft_step(self) -> None:
        self.sft.step()

    def sft_loss(self) -> float:
        return self.sft.loss()

    def sft_commit(self) -> None:
        self.sft.commit()

    def state(self) -> Any:
        """The TrainState as host arrays."""
        return self._to_host(self.learner.state)

    def export_hf(self, path: str) -> None:

        export_policy(self.config, self.setup, self.learner, path)

    def open_checkpoints(self, directory: str) -> None:

        self.ckpt = Checkpointer(directory)

    def save(self, step: int, meta: dict[str, Any]) -> None:
        self.ckpt.save(step, self.learner.state, meta)

    def restore(self, strict: bool) -> dict[str, Any]:
        self.learner.state, meta = self.ckpt.restore(
            abstract_state=self.learner.state, shardings=self.learner.shardings, strict=strict
        )
        return meta

    def close_checkpoints(self) -> None:
        if self.ckpt is not None:
            self.ckpt.close()
            self.ckpt = None

    # ------------------------------------------ borrowing the replicas' devices (BiDiRL, learner)

    def prepare_borrow(self, ids: list[int]) -> None:
        """Compiles the steps of the mesh extended over the lending replicas' devices `ids`."""
        self.learner.prepare_borrow(job_devices(ids))

    def borrow_snapshot(self) -> list[Any]:
        """[ref] of the Learner's borrow_snapshot in the object store (what the lenders join with)."""
        return [ray.put(self.learner.borrow_snapshot())]

    def borrow(self, ids: list[int], snapshot: Any) -> None:
        self.learner.borrow(job_devices(ids), snapshot)

    def give_back(self) -> None:
        self.learner.give_back()

    # ------------------------------------------------------ lending (BiDiRL sampler borrowing)

    def lend(self, queue: Any) -> int:
        """Builds a sampler replica (ReplicaCore) on each mesh.sampler_devices of this worker's
        learner devices, putting groups on `queue`; returns how many (ray_host.HostedReplica
        addresses them by number). They are built once and kept, so a later lend compiles
        nothing. The driver holds the learner's work while they decode."""

        if not self.lendable:
            devices = list(self.learner.mesh.devices.flat)
            per, tp = self.config.mesh.sampler_devices or 1, self.config.mesh.sampler_tp
            self.lendable = [
                ReplicaCore(self._payload, queue, mesh=m) for m in lent_meshes(devices, per, tp)
            ]
        return len(self.lendable)

    def lent_call(self, j: int, method: str, *args: Any) -> Any:
        """ReplicaCore `method` of lent replica j (what ray_host.HostedReplica's calls run)."""
        return getattr(self.lendable[j], method)(*args)

    def unlend(self, j: int) -> BaseException | None:
        """Stops lent replica j's loop (the router removed it) and readies a fresh one for the
        next lend: the learner's devices are its own again. Returns the loop's error, if any."""
        error = self.lendable[j].close()
        self.lendable[j].renew()
        return error
