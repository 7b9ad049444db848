"""A sampler replica of the Ray runtime: an Engine + SamplerLoop, rewards computed where it runs.

`ReplicaCore` is the replica; `SamplerReplica` is it as a Ray actor (a replica process of its own),
and the learner worker hosts instances on its own devices while it lends them to the sampler
(rl.runtime.ray_learner.LearnerWorker.lend). Complete groups go straight onto the queue actor
(rl.runtime.ray_queue). Methods return errors as values where the caller must re-raise the exact
exception (a sampler thread's crash); a dead replica surfaces in the caller as
ray.exceptions.RayActorError, which rl.runtime.ray_router turns into a fault decision.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import jax
import ray
from flax import nnx

from learner.publish import DevicePutSync, published_shapes
from rl.admission import make_policy
from rl.models.build import create_model, model_config_from
from rl.runtime.compose import (
    Setup,
    build_checked_model,
    build_engine,
    build_environment,
    build_learner,
    build_reward,
    evaluate_heldout,
    precompile_engine,
    rollout_reward,
)
from rl.runtime.ray_cluster import actor_repr
from rl.runtime.ray_process import job_devices, join_job, local_mesh, pin, worker_config
from rl.runtime.ray_weights import Ticket, WeightPuller
from rl.timeline import Timeline
from sampler.loop import SamplerLoop
from sampler.transfer import HostRun, from_host, run_from_host, run_to_host, to_host


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
      payload: the run's config and registrations (rl.runtime.ray_process.worker_payload).
      queue: the QueueActor.
      mesh: the engine's mesh; None: this process's first mesh.sampler_devices devices (a lent
        replica gets one over the learner's devices).
      job: (coordinator, processes, rank) of the learner's jax.distributed job to join first.
    """

    def __repr__(self) -> str:  # its role, in Ray's error messages (rl.runtime.worker_errors)
        return actor_repr(self)

    def __init__(
        self,
        payload: dict[str, Any],
        queue: Any,
        mesh: Any = None,
        job: tuple[str, int, int] | None = None,
    ):

        config = worker_config(payload)
        if job is not None:  # before any other jax work
            join_job(config, job)
        self.config, self.setup = config, Setup.from_config(config)
        self.queue = queue
        self.learner: Any = None  # the Learner of the borrowed steps (learner_prepare)
        if mesh is None:
            mesh = local_mesh(config, "sampler")
        model = build_checked_model(config, self.setup, mesh)  # structure; weights are published
        self.engine = build_engine(config, self.setup, mesh, model)
        params_like = nnx.split(model)[1]
        shapes = published_shapes(params_like, config.sampler_dtype)
        precompile_engine(config, self.engine, shapes)
        # The learner worker already cast to the sampler dtype: these only move and place.
        self.sync = DevicePutSync(params_like, mesh, rules=self.setup.rules)
        self.puller = WeightPuller(shapes, mesh, ray.util.get_node_ip_address())
        self.reward = build_reward(config, self.setup)
        self.eval_reward = build_reward(config, self.setup)
        self.environment = build_environment(config, self.setup)
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
            environment=self.environment,
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

    def _placed(self, params: Any) -> Any:
        """Published weights (rl.runtime.ray_weights: a Ticket to pull, or host arrays the object
        store handed over) on this replica's mesh."""
        if isinstance(params, Ticket):
            pulled = self.puller.pull(params)  # on the first device, buffers of its own
            return jax.block_until_ready(jax.device_put(pulled, self.sync.shardings))
        return self.sync.publish(params, 0).params

    def set_params(self, params: Any, version: int) -> None:
        self.loop.set_params(self._placed(params), version)

    def start(self) -> None:
        self.loop.start()

    def submit(self, requests: list[Any]) -> None:
        self.loop.submit(requests)

    def waiting(self) -> int:
        """Requests waiting for admission here."""
        return self.loop.waiting()

    def take_queued(self, slots: int) -> list[Any]:
        """Removes requests waiting for admission here until their samples fill `slots` (a
        replica that joins mid-rollout takes them)."""
        return self.loop.take_queued(slots)

    def evict(self) -> tuple[list[Any], list[HostRun]]:
        """Stops the loop and empties it (a lent replica taken back mid-rollout): returns the
        requests waiting here and the runs admitted and not complete as host data (their tokens
        so far, to `resume` on another replica). Groups whose rewards were still running are put
        on the queue now (the router delivers every group there: QueueActor.keys)."""
        self.loop.close()
        queued, runs, scoring = self.loop.evict()
        for complete in scoring:
            self._emit(complete.group())
        return queued, [run_to_host(run) for run in runs]

    def resume(self, runs: list[HostRun]) -> None:
        """Takes over runs another replica evicted; each is re-prefilled with its tokens so far."""
        self.loop.resume([run_from_host(run) for run in runs])

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

    def compile_stats(self, owner: str) -> dict[str, dict[str, float]]:
        """The engine's programs: compiled, seconds, after start (rl/compiles.py)."""
        return self.engine.compiles.stats(owner)

    def start_compile_budget(self) -> None:
        self.engine.compiles.start()

    def evaluate(self, params: Any, records: list[Any], k: int) -> dict[str, float]:

        published = self._placed(params)
        return evaluate_heldout(
            self.config,
            self.setup,
            self.engine,
            published,
            records,
            self.eval_reward,
            k,
            self.environment,
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
