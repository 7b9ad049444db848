"""The Ray runtime's workers: the learner worker, the sampler replicas and the complete-group queue.

Each worker builds its own part of the run from the run's config through the composition root
(rl.runtime.compose), on the devices its process sees (Ray gives each its GPUs; on CPU every
process sees the host). Methods return errors as values where the caller must re-raise the exact
exception (the queue's QueueClosed, a sampler thread's crash); a dead worker surfaces in the caller
as ray.exceptions.RayActorError, which rl.runtime.ray_runtime turns into a fault decision.

The learner is one worker, or (config.ray.learner_workers > 1, one per host) a group of them forming
one jax.distributed job whose mesh spans the group (learner/distributed.py): rank 0 serves the
job's coordinator, rl.runtime.ray_runtime.LearnerClient sends every call to each worker and takes
rank 0's answer, and collectives (publishing, fetching the state) run in every worker.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import ray
from flax import nnx

from learner.checkpoint import Checkpointer
from learner.distributed import (
    DistributedConfig,
    coordinator_address_here,
    gather_to_host,
    init_learner_group,
    initialize,
)
from learner.mesh import MeshConfig, lent_meshes, make_meshes
from learner.publish import DevicePutSync
from rl.admission import make_policy
from rl.models.build import create_model, model_config_from
from rl.models.config import DTYPES
from rl.queue import GroupQueue
from rl.runtime.compose import (
    Setup,
    build_checked_model,
    build_engine,
    build_learner,
    build_reward,
    build_sft,
    evaluate_heldout,
    export_policy,
    rollout_reward,
    updates_per_round,
)
from rl.timeline import Timeline
from sampler.loop import SamplerLoop
from sampler.transfer import from_host, to_host


def _config(config_dict: dict[str, Any]) -> Any:

    return ml_collections.ConfigDict(config_dict)


def local_mesh(config: Any, side: str, devices: list[Any] | None = None) -> Any:
    """The `side` ("learner" | "sampler") mesh over this process's first config.mesh.<side>_devices
    devices (0: every device the process sees) with config.mesh.<side>_tp; `devices`: another
    process's instead (a lending replica names the learner worker's mesh so)."""

    devices = jax.local_devices() if devices is None else devices
    n = config.mesh[f"{side}_devices"] or len(devices)
    tp = config.mesh[f"{side}_tp"]
    learner, sampler = make_meshes(
        MeshConfig(
            learner_devices=n, sampler_devices=n, learner_tp=tp, sampler_tp=tp, colocated=True
        ),
        devices,
    )
    return learner if side == "learner" else sampler


def job_devices(ids: list[int]) -> list[Any]:
    """The jax devices of the learner's jax.distributed job with these ids (every process's)."""

    by_id = {d.id: d for d in jax.devices()}
    return [by_id[i] for i in ids]


def join_job(config: Any, job: tuple[str, int, int]) -> None:
    """Joins the learner's jax.distributed job (coordinator, processes, rank) that the learner
    worker (rank 0) and the replicas lending it their devices form (elastic.borrowing learner /
    both); the job outlives a replica that dies."""

    coordinator, processes, rank = job
    initialize(
        DistributedConfig(
            coordinator_address=coordinator,
            num_processes=processes,
            process_id=rank,
            initialization_timeout_s=config.learner.distributed.initialization_timeout_s,
        ),
        recoverable=True,
    )


def pin(cores: list[int]) -> list[int]:
    """Pins this worker process to `cores` (os.sched_setaffinity); returns the cores it has."""
    os.sched_setaffinity(0, cores)
    return sorted(os.sched_getaffinity(0))


@ray.remote
class QueueActor:
    """rl.queue.GroupQueue in an actor: backpressure, close and fail across processes.

    A threaded actor, so a put blocked on a full queue does not block gets.
    """

    def __init__(self, maxsize: int):

        self.queue = GroupQueue(maxsize)

    def put(self, group: Any, timeout: float | None = None) -> BaseException | None:
        try:
            self.queue.put(group, timeout)
        except BaseException as e:  # re-raised in the caller, same type
            return e
        return None

    def get(self, timeout: float | None = None) -> tuple[Any, BaseException | None]:
        try:
            return self.queue.get(timeout), None
        except BaseException as e:
            return None, e

    def close(self) -> None:
        self.queue.close()

    def fail(self, error: BaseException) -> None:
        self.queue.fail(error)

    def counters(self) -> dict[str, float]:
        q = self.queue
        return {
            "puts": q.puts,
            "gets": q.gets,
            "max_depth": q.max_depth,
            "put_wait_s": q.put_wait_s,
            "get_wait_s": q.get_wait_s,
        }


@ray.remote
class LearnerWorker:
    """Owns the Learner (and its checkpoints) on this process's devices; with several workers,
    this one is process `rank` of the learner's jax.distributed job (learner/distributed.py)."""

    def __init__(self, config_dict: dict[str, Any], total_updates: int, rank: int = 0):
        self._config_dict, self._total_updates, self.rank = config_dict, total_updates, rank
        self.group = 1
        self.learner = None
        self.ckpt = None
        self.sft = None  # the SFT warm start (learner.sft.SftTrainer), while it runs
        self.lendable: list[ReplicaCore] = []  # replicas on its devices, built at the first lend

    def coordinator(self) -> str:
        """A "host:port" on this worker's node for the job's coordinator (rank 0 serves it)."""

        return coordinator_address_here(ray.util.get_node_ip_address())

    def build(self, coordinator: str, group: int, lenders: int = 0) -> int:
        """Builds the Learner: on this process's devices (group 1), or joins the `group`-process
        job at `coordinator` first, its mesh over every worker's devices. With `lenders` (group
        1), the job is this worker and that many replicas that lend it their devices (rank 0
        here; ReplicaCore's `job`). Returns the step."""

        config = _config(self._config_dict)
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
        # The cast DevicePutSync makes, on the learner's devices: a replica gets the same bits.
        self._cast = jax.jit(
            lambda p: jax.tree.map(
                lambda x: x.astype(dtype) if dtype and jnp.issubdtype(x.dtype, jnp.floating) else x,
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

    def publish(self, version: int) -> list[Any]:
        """Puts the params, cast to the sampler's dtype, in the object store once; returns
        [ref] (in a list, so Ray hands the caller the reference, not the arrays)."""
        host = self._to_host(self._cast(self.learner.params))
        return [ray.put(host) if self.rank == 0 else None]  # every worker gathers; rank 0 puts

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
        learner devices, putting groups on `queue`; returns how many (ray_runtime.LentReplica
        addresses them by number). They are built once and kept, so a later lend compiles
        nothing. The driver holds the learner's work while they decode."""

        if not self.lendable:
            devices = list(self.learner.mesh.devices.flat)
            per, tp = self.config.mesh.sampler_devices or 1, self.config.mesh.sampler_tp
            self.lendable = [
                ReplicaCore(self._config_dict, queue, mesh=m) for m in lent_meshes(devices, per, tp)
            ]
        return len(self.lendable)

    def lent_call(self, j: int, method: str, *args: Any) -> Any:
        """ReplicaCore `method` of lent replica j (what ray_runtime.LentReplica's calls run)."""
        return getattr(self.lendable[j], method)(*args)

    def unlend(self, j: int) -> BaseException | None:
        """Stops lent replica j's loop (the router removed it) and readies a fresh one for the
        next lend: the learner's devices are its own again. Returns the loop's error, if any."""
        error = self.lendable[j].close()
        self.lendable[j].renew()
        return error


class ReplicaCore:
    """A sampler replica: an Engine + SamplerLoop on this process's devices, rewards computed
    here, complete groups put straight onto the queue actor.

    `SamplerReplica` is this class as a Ray actor (a replica process of its own); the learner
    worker hosts instances on its own devices while it lends them to the sampler (BiDiRL
    borrowing: LearnerWorker.lend). Every method is safe to call while the loop thread runs.

    Migration (JigsawRL, rl.runtime.ray_migration): `view`, `reserve`/`unreserve`, `handoff` (asks
    for requests to be taken out at the loop's next step boundary), `take_handoffs` (what was
    taken, each in the object store as a sampler.transfer.HostHandoff) and `adopt`.

    Lending its devices to the learner (elastic.borrowing learner / both): the replica is a process
    of the learner's jax.distributed job (`job`), and while the learner borrows it runs the same
    Learner calls (`learner_*`) on a Learner of its own whose arrays are the borrowed shards only.

    Args:
      config_dict: the run's config.
      queue: the QueueActor.
      mesh: the engine's mesh; None: this process's first mesh.sampler_devices devices (a lent
        replica gets one over the learner's devices).
      job: (coordinator, processes, rank) of the learner's jax.distributed job to join first.
    """

    def __init__(
        self,
        config_dict: dict[str, Any],
        queue: Any,
        mesh: Any = None,
        job: tuple[str, int, int] | None = None,
    ):

        config = _config(config_dict)
        if job is not None:  # before any other jax work
            join_job(config, job)
        self.config, self.setup = config, Setup.from_config(config)
        self.queue = queue
        self.learner: Any = None  # the Learner of the borrowed steps (learner_prepare)
        if mesh is None:
            mesh = local_mesh(config, "sampler")
        model = build_checked_model(config, self.setup, mesh)  # structure; weights are published
        self.engine = build_engine(config, self.setup, mesh, model)
        # The learner worker already cast to the sampler dtype: this only places the arrays.
        self.sync = DevicePutSync(nnx.split(model)[1], mesh, rules=self.setup.rules)
        self.reward = build_reward(config, self.setup)
        self.eval_reward = build_reward(config, self.setup)
        self.timeline = Timeline()
        self._migration = threading.Lock()  # the handoffs asked for and taken
        self._asked: set[tuple[int, int]] = set()
        self._outbox: dict[tuple[int, int], Any] = {}
        self._new_loop = lambda: SamplerLoop(
            self.engine,
            None,
            admission=make_policy(config.driver.admission),
            reward_fn=rollout_reward(config, self.reward),
            emit=self._emit,
            group_atomic=config.driver.group_atomic,
            recompute_kv=config.driver.recompute_kv,
            timeline=self.timeline,
            on_boundary=self._boundary,
        )
        self.loop = self._new_loop()

    def renew(self) -> None:
        """A fresh loop (no weights, nothing queued) on the same engine: a lent replica's next
        lend reuses its compiled engine. Handoffs asked of the old loop are forgotten with it."""
        with self._migration:
            self._asked.clear()
            self._outbox.clear()
        self.loop = self._new_loop()

    def _emit(self, group: Any) -> None:
        error = ray.get(self.queue.put.remote(group))
        if error is not None:
            raise error

    def pin(self, cores: list[int]) -> list[int]:
        return pin(cores)

    def num_slots(self) -> int:
        return self.engine.max_concurrent_decodes

    def set_params(self, params: Any, version: int) -> None:
        self.loop.set_params(self.sync.publish(params, version).params, version)

    def start(self) -> None:
        self.loop.start()

    def submit(self, requests: list[Any]) -> None:
        self.loop.submit(requests)

    def abort(self, keys: list[tuple[int, int]]) -> int:
        """Aborts requests by (round, uid), waiting or running (a key not here is a no-op);
        returns how many were aborted."""
        return len(self.loop.abort(keys))

    def error(self) -> BaseException | None:
        return self.loop.error

    def stats(self) -> tuple[Any, list[Any], list[Any]]:
        """(SamplerStats, the timeline's spans and instants since the last call)."""

        stats = dataclasses.replace(self.loop.stats)
        return stats, *self.timeline.take()

    def reward_stats(self) -> tuple[dict[str, int], dict[str, int]]:
        return self.reward.stats(), self.eval_reward.stats()

    def evaluate(self, params: Any, records: list[Any], k: int) -> dict[str, float]:

        published = self.sync.publish(params, -1).params
        return evaluate_heldout(
            self.config, self.setup, self.engine, published, records, self.eval_reward, k
        )

    # ------------------------------------------------ lending its devices to the learner (BiDiRL)

    def job_devices(self) -> list[int]:
        """The ids of the engine's devices in the learner's jax.distributed job."""
        return [d.id for d in self.engine.mesh.devices.flat]

    def learner_prepare(self, ids: list[int], total_updates: int) -> None:
        """Builds this replica's Learner: the learner worker's mesh (process 0's devices, none of
        them here: its arrays hold no shard until a borrow), the same model structure and
        optimizer over `total_updates`, its extended mesh's steps compiled (`ids`: every lender's
        devices, as the learner worker names them)."""

        if self.learner is None:
            home = local_mesh(
                self.config, "learner", [d for d in jax.devices() if d.process_index == 0]
            )
            model = create_model(
                model_config_from(self.config.model),
                seed=self.config.seed,
                mesh=home,
                rules=self.setup.rules,
            )
            self.learner = build_learner(
                self.config, self.setup, model, home, total_updates=total_updates
            )
        self.learner.prepare_borrow(job_devices(ids))

    def learner_borrow(self, ids: list[int], snapshot: Any) -> None:
        self.learner.borrow(job_devices(ids), snapshot)

    def learner_add_groups(self, groups: list[Any]) -> None:
        self.learner.add_groups(groups)

    def learner_update(self) -> None:
        self.learner.update()

    def learner_give_back(self) -> None:
        self.learner.give_back()

    # -------------------------------------------------------------------------------- migration

    def view(self) -> Any:
        """This replica as the migration policy sees it (rl.elastic.migration.ReplicaView)."""
        return self.loop.view()

    def reserve(self, n: int) -> list[int] | None:
        return self.loop.reserve(n)

    def unreserve(self, slots: list[int]) -> None:
        self.loop.unreserve(slots)

    def handoff(self, keys: list[tuple[int, int]]) -> None:
        """Asks for requests `keys` to be taken out at the loop's next step boundary."""
        with self._migration:
            self._asked.update(map(tuple, keys))

    def take_handoffs(self) -> dict[tuple[int, int], Any]:
        """The handoffs done since the last call: key -> [ObjectRef of a HostHandoff, its bytes,
        its running samples] (in a list, so Ray hands the caller the reference), or None for a
        request that no longer runs here."""
        with self._migration:
            for key in [k for k in self._asked if not self.loop.running(k)]:
                self._asked.discard(key)  # finished, aborted or cut before a boundary came
                self._outbox[key] = None
            out, self._outbox = self._outbox, {}
        return out

    def _boundary(self) -> None:
        """On the loop's thread between decode steps: the asked-for handoffs."""

        with self._migration:
            asked, self._asked = sorted(self._asked), set()
            for key in asked:
                handoff = self.loop.handoff(key)
                if handoff is None:
                    self._outbox[key] = None
                else:
                    host = to_host(handoff)
                    self._outbox[key] = [ray.put(host), host.nbytes, len(host.samples)]

    def adopt(self, handoff: list[Any], slots: list[int]) -> bool:
        """Takes over a request another replica handed off (take_handoffs' [ref, ...]) into
        slots `reserve` gave, one per running sample; False (slots given back) when its state cannot be fetched: it was
        lost with its source."""

        try:
            host = ray.get(handoff[0])
        except ray.exceptions.RayError:
            self.loop.unreserve(slots)
            return False
        self.loop.adopt(from_host(host), slots)
        return True

    def request_stop(self) -> None:
        self.loop.request_stop()

    def close(self) -> BaseException | None:
        """Stops the sampler loop (evaluation still runs; RayRuntime.close ends the actor)."""
        try:
            self.loop.close()
        except BaseException as e:
            return e
        return None


SamplerReplica = ray.remote(ReplicaCore)
