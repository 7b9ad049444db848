"""The Ray runtime: the same Driver and schedules as the threaded one, its sides in Ray actors.

    python -m launch.train --config=configs/smoke.py --config.runtime=ray \
        --config.mesh.sampler_replicas=2

This process (the Ray driver) runs rl.driver.Driver and its schedule. Around it:
- a learner worker (rl.runtime.ray_workers.LearnerWorker) owning the Learner on its devices;
  `LearnerClient` gives the Driver the Learner's methods;
- N sampler replicas (SamplerReplica: an Engine + SamplerLoop each, rewards computed there) behind
  `ReplicaRouter`, the Driver's Sampler: it routes each request (one group) round-robin or to the
  least-loaded replica, decides tail batching's round cuts on the groups of every replica (and
  aborts a full cut's other requests on each), and merges the replicas' timeline events into the
  driver's timeline (slot lanes numbered across replicas, args["replica"]) for per-replica metrics;
- the complete-group queue (QueueActor: rl.queue.GroupQueue's semantics, backpressure, close,
  fail) that replicas put into and `QueueClient` takes from;
- weights through the object store (`ObjectStoreSync`, a WeightSync): the learner worker puts the
  params as host arrays once, every replica gets them.
The SFT warm start runs on the learner worker too (`RemoteSft`: learner.sft.SftTrainer there,
driven step by step by rl.run as in the threaded runtime).

Elastic devices: long-tail migration (config.elastic.migration) moves running requests between
replica actors, their decode state through the object store (rl.runtime.ray_migration: the same
policy as the threaded runtime, asked from a thread of this process). Sampler borrowing
(config.elastic.borrowing="sampler") lends the learner worker's devices to the sampler: the worker
hosts extra replicas on them (LearnerWorker.lend; `LentReplica` is their handle) that the router
adds while the learner waits for a round's groups and removes once the sampler drains. The
learner borrows the replicas' devices (config.elastic.borrowing="learner"): the replicas are
processes of the learner worker's jax.distributed job from the start (ranks 1..N), and while the
rollout is drained the learner's mesh extends over their devices, each replica running the same
Learner calls on its shards (`LearnerClient`; learner.Learner.borrow across processes).

Faults: a replica that dies (RayActorError) has its unfinished requests re-sampled on the others
(config.ray.on_replica_failure="resample"; per-request randomness makes their tokens identical, and
a group already delivered is never taken twice) or the run stops with its error ("stop"). A dead
learner worker stops the run with a clear error, and so does a replica dying while the learner
trains on its devices (LenderDied); one dying otherwise ends the learner's borrowing (the job
outlives it: jax_enable_recoverability). Resume from the last checkpoint continues the exact
trajectory (the checkpoint is written by the learner worker, the data and planner state by
this process, at the same round).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import time
from collections.abc import Iterable
from typing import Any

import jax
import ml_collections
import ray
from ray.exceptions import RayActorError

import rl
from learner.publish import Published
from rl.driver import Driver
from rl.elastic.borrowing import BorrowConfig
from rl.elastic.migration import make_migration_policy
from rl.runtime.compose import build_borrower, build_lender, migration_config_from
from rl.runtime.mesh_plan import plan_mesh
from rl.runtime.ray_config import check_ray_config
from rl.runtime.ray_router import QueueClient, ReplicaRouter
from rl.runtime.ray_workers import LearnerWorker, QueueActor, SamplerReplica
from rl.timeline import Timeline
from rl.types import Group


def planned_config(config: Any) -> tuple[Any, Any]:
    """config with the planner's split fixed in (config.mesh.split="plan"; rl.runtime.mesh_plan),
    and the plan. The devices split are the cluster's GPUs (the learner worker then gets
    learner_devices of them, each replica sampler_devices), or, on a CPU cluster, the devices each
    worker process sees (every worker takes its first ones)."""

    gpus = int(ray.cluster_resources().get("GPU", 0))
    mesh, plan = plan_mesh(config, gpus or len(jax.devices()))
    out = ml_collections.ConfigDict(config.to_dict())
    for name in ("split", "learner_devices", "sampler_devices", "sampler_replicas"):
        out.mesh[name] = getattr(mesh, name)
    if gpus:
        out.ray.learner_gpus, out.ray.replica_gpus = mesh.learner_devices, mesh.sampler_devices
    return out, plan


def worker_env() -> dict[str, Any]:
    """runtime_env for the workers: this checkout's code first on their path, and this process's
    JAX/XLA settings (platform, fake CPU device count, compilation cache)."""

    root = os.path.dirname(os.path.dirname(os.path.abspath(rl.__file__)))
    env = {k: v for k, v in os.environ.items() if k.startswith(("JAX_", "XLA_"))}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    return {"env_vars": env}


def connect(cfg: Any) -> bool:
    """Joins the cluster at cfg.address ("auto" or host:port), or starts a local one ("").

    Returns:
      Whether this call started Ray (and so shuts it down at the end).
    """
    if ray.is_initialized():
        return False
    kwargs: dict[str, Any] = dict(
        log_to_driver=cfg.log_to_driver,  # workers' output stays in Ray's log files unless asked
        logging_level=logging.INFO if cfg.log_to_driver else logging.ERROR,
        include_dashboard=False,
    )
    if cfg.address:
        ray.init(address=cfg.address, **kwargs)
    else:
        ray.init(num_cpus=cfg.num_cpus or None, **kwargs)
    return True


def actor_name(config: Any, role: str) -> str:
    """The Ray name of a run's worker ("learner", "replica0", "queue"): one run per workdir."""
    return f"rolloutpipe:{os.path.abspath(config.workdir)}:{role}"


