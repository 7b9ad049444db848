"""The Ray runtime: the same Driver and schedules as the threaded one, its sides in Ray actors.

    python -m launch.train --config=configs/smoke.py --config.runtime=ray \
        --config.ray.sampler_replicas=2

This process (the Ray driver) runs rl.driver.Driver and its schedule. Around it:
- a learner worker (rl.runtime.ray_workers.LearnerWorker) owning the Learner on its devices;
  `LearnerClient` gives the Driver the Learner's methods;
- N sampler replicas (SamplerReplica: an Engine + SamplerLoop each, rewards computed there) behind
  `ReplicaRouter`, the Driver's Sampler: it routes each request (one group) round-robin or to the
  least-loaded replica, and merges the replicas' timeline events into the driver's timeline (slot
  lanes numbered across replicas, args["replica"]) for per-replica metrics;
- the complete-group queue (QueueActor: rl.queue.GroupQueue's semantics, backpressure, close,
  fail) that replicas put into and `QueueClient` takes from;
- weights through the object store (`ObjectStoreSync`, a WeightSync): the learner worker puts the
  params as host arrays once, every replica gets them.

Faults: a replica that dies (RayActorError) has its unfinished requests re-sampled on the others
(config.ray.on_replica_failure="resample"; per-request randomness makes their tokens identical, and
a group already delivered is never taken twice) or the run stops with its error ("stop"). A dead
learner worker stops the run with a clear error; resume from the last checkpoint continues the
exact trajectory (the checkpoint is written by the learner worker, the data and planner state by
this process, at the same round).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import os
import time
from collections.abc import Iterable
from typing import Any

import ray
from ray.exceptions import RayActorError

from rl.rounds import RoundCut
from rl.timeline import SLOT_PREFIX, Timeline
from rl.types import Group, Request

ROUTINGS = ("round_robin", "least_loaded")
ON_REPLICA_FAILURE = ("resample", "stop")


def check_ray_config(config: Any) -> None:
    """config.ray's fields, with what was received and what is expected."""
    r = config.ray
    if r.routing not in ROUTINGS:
        raise ValueError(f"config.ray.routing={r.routing!r}; expected one of {ROUTINGS}.")
    if r.on_replica_failure not in ON_REPLICA_FAILURE:
        raise ValueError(
            f"config.ray.on_replica_failure={r.on_replica_failure!r}; expected one of "
            f"{ON_REPLICA_FAILURE}."
        )
    for name in ("sampler_replicas",):
        if not isinstance(r[name], int) or r[name] < 1:
            raise ValueError(f"config.ray.{name} must be an int >= 1; received {r[name]!r}.")
    for name in ("num_cpus", "learner_cpus", "replica_cpus", "learner_gpus", "replica_gpus"):
        if not isinstance(r[name], (int, float)) or r[name] < 0:
            raise ValueError(f"config.ray.{name} must be a number >= 0; received {r[name]!r}.")
    if config.driver.tail.enabled or config.driver.tail.response_eta > 1:
        raise ValueError(
            "config.driver.tail with config.runtime='ray': tail batching cuts a round across "
            "replicas, which the Ray runtime does not do yet; expected driver.tail.enabled=False "
            "and driver.tail.response_eta=1.0, or config.runtime='threads'."
        )
    if config.sft.max_steps:
        raise ValueError(
            f"config.sft.max_steps={config.sft.max_steps} with config.runtime='ray': the SFT warm "
            "start runs in one process; expected config.sft.max_steps=0 (warm-start with "
            "runtime='threads' and resume), or config.runtime='threads'."
        )


def worker_env() -> dict[str, Any]:
    """runtime_env for the workers: this checkout's code first on their path, and this process's
    JAX/XLA settings (platform, fake CPU device count, compilation cache)."""
    import rl

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


class LearnerClient:
    """The Learner's interface over the learner worker group (one worker per host; rank 0 answers)."""

    def __init__(self, workers: list[Any]):
        self.workers = workers
        self._step = self._call("step")

    def _call(self, method: str, *args: Any) -> Any:
        try:
            return ray.get([getattr(w, method).remote(*args) for w in self.workers])[0]
        except RayActorError as e:
            raise _learner_died(e) from None

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


class ObjectStoreSync:
    """WeightSync through the object store: one put by the learner worker, a get per replica.

    Published.params is an ObjectRef; ReplicaRouter.set_params hands it to every replica, which
    places the host arrays on its devices. On a GPU cluster the fast path is a device-to-device
    transfer (jax.experimental.transfer, or NCCL via ray.util.collective): a WeightSync whose
    publish returns a transfer handle instead of a ref, with replicas pulling from the learner's
    devices; the Driver and the router need no change.
    """

    def publish(self, params: Any, version: int) -> Any:
        from learner.publish import Published

        if not isinstance(params, RemoteParams):
            raise TypeError(
                "ObjectStoreSync.publish expects the learner worker's params (LearnerClient."
                f"params); received {type(params).__name__}."
            )
        start = time.perf_counter()
        ref = params.client.publish(version)
        return Published(params=ref, version=version, seconds=time.perf_counter() - start)


