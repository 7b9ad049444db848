"""The Ray runtime: the same Driver and schedules as the threaded one, its sides in Ray actors.

    python -m launch.train --config=configs/smoke.py --config.runtime=ray \
        --config.mesh.sampler_replicas=2

This process (the Ray driver) runs rl.driver.Driver and its schedule. Around it:
- a learner worker (rl.runtime.ray_learner.LearnerWorker) owning the Learner on its devices;
  `LearnerClient` (rl.runtime.ray_learner_client) gives the Driver the Learner's methods;
- N sampler replicas (rl.runtime.ray_replica.SamplerReplica: an Engine + SamplerLoop each, rewards
  computed there) behind `ReplicaRouter` (rl.runtime.ray_router), the Driver's Sampler: it routes each request (one group) round-robin or to the
  least-loaded replica, decides tail batching's round cuts on the groups of every replica (and
  aborts a full cut's other requests on each), and merges the replicas' timeline events into the
  driver's timeline (slot lanes numbered across replicas, args["replica"]) for per-replica metrics;
- the complete-group queue (rl.runtime.ray_queue.QueueActor: rl.queue.GroupQueue's semantics,
  backpressure, close, fail) that replicas put into and `QueueClient` takes from;
- weights (`RaySync`, rl.runtime.ray_weights): each replica pulls them from the learner worker's
  devices (config.ray.weights "transfer", jax.experimental.transfer), or the learner worker puts
  them in the object store once and every replica gets them ("object_store"); "auto" (default)
  transfers where the worker's transfer server starts.
The SFT warm start runs on the learner worker too (`RemoteSft`: learner.sft.SftTrainer there,
driven step by step by rl.run as in the threaded runtime). Joining the cluster, the workers'
environment and names, and the planner's split are rl.runtime.ray_cluster's.

Elastic devices: long-tail migration (config.elastic.migration) moves running requests between
replica actors, their decode state through the object store (rl.runtime.ray_migration: the same
policy as the threaded runtime, asked from a thread of this process). Sampler borrowing
(config.elastic.borrowing="sampler") lends the learner worker's devices to the sampler: the worker
hosts extra replicas on them (LearnerWorker.lend, built at start; their handles are
rl.runtime.ray_host.HostedReplica) that the router adds while the learner waits for a round's
groups and removes once the sampler drains; under async it adds them while the learner waits for
its next batch and takes them back mid-rollout once the batch is complete
(ReplicaRouter.take_back). The learner borrows the replicas' devices
(config.elastic.borrowing="learner"): the replicas are processes of the learner worker's
jax.distributed job from the start (ranks 1..N), and while the rollout is drained the learner's
mesh extends over their devices, each replica running the same Learner calls on its shards
(`LearnerClient`; learner.Learner.borrow across processes).

A pipeline of a multiplexed sweep (`pool`: rl/runtime/pool.py, launch.sweep) has no replica
actors of its own: its replicas live on the pool's ReplicaHost actors, one per replica mesh,
each holding every pipeline's (rl.runtime.ray_host), and the pool moves the meshes between the
pipelines' routers as it does between threaded samplers; its learner operations take turns with
the other pipelines' (`learner_turn`).

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
import logging
from typing import Any

import ray
from ray.exceptions import RayActorError

from rl.driver import Driver
from rl.rewards.runner import COUNTERS
from rl.runtime.compose import (
    borrow_config_from,
    build_borrower,
    build_lender,
    build_migration,
)

# (connect and worker_env are imported from here too: launch/bench_elastic.py)
from rl.runtime.pool import Member
from rl.runtime.ray_cluster import actor_name, connect, planned_config, worker_env
from rl.runtime.ray_config import check_pooled, check_ray_config
from rl.runtime.ray_host import HostedReplica, pool_hosts
from rl.runtime.ray_learner import LearnerWorker
from rl.runtime.ray_learner_client import (
    LearnerClient,
    RemoteCheckpoints,
    RemoteSft,
    learner_died,
)
from rl.runtime.ray_process import worker_payload
from rl.runtime.ray_queue import QueueActor, QueueClient
from rl.runtime.ray_replica import SamplerReplica
from rl.runtime.ray_router import ReplicaRouter
from rl.runtime.ray_weights import RaySync
from rl.timeline import Timeline


class RayRuntime:
    """The learner worker, the sampler replicas and the queue actor of one run.

    Attributes:
      mesh_plan: the planner's choice (rl.runtime.mesh_plan.MeshPlan) when config.mesh.split is
        "plan" (the workers are built on its split), else None.
      learner: LearnerClient.
      weight_sync: RaySync.
      weights: how publishes reach the replicas: "transfer" or "object_store".
      replicas: SamplerReplica handles.
      router: the ReplicaRouter of the last `driver()`.
    """

    def __init__(self, config: Any, setup: Any, *, total_updates: int, pool: Member | None = None):

        check_ray_config(config)
        if pool is not None:
            check_pooled(config)
        self.pool = pool
        hosts = [] if pool is None else pool_hosts(config, pool)
        self._owns_ray = connect(config.ray)  # (False in a pool: its hosts connected)
        self.mesh_plan = None
        if config.mesh.split == "plan":
            config, self.mesh_plan = planned_config(config)
        self.config, self.setup = config, setup
        env, cfg = worker_env(), worker_payload(config)
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
            config.mesh.sampler_replicas if borrow_config_from(config).allows("learner") else 0
        )
        coordinator = ray.get(workers[0].coordinator.remote()) if group > 1 or lenders else ""
        built = [w.build.remote(coordinator, group, lenders) for w in workers]
        if pool is None:
            self.replicas = [
                SamplerReplica.options(
                    name=actor_name(config, f"replica{i}"),
                    num_cpus=r.replica_cpus,
                    num_gpus=r.replica_gpus,
                    runtime_env=env,
                ).remote(
                    cfg,
                    self.queue_actor,
                    None,
                    (coordinator, 1 + lenders, 1 + i) if lenders else None,
                )
                for i in range(config.mesh.sampler_replicas)
            ]
        else:  # this pipeline's replica on every host of the pool's (rl.runtime.ray_host)
            ray.get([h.build.remote(pool.name, cfg, self.queue_actor) for h in hosts])
            self.replicas = [HostedReplica(h, pool.name) for h in hosts]
        try:
            ray.get(built)  # the job forms once every replica has joined too
        except RayActorError as e:
            raise learner_died(e) from None
        self.learner = LearnerClient(
            workers, self.replicas if lenders else [], total_updates=total_updates
        )
        self.weights = self._serve_weights(workers, r.weights)
        self.weight_sync = RaySync()
        self.router: ReplicaRouter | None = None
        self.migration = build_migration(config)
        learner_devices = ray.get(workers[0].devices.remote())
        self.lend = build_lender(
            config, learner_devices=learner_devices, make_replicas=self._lent_replicas
        )
        if self.lend is not None:  # built and compiled now: no switch pays for it
            self.lend.prepare()
        self.borrow = None
        if lenders:
            ids = [i for r in self.replicas for i in ray.get(r.job_devices.remote())]
            self.borrow = build_borrower(config, self.learner, ids, learner_devices=learner_devices)

    @staticmethod
    def share_pool(config: Any, pool: Any) -> None:
        """Starts the replica host actors of a multiplexed sweep's `pool` (rl.runtime.ray_host)
        on this thread, before its pipelines start (rl.runtime.factory.share_pool)."""
        pool_hosts(config, pool)

    @staticmethod
    def _serve_weights(workers: list[Any], weights: str) -> str:
        """Every learner worker learns how publishes go (rank 0 starts the transfer server)."""
        try:
            why = ray.get([w.serve_weights.remote(weights) for w in workers])[0]
        except RayActorError as e:
            raise learner_died(e) from None
        if not why:
            return "transfer"
        if weights == "auto":
            logging.warning("Weights go through the object store: %s.", why)
            ray.get([w.use_transfer.remote(False) for w in workers])
        return "object_store"

    def _lent_replicas(self) -> list[HostedReplica]:
        """Sampler replicas the learner worker hosts on its devices (SamplerLender's first move)."""
        worker = self.learner.workers[0]
        try:
            n = ray.get(worker.lend.remote(self.queue_actor))
        except RayActorError as e:
            raise learner_died(e) from None
        return [HostedReplica(worker, j, call="lent_call", close="unlend") for j in range(n)]

    def driver(self, cfg: Any, **kwargs: Any) -> Any:
        """A Driver over the replicas (ReplicaRouter) and the queue actor; kwargs go to it."""

        timeline = kwargs.pop("timeline", None) or Timeline()
        r = self.config.ray
        replicas, held = self.replicas, range(len(self.replicas))
        if self.pool is not None:  # it starts on the replicas the pool gives it
            held = self.pool.claim()
            kwargs.setdefault("learner_turn", self.pool.learner_turn)  # the shared learner mesh
            replicas = [self.replicas[i] for i in held]
        self.router = ReplicaRouter(
            replicas,
            routing=self.config.mesh.sampler_routing,
            on_failure=r.on_replica_failure,
            timeline=timeline,
            queue=self.queue_actor,
            migration=self.migration,
            migration_poll_s=r.migration_poll_s,
        )
        if self.lend is not None:
            kwargs.setdefault("lender", self.lend)
        if self.borrow is not None:
            kwargs.setdefault("borrower", self.borrow)
            router = self.router
            self.learner.usable = lambda: all(i in router.alive for i in range(len(self.replicas)))
        driver = Driver(
            cfg,
            sampler=self.router,
            queue=QueueClient(self.queue_actor, self.router.accept),
            learner=self.learner,
            weight_sync=self.weight_sync,
            timeline=timeline,
            **kwargs,
        )
        if self.pool is not None:
            self.pool.attach(self.router, self.replicas, held)
            # slot occupancy is over every replica it may hold
            driver.num_slots = sum(ray.get([h.num_slots.remote() for h in self.replicas]))
        return driver

    def _live(self) -> list[int]:
        """Indices into `replicas` of those answering for this run: the router's live ones, or
        in a pool every host's (this pipeline's replica on each, serving or not)."""
        if self.router is None or self.pool is not None:
            return list(range(len(self.replicas)))
        return self.router.alive

    def sft(self, records: Any) -> RemoteSft:
        """The SFT warm start, run on the learner worker (rl.run drives its steps)."""
        return RemoteSft(self.learner, list(records))

    def evaluate(self, published: Any, records: Any, *, k: int = 1) -> dict[str, float]:
        """Held-out accuracy (and pass@k, k > 1), evaluated on the first live replica (in a
        pool: on its home, which only it uses)."""
        replica = self.replicas[self._live()[0] if self.pool is None else self.pool.home]
        return ray.get(replica.evaluate.remote(published, list(records), k))

    def export_hf(self, path: str) -> None:
        """The learner worker (rank 0 of its group) writes the policy: the workdir is shared."""
        self.learner.export_hf(path)

    def reward_stats(self) -> tuple[dict[str, int], dict[str, int]]:
        """Reward counters summed over the live replicas (rollouts, evaluation); zeros when none
        is left to answer (a run whose replicas died)."""
        out: tuple[collections.Counter, collections.Counter] = (
            collections.Counter(dict.fromkeys(COUNTERS, 0)),
            collections.Counter(dict.fromkeys(COUNTERS, 0)),
        )
        for i in self._live():
            for total, part in zip(
                out, ray.get(self.replicas[i].reward_stats.remote()), strict=True
            ):
                total.update(part)
        return dict(out[0]), dict(out[1])

    def compile_stats(self) -> dict[str, dict[str, float]]:
        """The learner worker's and the live replicas' programs: compiled, seconds, after start
        (rl/compiles.py)."""
        stats = self.learner.compile_stats()
        calls = [self.replicas[i].compile_stats.remote(f"engine{i}") for i in self._live()]
        for replica in ray.get(calls):
            stats.update(replica)
        return stats

    def start_compile_budget(self) -> None:
        self.learner.start_compile_budget()
        ray.get([self.replicas[i].start_compile_budget.remote() for i in self._live()])

    def checkpointer(self, directory: str) -> RemoteCheckpoints:
        return RemoteCheckpoints(self.learner, directory)

    def close(self) -> None:
        """Ends the workers (and the local cluster this runtime started); in a pool, its
        replicas on the hosts go, and the pool ends the hosts."""
        if self.pool is not None:
            self.pool.leave()  # (first: the pool moves nothing to or from it any more)
        for actor in (*self.learner.workers, self.queue_actor):
            ray.kill(actor)  # (before the drops: a loop blocked on a full queue lets go)
        if self.pool is None:
            for actor in self.replicas:
                ray.kill(actor)
        else:
            for h in self.replicas:
                try:
                    ray.get(h.actor.drop.remote(self.pool.name))
                except RayActorError:
                    pass  # (a dead host held nothing more)
        if self._owns_ray:
            ray.shutdown()
