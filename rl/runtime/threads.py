"""The threaded runtime: one process, sampler loops in threads, the learner loop in the driver's.

    runtime = ThreadsRuntime(config, setup, total_updates=...)  # every part built from the config
    driver = runtime.driver(driver_cfg, prompts=prompts)

    driver = threaded_driver(cfg, engine=engine, learner=learner, weight_sync=sync,
                             prompts=prompts, reward_fn=reward)
    driver = threaded_driver(cfg, engine=[engine0, engine1], ...)   # two sampler replicas

Wires sampler replicas (rl.runtime.replicas: a SamplerLoop per Engine, one thread each) and a
GroupQueue to the Driver (rl.driver), which then talks to them only through rl.runtime.protocols;
rl.runtime.ray wires replica actors to the same Driver.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax

from learner.checkpoint import Checkpointer
from learner.learner import Learner
from learner.mesh import MeshConfig, make_meshes, replica_meshes
from learner.publish import DevicePutSync, WeightSync, published_shapes
from learner.sft import SftTrainer
from rl.admission import make_policy
from rl.compiles import compile_stats
from rl.driver import Driver, DriverConfig
from rl.elastic.migration import MigrationPolicy
from rl.envs import EnvRunner
from rl.queue import GroupQueue
from rl.runtime.compose import (
    Setup,
    build_borrower,
    build_checked_model,
    build_engine,
    build_environment,
    build_learner,
    build_lender,
    build_migration,
    build_reward,
    build_sft,
    evaluate_heldout,
    export_policy,
    lent_engines,
    precompile_engine,
    rollout_reward,
    updates_per_round,
)
from rl.runtime.mesh_plan import plan_mesh
from rl.runtime.pool import Member
from rl.runtime.replicas import ReplicaSampler
from rl.sections import from_section
from rl.timeline import Timeline
from rl.types import Prompt
from sampler.engine import Engine
from sampler.loop import RewardFn


def threaded_driver(
    cfg: DriverConfig,
    *,
    engine: Engine | Sequence[Engine],
    learner: Learner,
    weight_sync: WeightSync,
    prompts: Iterator[Prompt],
    reward_fn: RewardFn,
    timeline: Timeline | None = None,
    clock: Callable[[], float] = time.monotonic,
    driver_cls: type[Driver] = Driver,
    routing: str = "round_robin",
    migration: MigrationPolicy | None = None,
    environment: EnvRunner | None = None,
    spare: Sequence[Engine] = (),
    **driver_kwargs: Any,
) -> Driver:
    """A Driver over sampler replica threads (one per engine) and an in-process GroupQueue.

    Args:
      cfg: the schedule and runtime config (queue_size, admission, group_atomic, recompute_kv).
      engine: the sampler Engine, or one per replica (each on its own devices).
      driver_cls: Driver or a subclass.
      routing: request -> replica, "round_robin" or "least_loaded" (rl.runtime.routing).
      migration: a long-tail migration policy (rl.elastic.migration); default none.
      environment: multi-turn episodes in this environment (rl.envs); default single-turn.
      spare: engines that may join the sampler later (a multiplexed pool's, rl.runtime.pool).
      driver_kwargs: passed on to the Driver (version, rounds, barrier_every).
    """
    timeline = Timeline() if timeline is None else timeline
    queue = GroupQueue(cfg.queue_size)
    sampler = ReplicaSampler(
        [engine] if not isinstance(engine, Sequence) else engine,
        # the Driver gives the first weights (set_params) before it starts the loops
        make_admission=functools.partial(make_policy, cfg.admission),
        reward_fn=reward_fn,
        emit=queue.put,
        version=driver_kwargs.get("version", 0),
        group_atomic=cfg.group_atomic,
        recompute_kv=cfg.recompute_kv,
        routing=routing,
        migration=migration,
        timeline=timeline,
        clock=clock,
        environment=environment,
        spare=spare,
    )
    return driver_cls(
        cfg,
        sampler=sampler,
        queue=queue,
        learner=learner,
        weight_sync=weight_sync,
        prompts=prompts,
        timeline=timeline,
        clock=clock,
        **driver_kwargs,
    )


class ThreadsRuntime:
    """Everything in this process: the learner and the sampler replicas on disjoint meshes (or
    colocated), config.mesh.sampler_replicas of them, each an Engine on its own devices.

    Attributes:
      mesh_plan: the planner's choice (rl.runtime.mesh_plan.MeshPlan) when config.mesh.split is
        "plan", else None.
      learner: the Learner.
      weight_sync: a DevicePutSync learner mesh -> sampler mesh (all replicas' devices; each
        replica places the published weights on its own).
      engines: the sampler replicas' Engines.
      engine: the first of them (evaluation uses it).
      borrow: the learner's borrower of the sampler's devices (config.elastic.borrowing), or None.
      lend: the sampler's lender of the learner's devices (config.elastic.borrowing), or None.
      reward, eval_reward: rollouts and evaluation get their own runners, so each counts its own
        errors and timeouts.
      environment: the multi-turn environment's runner (config.env), or None.
    """

    def __init__(
        self, config: Any, setup: Setup, *, total_updates: int, pool: Member | None = None
    ):
        self.config, self.setup, self.pool = config, setup, pool
        mesh_cfg, self.mesh_plan = from_section(MeshConfig, config.mesh, name="mesh"), None
        if (
            mesh_cfg.split == "plan"
        ):  # an open split: the planner picks it (rl/runtime/mesh_plan.py)
            mesh_cfg, self.mesh_plan = plan_mesh(config, len(jax.devices()))
        learner_mesh, sampler_mesh = make_meshes(mesh_cfg)
        self.sampler_devices = list(sampler_mesh.devices.flat)
        self.migration = build_migration(config, pooled=pool is not None)
        model = build_checked_model(config, setup, learner_mesh)
        self.learner = build_learner(
            config, setup, model, learner_mesh, total_updates=total_updates
        )
        self.engines = [
            build_engine(config, setup, mesh, model)
            for mesh in replica_meshes(sampler_mesh, mesh_cfg.sampler_replicas)
        ]
        self.engine = self.engines[0 if pool is None else pool.home]
        if pool is not None and len(self.engines) != pool.replicas:
            raise ValueError(
                f"Pipeline {pool.name!r} has mesh.sampler_replicas={len(self.engines)}; its pool "
                f"has {pool.replicas}."
            )
        # Colocated with the same sharding and dtype, publishing shares the learner's arrays.
        self.weight_sync = DevicePutSync(
            self.learner.params,
            sampler_mesh,
            dtype=config.sampler_dtype,
            rules=setup.rules,
            share_with=self.learner,
        )
        # Every learner and engine program a run calls, compiled now (rl/compiles.py).
        self.learner.precompile(
            updates_per_round=updates_per_round(config),
            shared_params=self.weight_sync.shares_params,
        )
        published = published_shapes(self.learner.params, config.sampler_dtype)
        for engine in self.engines:
            precompile_engine(config, engine, published)
        self.reward, self.eval_reward = build_reward(config, setup), build_reward(config, setup)
        self.environment = build_environment(config, setup)
        self._ckpt = None
        self.borrow = build_borrower(
            config,
            self.learner,
            list(sampler_mesh.devices.flat),
            learner_devices=len(self.learner.mesh.devices.flat),
        )
        own = list(self.learner.mesh.devices.flat)
        self.lend = build_lender(
            config,
            learner_devices=len(own),
            make_replicas=lambda: lent_engines(config, setup, model, own),
        )
        if self.lend is not None:
            self.lend.prepare()

    def driver(self, cfg: DriverConfig, *, reward_fn: Any = None, **kwargs: Any) -> Driver:
        """A Driver over a sampler thread (rl.runtime.threads); kwargs go to the Driver.

        Args:
          reward_fn: scores rollouts instead of config.task.reward (a benchmark's own workload);
            None: the config's (rollout_reward).
        """
        if self.borrow is not None:
            kwargs.setdefault("borrower", self.borrow)
        if self.lend is not None:
            kwargs.setdefault("lender", self.lend)
        engines, held = self.engines, range(len(self.engines))
        if self.pool is not None:  # it starts on the replicas the pool gives it
            held = self.pool.claim()
            kwargs.setdefault("learner_turn", self.pool.learner_turn)  # the shared learner mesh
            engines = [self.engines[r] for r in held]
        driver = threaded_driver(
            cfg,
            engine=engines,
            spare=[e for r, e in enumerate(self.engines) if r not in held],
            learner=self.learner,
            routing=self.config.mesh.sampler_routing,
            migration=self.migration,
            weight_sync=self.weight_sync,
            reward_fn=reward_fn or rollout_reward(self.config, self.reward),
            environment=self.environment,
            **kwargs,
        )
        if self.pool is not None:
            self.pool.attach(driver.sampler, self.engines, held)
            # slot occupancy is over every replica it may hold
            driver.num_slots = sum(e.max_concurrent_decodes for e in self.engines)
        return driver

    def sft(self, records: Any) -> SftTrainer:
        """The SFT warm start of the learner on `records` (rl.run drives its steps)."""
        return build_sft(self.config, self.setup, self.learner, records)

    def evaluate(self, published: Any, records: Any, *, k: int = 1) -> dict[str, float]:
        """Held-out accuracy (and pass@k, k > 1) of published params (WeightSync output)."""
        return evaluate_heldout(
            self.config,
            self.setup,
            self.engine,
            self.engine.place_params(published),  # on its replica's devices
            records,
            self.eval_reward,
            k,
            self.environment,
        )

    def export_hf(self, path: str) -> None:
        """Writes the trained policy as a Hugging Face directory (config.export)."""
        export_policy(self.config, self.setup, self.learner, path)

    def reward_stats(self) -> tuple[dict[str, int], dict[str, int]]:
        """Counters of the rollout and the evaluation reward runners."""
        return self.reward.stats(), self.eval_reward.stats()

    def compile_stats(self) -> dict[str, dict[str, float]]:
        """Programs compiled, their seconds, and those after start, per program (rl/compiles.py)."""
        counters = {"learner": self.learner.compiles}
        for i, engine in enumerate(self.engines):
            counters[f"engine{i}"] = engine.compiles
        return compile_stats(counters)

    def start_compile_budget(self) -> None:
        """Start-up is over: a later learner or engine compile is counted as after start, and
        warned about once per program."""
        self.learner.compiles.start()
        for engine in self.engines:
            engine.compiles.start()

    def checkpointer(self, directory: str) -> LocalCheckpoints:
        return LocalCheckpoints(directory, self.learner)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.leave()
        self.reward.close()
        self.eval_reward.close()
        if self.environment is not None:
            self.environment.close()


class LocalCheckpoints:
    """Checkpoints written where the learner state lives (this process)."""

    def __init__(self, directory: str, learner: Learner):
        self.learner = learner
        self.ckpt = Checkpointer(directory)

    def save(self, step: int, meta: dict[str, Any]) -> None:
        self.ckpt.save(step, self.learner.state, meta)

    def restore(self, *, strict: bool) -> dict[str, Any]:
        """Restores the newest intact checkpoint into the learner; returns its meta."""
        self.learner.state, meta = self.ckpt.restore(
            abstract_state=self.learner.state, shardings=self.learner.shardings, strict=strict
        )
        return meta

    def close(self) -> None:
        self.ckpt.close()