class LearnerDied(RuntimeError):
    """The learner worker died: the run stops; resume continues from the last checkpoint."""


def _learner_died(e: BaseException) -> LearnerDied:
    return LearnerDied(
        f"The learner worker died ({type(e).__name__}: {str(e).splitlines()[0]}); the run "
        "stopped. Expected it to live: resume with --config.resume=True continues from the last "
        "checkpoint in <workdir>/ckpt."
    )


@dataclasses.dataclass(frozen=True)
class RemoteParams:
    """The learner's params, left where they live (the learner worker)."""

    client: LearnerClient


MIRRORED = ("add_groups", "update", "give_back")  # the lenders' Learner makes these calls too


class LenderDied(RuntimeError):
    """A replica died while the learner trained on its devices: the run stops (resume continues
    from the last checkpoint)."""


class LearnerClient:
    """The Learner's interface over the learner worker group (one worker per host; rank 0 answers).

    With `lenders` (elastic.borrowing learner / both: replicas in the learner's jax.distributed
    job), `borrow` extends the learner's mesh over their devices: each lender joins with the
    learner worker's borrow_snapshot, and until `give_back` every add_groups and update runs in
    the lenders too (the same calls, one SPMD program over the extended mesh). `usable` says
    whether every lender lives (a borrow is declined otherwise).
    """

    def __init__(self, workers: list[Any], lenders: list[Any] = (), *, total_updates: int = 0):
        self.workers, self.lenders = workers, list(lenders)
        self.total_updates = total_updates
        self.borrowing = False
        self.usable: Any = lambda: True
        self._step = self._call("step")

    def _call(self, method: str, *args: Any) -> Any:
        if self.borrowing and method not in (*MIRRORED, "step"):
            raise RuntimeError(
                f"LearnerClient.{method} while the learner borrows the replicas' devices; "
                "expected it after give_back (the driver gives them back before publishing)."
            )
        lenders = self.lenders if self.borrowing and method in MIRRORED else []
        refs = [getattr(w, method).remote(*args) for w in self.workers]
        return self._get(refs, [getattr(r, f"learner_{method}").remote(*args) for r in lenders])

    def _get(self, refs: list[Any], lender_refs: list[Any] = ()) -> Any:
        try:
            out = ray.get(refs)[0]
        except RayActorError as e:
            raise _learner_died(e) from None
        try:
            ray.get(list(lender_refs))
        except RayActorError as e:
            raise LenderDied(
                f"A sampler replica died while the learner trained on its devices "
                f"({type(e).__name__}: {str(e).splitlines()[0]}); the run stopped. Expected it "
                "to live: resume with --config.resume=True continues from the last checkpoint."
            ) from None
        return out

    @property
    def step(self) -> int:
        return self._step

    @property
    def params(self) -> RemoteParams:
        return RemoteParams(self)

    @property
    def state(self) -> Any:
        """The TrainState, fetched as host arrays."""
        return self._call("state")

    def begin_round(self, updates: int) -> None:
        self._step = self._call("begin_round", updates)

    def add_groups(self, groups: Iterable[Group]) -> None:
        self._step = self._call("add_groups", list(groups))

    def update(self) -> dict[str, float]:
        metrics, self._step = self._call("update")
        return metrics

    def publish(self, version: int) -> Any:
        return self._call("publish", version)[0]

    def compile_stats(self) -> dict[str, dict[str, float]]:
        return self._call("compile_stats")

    def start_compile_budget(self) -> None:
        self._call("start_compile_budget")

    def export_hf(self, path: str) -> None:
        self._call("export_hf", path)

    # ------------------------------------------------- borrowing the replicas' devices (BiDiRL)

    def prepare_borrow(self, ids: list[int]) -> None:
        """Compiles the extended mesh's steps in the learner worker and in every lender."""
        self._get(
            [self.workers[0].prepare_borrow.remote(ids)],
            [r.learner_prepare.remote(ids, self.total_updates) for r in self.lenders],
        )

    def borrow(self, ids: list[int]) -> None:
        """The learner's mesh extended over the lenders' devices `ids`; declined (borrowing
        stays False) when a lender has died."""
        if not self.usable():
            logging.warning("A replica lending its devices died: the learner does not borrow.")
            return
        snapshot = self._get([self.workers[0].borrow_snapshot.remote()])[0]
        self._get(
            [self.workers[0].borrow.remote(ids, snapshot)],
            [r.learner_borrow.remote(ids, snapshot) for r in self.lenders],
        )
        self.borrowing = True

    def give_back(self) -> None:
        self._call("give_back")
        self.borrowing = False