class QueueClient:
    """The Driver's Queue over the queue actor; `accept` drops a group already taken (a replica's
    re-sampled request whose first copy was delivered before the replica died)."""

    def __init__(self, actor: Any, accept: Any):
        self.actor, self.accept = actor, accept

    def put(self, group: Group, timeout: float | None = None) -> None:
        error = ray.get(self.actor.put.remote(group, timeout))
        if error is not None:
            raise error

    def get(self, timeout: float | None = None) -> Group:
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if end is None else max(0.0, end - time.monotonic())
            group, error = ray.get(self.actor.get.remote(left))
            if error is not None:
                raise error
            if self.accept(group):
                return group

    def close(self) -> None:
        ray.get(self.actor.close.remote())

    def fail(self, error: BaseException) -> None:
        try:
            ray.get(self.actor.fail.remote(error))
        except Exception:  # an error that does not pickle: its message still stops the other side
            ray.get(self.actor.fail.remote(RuntimeError(f"{type(error).__name__}: {error}")))

    def qsize(self) -> int:
        c = ray.get(self.actor.counters.remote())
        return int(c["puts"] - c["gets"])


class ReplicaRouter:
    """The Driver's Sampler over N replica actors; see the module docstring.

    Args:
      replicas: SamplerReplica handles, by index.
      routing: "round_robin" or "least_loaded" (fewest requests submitted and not delivered).
      on_failure: "resample" (a dead replica's requests go to the others) or "stop".
      timeline: the driver's Timeline; replicas' events are merged into it.
    """

    def __init__(self, replicas: list[Any], *, routing: str, on_failure: str, timeline: Timeline):
        self.replicas, self.routing, self.on_failure = replicas, routing, on_failure
        self.timeline = timeline
        self.replica_slots = tuple(ray.get([r.num_slots.remote() for r in replicas]))
        self.num_slots = sum(self.replica_slots)
        self._offset = [sum(self.replica_slots[:i]) for i in range(len(replicas))]
        self.alive = list(range(len(replicas)))
        self._outstanding: dict[tuple[int, int], tuple[int, Request]] = {}
        self._load = collections.Counter()
        self._rr = itertools.count()
        self._params: tuple[Any, int] | None = None
        self._error: BaseException | None = None
        self._dead_stats: list[Any] = []
        self.resampled = 0  # requests re-submitted after their replica died
        self.routed = collections.Counter()  # requests per replica

    def _route(self) -> int:
        if self.routing == "least_loaded":
            return min(self.alive, key=lambda i: (self._load[i], i))
        return self.alive[next(self._rr) % len(self.alive)]

    def _each(self, method: str, *args: Any, replicas: Iterable[int] | None = None) -> dict:
        """Calls `method` on replicas (default: the live ones); handles the dead ones."""
        idx = list(self.alive if replicas is None else replicas)
        refs = {i: getattr(self.replicas[i], method).remote(*args) for i in idx}
        out = {}
        for i, ref in refs.items():
            try:
                out[i] = ray.get(ref)
            except RayActorError as e:
                self._lost(i, e)
        return out

    def _lost(self, i: int, e: BaseException) -> None:
        if i not in self.alive:
            return
        self.alive.remove(i)
        why = f"sampler replica {i} died ({type(e).__name__}: {str(e).splitlines()[0]})"
        if self.on_failure == "stop" or not self.alive:
            if self._error is None:
                extra = "" if self.alive else "; no replica is left"
                self._error = RuntimeError(
                    f"The {why}{extra}; the run stopped (config.ray.on_replica_failure="
                    f"{self.on_failure!r})."
                )
            return
        logging.warning("%s: re-sampling its unfinished requests on replicas %s", why, self.alive)
        lost = [r for j, r in self._outstanding.values() if j == i]
        self._load.pop(i, None)
        for r in lost:
            del self._outstanding[r.key]
        self.resampled += len(lost)
        if lost:
            self.submit(sorted(lost, key=lambda r: r.key))

    @property
    def error(self) -> BaseException | None:
        for err in self._each("error").values():
            if err is not None and self._error is None:
                self._error = err
        return self._error

    @property
    def stats(self) -> Any:
        from sampler.loop import SamplerStats

        total = SamplerStats()
        for i, (stats, spans, instants) in self._each("stats").items():
            self._merge(i, spans, instants)
            for f in dataclasses.fields(SamplerStats):
                setattr(total, f.name, getattr(total, f.name) + getattr(stats, f.name))
        return total

    def _merge(self, i: int, spans: list[Any], instants: list[Any]) -> None:
        for s in spans:
            lane = s.lane
            if lane.startswith(SLOT_PREFIX):
                lane = f"{SLOT_PREFIX}{self._offset[i] + int(lane[len(SLOT_PREFIX) :])}"
            elif lane.startswith("sampler/"):
                lane = f"sampler/replica{i}/{lane.removeprefix('sampler/')}"
            self.timeline.span(lane, s.name, s.start, s.end, **s.args, replica=i)
        for t in instants:
            self.timeline.instant(t.lane, t.name, t.t, **t.args, replica=i)

    def start(self) -> None:
        self._each("start")

    def set_params(self, params: Any, version: int) -> None:
        self._params = (params, version)
        self._each("set_params", params, version)

    def submit(self, requests: Iterable[Request], cut: RoundCut | None = None) -> None:
        if cut is not None:
            raise ValueError(
                "ReplicaRouter.submit received a round cut (tail batching); the Ray runtime "
                "expects none (rl.runtime.ray_runtime.check_ray_config)."
            )
        if self._error is not None:
            raise self._error
        by_replica: dict[int, list[Request]] = collections.defaultdict(list)
        for r in requests:
            i = self._route()
            self._outstanding[r.key] = (i, r)
            self._load[i] += 1
            self.routed[i] += 1
            by_replica[i].append(r)
        for i, rs in by_replica.items():
            try:
                ray.get(self.replicas[i].submit.remote(rs))
            except RayActorError as e:
                self._lost(i, e)  # re-samples rs with the rest of its requests

    def accept(self, group: Group) -> bool:
        """Marks a delivered group; False for a second copy (see QueueClient)."""
        owner = self._outstanding.pop(group.request.key, None)
        if owner is None:
            return False
        self._load[owner[0]] -= 1
        return True

    def request_stop(self) -> None:
        self._each("request_stop")

    def close(self) -> None:
        for err in self._each("close").values():
            if err is not None:
                raise err


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
      learner: LearnerClient.
      weight_sync: ObjectStoreSync.
      replicas: SamplerReplica handles.
      router: the ReplicaRouter of the last `driver()`.
    """

    def __init__(self, config: Any, setup: Any, *, total_updates: int):
        from rl.runtime.ray_workers import LearnerWorker, QueueActor, SamplerReplica

        check_ray_config(config)
        self.config, self.setup = config, setup
        self._owns_ray = connect(config.ray)
        env, cfg = worker_env(), config.to_dict()
        r = config.ray
        self.queue_actor = QueueActor.options(
            name=actor_name(config, "queue"),
            num_cpus=0,
            max_concurrency=4 + 2 * r.sampler_replicas,
            runtime_env=env,
        ).remote(config.driver.queue_size)
        workers = [
            LearnerWorker.options(
                name=actor_name(config, "learner"),
                num_cpus=r.learner_cpus,
                num_gpus=r.learner_gpus,
                runtime_env=env,
            ).remote(cfg, total_updates)
        ]
        self.replicas = [
            SamplerReplica.options(
                name=actor_name(config, f"replica{i}"),
                num_cpus=r.replica_cpus,
                num_gpus=r.replica_gpus,
                runtime_env=env,
            ).remote(cfg, i, self.queue_actor)
            for i in range(r.sampler_replicas)
        ]
        self.learner = LearnerClient(workers)
        self.weight_sync = ObjectStoreSync()
        self.router: ReplicaRouter | None = None

    def driver(self, cfg: Any, **kwargs: Any) -> Any:
        """A Driver over the replicas (ReplicaRouter) and the queue actor; kwargs go to it."""
        from rl.driver import Driver

        timeline = kwargs.pop("timeline", None) or Timeline()
        r = self.config.ray
        self.router = ReplicaRouter(
            self.replicas, routing=r.routing, on_failure=r.on_replica_failure, timeline=timeline
        )
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

    def evaluate(self, published: Any, records: Any) -> float:
        """Held-out accuracy, evaluated on the first live replica."""
        return ray.get(self.replicas[self._live()[0]].evaluate.remote(published, list(records)))

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

    def checkpointer(self, directory: str) -> RemoteCheckpoints:
        return RemoteCheckpoints(self.learner, directory)

    def close(self) -> None:
        """Ends the workers (and the local cluster this runtime started)."""
        for actor in (*self.learner.workers, *self.replicas, self.queue_actor):
            ray.kill(actor)
        if self._owns_ray:
            ray.shutdown()