class RemoteSft:
    """learner.sft.SftTrainer's interface over the learner worker, where the SFT state lives."""

    def __init__(self, learner: LearnerClient, records: list[Any]):
        self.learner = learner
        learner._call("sft_begin", records)

    def step(self) -> None:
        self.learner._call("sft_step")

    def loss(self) -> float:
        return self.learner._call("sft_loss")

    def commit(self) -> None:
        self.learner._call("sft_commit")


class LentReplica:
    """A sampler replica the learner worker hosts on its own devices (LearnerWorker.lend), behind
    the interface of a SamplerReplica actor handle: `handle.method.remote(*args)` runs
    ReplicaCore.method there; `close` stops its loop and readies a fresh one for the next lend."""

    def __init__(self, worker: Any, j: int):
        self.worker, self.j = worker, j

    def __getattr__(self, method: str) -> Any:
        if method.startswith("_"):
            raise AttributeError(method)
        if method == "close":
            return _Remote(lambda: self.worker.unlend.remote(self.j))
        return _Remote(lambda *args: self.worker.lent_call.remote(self.j, method, *args))


@dataclasses.dataclass(frozen=True)
class _Remote:
    call: Any

    def remote(self, *args: Any) -> Any:
        return self.call(*args)


class ObjectStoreSync:
    """WeightSync through the object store: one put by the learner worker, a get per replica.

    Published.params is an ObjectRef; ReplicaRouter.set_params hands it to every replica, which
    places the host arrays on its devices. On a GPU cluster the fast path is a device-to-device
    transfer (jax.experimental.transfer, or NCCL via ray.util.collective): a WeightSync whose
    publish returns a transfer handle instead of a ref, with replicas pulling from the learner's
    devices; the Driver and the router need no change.
    """

    def publish(self, params: Any, version: int) -> Any:

        if not isinstance(params, RemoteParams):
            raise TypeError(
                "ObjectStoreSync.publish expects the learner worker's params (LearnerClient."
                f"params); received {type(params).__name__}."
            )
        start = time.perf_counter()
        ref = params.client.publish(version)
        return Published(params=ref, version=version, seconds=time.perf_counter() - start)


class RemoteCheckpoints:
    """Checkpoints written by the learner worker (where the state lives)."""

    def __init__(self, learner: LearnerClient, directory: str):
        self.learner = learner
        learner._call("open_checkpoints", directory)

    def save(self, step: int, meta: dict[str, Any]) -> None:
        self.learner._call("save", step, meta)

    def restore(self, *, strict: bool) -> dict[str, Any]:
        meta = self.learner._call("restore", strict)
        self.learner._step = self.learner._call("step")
        return meta

    def close(self) -> None:
        try:
            self.learner._call("close_checkpoints")
        except LearnerDied:
            pass  # the error that stopped the run is what the caller sees


class RayRuntime:
    """The learner worker, the sampler replicas and the queue actor of one run.

    Attributes:
      mesh_plan: the planner's choice (rl.runtime.mesh_plan.MeshPlan) when config.mesh.split is
        "plan" (the workers are built on its split), else None.
      learner: LearnerClient.
      weight_sync: ObjectStoreSync.
      replicas: SamplerReplica handles.
      router: the ReplicaRouter of the last `driver()`.
    """

    def __init__(self, config: Any, setup: Any, *, total_updates: int):

        check_ray_config(config)
        self._owns_ray = connect(config.ray)
        self.mesh_plan = None
        if config.mesh.split == "plan":
            config, self.mesh_plan = planned_config(config)
        self.config, self.setup = config, setup
        env, cfg = worker_env(), config.to_dict()
        r = config.ray
        self.queue_actor = QueueActor.options(
            name=actor_name(config, "queue"),
            num_cpus=0,
            max_concurrency=4 + 2 * config.mesh.sampler_replicas,
            runtime_env=env,
        ).remote(config.driver.queue_size)
        # The learner: one worker, or a group of `group` forming one jax.distributed job (one
        # per host on a cluster), rank 0 serving its coordinator; each gets learner_gpus GPUs.
        group = r.learner_workers
        learner_env = env
        if group > 1:  # gloo gives a process 30 s to join a collective: no compile-cache skew
            learner_env = {"env_vars": {**env["env_vars"], "JAX_ENABLE_COMPILATION_CACHE": "0"}}
        workers = [
            LearnerWorker.options(
                name=actor_name(config, "learner" if rank == 0 else f"learner{rank}"),
                num_cpus=r.learner_cpus,
                num_gpus=r.learner_gpus,
                runtime_env=learner_env,
            ).remote(cfg, total_updates, rank)
            for rank in range(group)
        ]
        # Learner borrowing: the replicas join the learner worker's jax.distributed job (ranks
        # 1..N) from the start; the learner's mesh extends over their devices while it borrows.
        lenders = (
            config.mesh.sampler_replicas
            if BorrowConfig.from_section(config.elastic).allows("learner")
            else 0
        )
        coordinator = ray.get(workers[0].coordinator.remote()) if group > 1 or lenders else ""
        built = [w.build.remote(coordinator, group, lenders) for w in workers]
        self.replicas = [
            SamplerReplica.options(
                name=actor_name(config, f"replica{i}"),
                num_cpus=r.replica_cpus,
                num_gpus=r.replica_gpus,
                runtime_env=env,
            ).remote(
                cfg, self.queue_actor, None, (coordinator, 1 + lenders, 1 + i) if lenders else None
            )
            for i in range(config.mesh.sampler_replicas)
        ]
        try:
            ray.get(built)  # the job forms once every replica has joined too
        except RayActorError as e:
            raise _learner_died(e) from None
        self.learner = LearnerClient(
            workers, self.replicas if lenders else [], total_updates=total_updates
        )
        self.weight_sync = ObjectStoreSync()
        self.router: ReplicaRouter | None = None
        self.migration = make_migration_policy(migration_config_from(config))
        learner_devices = ray.get(workers[0].devices.remote())
        self.lend = build_lender(
            config, learner_devices=learner_devices, make_replicas=self._lent_replicas
        )
        self.borrow = None
        if lenders:
            ids = [i for r in self.replicas for i in ray.get(r.job_devices.remote())]
            self.borrow = build_borrower(config, self.learner, ids, learner_devices=learner_devices)

    def _lent_replicas(self) -> list[LentReplica]:
        """Sampler replicas the learner worker hosts on its devices (SamplerLender's first move)."""
        worker = self.learner.workers[0]
        try:
            n = ray.get(worker.lend.remote(self.queue_actor))
        except RayActorError as e:
            raise _learner_died(e) from None
        return [LentReplica(worker, j) for j in range(n)]

    def driver(self, cfg: Any, **kwargs: Any) -> Any:
        """A Driver over the replicas (ReplicaRouter) and the queue actor; kwargs go to it."""

        timeline = kwargs.pop("timeline", None) or Timeline()
        r = self.config.ray
        self.router = ReplicaRouter(
            self.replicas,
            routing=self.config.mesh.sampler_routing,
            on_failure=r.on_replica_failure,
            timeline=timeline,
            migration=self.migration,
            migration_poll_s=r.migration_poll_s,
        )
        if self.lend is not None:
            kwargs.setdefault("lender", self.lend)
        if self.borrow is not None:
            kwargs.setdefault("borrower", self.borrow)
            router = self.router
            self.learner.usable = lambda: all(i in router.alive for i in range(len(self.replicas)))
        return Driver(
            cfg,
            sampler=self.router,
            queue=QueueClient(self.queue_actor, self.router.accept),
            learner=self.learner,
            weight_sync=self.weight_sync,
            timeline=timeline,
            **kwargs,
        )

    def _live(self) -> list[int]:
        return self.router.alive if self.router is not None else list(range(len(self.replicas)))

    def sft(self, records: Any) -> RemoteSft:
        """The SFT warm start, run on the learner worker (rl.run drives its steps)."""
        return RemoteSft(self.learner, list(records))

    def evaluate(self, published: Any, records: Any, *, k: int = 1) -> dict[str, float]:
        """Held-out accuracy (and pass@k, k > 1), evaluated on the first live replica."""
        replica = self.replicas[self._live()[0]]
        return ray.get(replica.evaluate.remote(published, list(records), k))

    def export_hf(self, path: str) -> None:
        """The learner worker (rank 0 of its group) writes the policy: the workdir is shared."""
        self.learner.export_hf(path)

    def reward_stats(self) -> tuple[dict[str, int], dict[str, int]]:
        """Reward counters summed over the live replicas (rollouts, evaluation)."""
        out: tuple[collections.Counter, collections.Counter] = (
            collections.Counter(),
            collections.Counter(),
        )
        for i in self._live():
            for total, part in zip(
                out, ray.get(self.replicas[i].reward_stats.remote()), strict=True
            ):
                total.update(part)
        return dict(out[0]), dict(out[1])

    def compile_stats(self) -> dict[str, dict[str, float]]:
        """The learner worker's programs: compiled, seconds, after start (rl/compiles.py)."""
        return self.learner.compile_stats()

    def start_compile_budget(self) -> None:
        self.learner.start_compile_budget()

    def checkpointer(self, directory: str) -> RemoteCheckpoints:
        return RemoteCheckpoints(self.learner, directory)

    def close(self) -> None:
        """Ends the workers (and the local cluster this runtime started)."""
        for actor in (*self.learner.workers, *self.replicas, self.queue_actor):
            ray.kill(actor)
        if self._owns_ray:
            ray.shutdown()
