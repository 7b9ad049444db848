"""The composition root: every component of a run built from one config, in one place.

The threaded runtime builds them all in this process; the Ray runtime's workers each build their
own part from the same config (the learner worker its Learner, each sampler replica its Engine and
reward runner), so both runtimes, the benchmarks and the launchers wire nothing by hand.

    setup = Setup.from_config(config)              # tokenizer, sampling, rules: cheap, anywhere
    runtime = make_runtime(config, setup, total_updates=...)   # learner, sampler side, sync
    driver = runtime.driver(driver_cfg, prompts=prompts)        # rl.driver.Driver
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rl.compiles import compile_stats
from rl.models.build import build_model
from rl.models.sharding import Rules, normalize_rules
from rl.models.summary import tokenizer_from
from rl.overlong import OverlongPenalty
from rl.rewards import RewardRunner, get_reward
from rl.runtime import RUNTIMES
from rl.tasks.data import DataConfig, data_config_from
from rl.types import SamplingParams

if TYPE_CHECKING:
    from jax.sharding import Mesh

    from learner.learner import Learner
    from learner.sft import SftTrainer
    from rl.driver import Driver, DriverConfig
    from rl.elastic.lending import LearnerBorrower, SamplerLender
    from sampler.engine import Engine


@dataclasses.dataclass(frozen=True)
class Setup:
    """What every process of a run derives from the config alone (no devices, no data)."""

    data: DataConfig
    rules: Rules
    tokenizer: Any
    sampling: SamplingParams
    max_prompt_tokens: int  # prompts the engine could not take are dropped at load time

    @classmethod
    def from_config(cls, config: Any) -> Setup:
        tokenizer = tokenizer_from(config)
        max_prompt = config.engine.max_length - config.sampling.max_new_tokens
        return cls(
            data=data_config_from(config),
            rules=normalize_rules(config.sharding_rules),
            tokenizer=tokenizer,
            sampling=SamplingParams(**config.sampling, stop_token_ids=(tokenizer.eos_id,)),
            max_prompt_tokens=max(1, min(config.engine.max_prefill_length, max_prompt)),
        )

    def prompts(self, records: Any, *, seed: int) -> Any:
        """The training prompt stream over `records` (a grain iterator: get_state / set_state),
        rendered and tokenized as the task says, shuffled per epoch from `seed`."""
        from rl.tasks.pipeline import prompt_dataset

        return iter(
            prompt_dataset(
                records,
                self.tokenizer,
                seed=seed,
                meta_fields=self.data.meta_fields,
                **self.data.prompt_kwargs,
            )
        )


def check_runtime_config(config: Any) -> None:
    """config.runtime and, with "ray", config.ray: a clear error before anything starts."""
    runtime = config.get("runtime", "threads")
    if runtime not in RUNTIMES:
        raise ValueError(f"config.runtime={runtime!r}; expected one of {RUNTIMES}.")
    if runtime == "ray":
        from rl.runtime.ray_runtime import check_ray_config

        check_ray_config(config)


def build_checked_model(config: Any, setup: Setup, mesh: Mesh | None) -> Any:
    """The model config.model names on `mesh`: local HF weights (hf_path) or a fresh init."""
    model = build_model(config.model, seed=config.seed, mesh=mesh, rules=setup.rules)
    if setup.tokenizer.vocab_size > model.config.vocab_size:
        raise ValueError(
            f"The tokenizer's vocabulary ({setup.tokenizer.vocab_size}) is larger than the "
            f"model's vocab_size ({model.config.vocab_size}); expected a tokenizer of the same "
            "model."
        )
    return model


def updates_per_round(config: Any) -> int:
    """Optimizer updates per round (config.driver: groups per round / groups per update)."""
    return max(1, config.driver.groups_per_round // max(1, config.driver.groups_per_update))


def build_learner(
    config: Any, setup: Setup, model: Any, mesh: Mesh, *, total_updates: int
) -> Learner:
    """The Learner of `model` (on `mesh`), its optimizer over `total_updates` updates."""
    from learner.config import learner_config_from
    from learner.learner import Learner

    # A cosine schedule with total_steps 0 decays over the run; a run of no rounds (SFT only)
    # makes no RL update, so any valid horizon does.
    learner_cfg = learner_config_from(
        config.learner,
        total_updates=total_updates or config.learner.optimizer.warmup_steps + 1,
        temperature=setup.sampling.temperature,  # one temperature: the loss recomputes the sampler's
        max_length=config.engine.max_length,  # the longest prompt + response it is given
    )
    return Learner(model, learner_cfg, mesh=mesh, rules=setup.rules)


def build_sft(config: Any, setup: Setup, learner: Learner, records: Any) -> SftTrainer:
    """The SFT warm start (config.sft) of `learner` on `records`, in the process owning it."""
    from learner.sft import SftTrainer

    return SftTrainer(
        learner,
        records,
        setup.tokenizer,
        batch_size=config.sft.batch_size,
        lr=config.sft.lr,
        warmup_steps=config.sft.warmup_steps,
        seed=config.seed,
        min_length_bucket=config.learner.min_length_bucket,  # rows padded as in RL, not to 32
        **setup.data.prompt_kwargs,
    )


def build_engine(config: Any, setup: Setup, mesh: Mesh, model: Any) -> Engine:
    """A sampler Engine on `mesh`; `model` gives its structure (weights come by WeightSync)."""
    from sampler.engine import Engine, EngineConfig

    return Engine(
        model, EngineConfig(**config.engine, seed=config.seed), mesh=mesh, rules=setup.rules
    )


def build_reward(config: Any, setup: Setup) -> RewardRunner:
    """The reward runner of config.task.reward (a worker pool with timeouts)."""
    return RewardRunner(
        get_reward(config.task.reward),
        decode=setup.tokenizer.decode,
        timeout_s=config.task.reward_timeout_s,
        workers=config.task.reward_workers,
        backend=config.task.reward_backend,
    )


def rollout_reward(config: Any, runner: RewardRunner) -> Any:
    """What the sampler scores rollouts with: the task's reward, plus DAPO's soft overlong
    punishment when config.overlong.cache_tokens > 0 (evaluation scores the plain reward)."""
    if not config.overlong.cache_tokens:
        return runner
    return OverlongPenalty(
        runner, cache_tokens=config.overlong.cache_tokens, factor=config.overlong.factor
    )


def evaluate_heldout(
    config: Any, setup: Setup, engine: Engine, published: Any, records: Any, reward: Any, k: int
) -> dict[str, float]:
    """Greedy accuracy of published params on `records`, and pass@k from config.eval.pass_n
    samples when k > 1 (rl.evaluate); every runtime evaluates through this."""
    from rl.evaluate import evaluate

    return evaluate(
        engine,
        published,
        records,
        setup.tokenizer,
        reward,
        max_new_tokens=config.sampling.max_new_tokens,
        meta_fields=setup.data.meta_fields,
        k=k,
        n=config.eval.pass_n if k > 1 else 0,
        temperature=config.sampling.temperature,
        **setup.data.prompt_kwargs,
    )


def export_policy(config: Any, setup: Setup, learner: Learner, path: str) -> None:
    """`learner`'s policy as a Hugging Face directory at `path`, with the tokenizer's files when
    one was loaded from a directory (rl.models.export; in the process that owns the learner)."""
    from flax import nnx

    from rl.models.export import export_hf

    spec = config.tokenizer or config.model.hf_path
    export_hf(
        nnx.merge(learner.graphdef, learner.params),
        path,
        tokenizer=setup.tokenizer,
        tokenizer_dir=None if spec == "byte" else spec,
        dtype=config.export.dtype or None,
    )


def build_borrower(
    config: Any, learner: Any, devices: list[Any], *, learner_devices: int
) -> LearnerBorrower | None:
    """The learner's borrower of the sampler's `devices` (config.elastic), its steps compiled
    ahead; None when borrowing is off. `learner` is a Learner (threads: `devices` are the sampler
    mesh's) or the Ray runtime's LearnerClient (the replicas' device ids in the learner's job)."""
    from rl.elastic.borrowing import BorrowConfig, BorrowPolicy
    from rl.elastic.lending import LearnerBorrower
    from rl.elastic.planning import split_models
    from rl.plan import Split

    cfg = BorrowConfig.from_section(config.elastic)
    if not cfg.allows("learner"):
        return None
    replicas = config.mesh.sampler_replicas
    per_replica = len(devices) // replicas
    split = Split(sampler_gpus=per_replica * replicas, tp=per_replica, learner_gpus=learner_devices)
    preset = split_models(cfg.stage_model, slots=config.engine.max_slots)(split)
    borrower = LearnerBorrower(
        BorrowPolicy(cfg, preset.model, model_learner_devices=learner_devices),
        learner,
        devices,
        learner_devices=learner_devices,
        sampler_replicas=replicas,
        replica_devices=per_replica,
        slots=config.engine.max_slots,  # each replica's Engine
        micro_batch_rows=config.learner.micro_batch_rows,
    )
    borrower.prepare()
    return borrower


def build_lender(
    config: Any, *, learner_devices: int, make_replicas: Callable[[], list[Any]]
) -> SamplerLender | None:
    """The sampler's lender of the learner's devices (config.elastic): `make_replicas` builds the
    extra replicas, mesh.sampler_devices of the learner's devices each (engines for the threaded
    sampler, handles for the Ray router); None when that direction is off."""
    from rl.elastic.borrowing import BorrowConfig, BorrowPolicy
    from rl.elastic.lending import SamplerLender
    from rl.elastic.planning import split_models
    from rl.plan import Split

    cfg = BorrowConfig.from_section(config.elastic)
    if not cfg.allows("sampler"):
        return None
    per, replicas = config.mesh.sampler_devices or 1, config.mesh.sampler_replicas
    split = Split(sampler_gpus=per * replicas, tp=per, learner_gpus=learner_devices)
    preset = split_models(cfg.stage_model, slots=config.engine.max_slots)(split)
    return SamplerLender(
        BorrowPolicy(cfg, preset.model, model_learner_devices=learner_devices),
        make_replicas,
        learner_devices=learner_devices,
        replica_devices=per,
        sampler_replicas=replicas,
        slots=config.engine.max_slots,
        micro_batch_rows=config.learner.micro_batch_rows,
    )


def lent_engines(config: Any, setup: Setup, model: Any, devices: list[Any]) -> list[Engine]:
    """Engines of mesh.sampler_devices devices each over `devices` (the learner's, lent to the
    threaded sampler)."""
    from learner.mesh import lent_meshes

    per, tp = config.mesh.sampler_devices or 1, config.mesh.sampler_tp
    return [build_engine(config, setup, m, model) for m in lent_meshes(devices, per, tp)]


def migration_config_from(config: Any) -> Any:
    """config.elastic as a typed rl.elastic.migration.MigrationConfig (validated)."""
    from rl.elastic.migration import MigrationConfig

    e = config.elastic
    return MigrationConfig(
        policy=e.migration,
        max_running_fraction=e.max_running_fraction,
        min_tokens_left=e.min_tokens_left,
    )


class ThreadsRuntime:
    """Everything in this process: the learner and the sampler replicas on disjoint meshes (or
    colocated), config.mesh.sampler_replicas of them, each an Engine on its own devices.

    Attributes:
      mesh_plan: the planner's choice (rl.elastic.planning.MeshPlan) when config.mesh.split is
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
    """

    def __init__(self, config: Any, setup: Setup, *, total_updates: int):
        from learner.mesh import MeshConfig, make_meshes, replica_meshes
        from learner.publish import DevicePutSync
        from rl.elastic.migration import make_migration_policy

        self.config, self.setup = config, setup
        mesh_cfg, self.mesh_plan = MeshConfig(**config.mesh), None
        if mesh_cfg.split == "plan":  # an open split: the planner picks it (rl/elastic/planning)
            import jax

            from rl.elastic.planning import plan_mesh

            mesh_cfg, self.mesh_plan = plan_mesh(config, len(jax.devices()))
        learner_mesh, sampler_mesh = make_meshes(mesh_cfg)
        self.sampler_devices = list(sampler_mesh.devices.flat)
        self.migration = make_migration_policy(migration_config_from(config))
        model = build_checked_model(config, setup, learner_mesh)
        self.learner = build_learner(
            config, setup, model, learner_mesh, total_updates=total_updates
        )
        self.engines = [
            build_engine(config, setup, mesh, model)
            for mesh in replica_meshes(sampler_mesh, mesh_cfg.sampler_replicas)
        ]
        self.engine = self.engines[0]
        # Colocated with the same sharding and dtype, publishing shares the learner's arrays.
        self.weight_sync = DevicePutSync(
            self.learner.params,
            sampler_mesh,
            dtype=config.sampler_dtype,
            rules=setup.rules,
            share_with=self.learner,
        )
        # Every learner program a run calls, compiled now (learner/learner.py precompile).
        self.learner.precompile(
            updates_per_round=updates_per_round(config),
            shared_params=self.weight_sync.shares_params,
        )
        self.reward, self.eval_reward = build_reward(config, setup), build_reward(config, setup)
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

    def driver(self, cfg: DriverConfig, *, reward_fn: Any = None, **kwargs: Any) -> Driver:
        """A Driver over a sampler thread (rl.runtime.threads); kwargs go to the Driver.

        Args:
          reward_fn: scores rollouts instead of config.task.reward (a benchmark's own workload);
            None: the config's (rollout_reward).
        """
        from rl.runtime.threads import threaded_driver

        if self.borrow is not None:
            kwargs.setdefault("borrower", self.borrow)
        if self.lend is not None:
            kwargs.setdefault("lender", self.lend)
        return threaded_driver(
            cfg,
            engine=self.engines,
            learner=self.learner,
            routing=self.config.mesh.sampler_routing,
            migration=self.migration,
            weight_sync=self.weight_sync,
            reward_fn=reward_fn or rollout_reward(self.config, self.reward),
            **kwargs,
        )

    def sft(self, records: Any) -> SftTrainer:
        """The SFT warm start of the learner on `records` (rl.run drives its steps)."""
        return build_sft(self.config, self.setup, self.learner, records)

    def evaluate(self, published: Any, records: Any, *, k: int = 1) -> dict[str, float]:
        """Held-out accuracy (and pass@k, k > 1) of published params (WeightSync output)."""
        published = self.engine.place_params(published)  # all replicas' devices -> replica 0's
        return evaluate_heldout(
            self.config,
            self.setup,
            self.engine,
            self.engine.place_params(published),  # on the first replica's devices
            records,
            self.eval_reward,
            k,
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
        """Start-up is over: a later learner compile is counted as after start, and warned about
        once (the engines' compiles are counted, not yet budgeted: their shapes are not fixed)."""
        self.learner.compiles.start()

    def checkpointer(self, directory: str) -> LocalCheckpoints:
        return LocalCheckpoints(directory, self.learner)

    def close(self) -> None:
        self.reward.close()
        self.eval_reward.close()


class LocalCheckpoints:
    """Checkpoints written where the learner state lives (this process)."""

    def __init__(self, directory: str, learner: Learner):
        from learner.checkpoint import Checkpointer

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


def make_runtime(config: Any, setup: Setup, *, total_updates: int) -> Any:
    """The runtime config.runtime names: ThreadsRuntime or rl.runtime.ray_runtime.RayRuntime."""
    if config.get("runtime", "threads") == "ray":
        from rl.runtime.ray_runtime import RayRuntime

        return RayRuntime(config, setup, total_updates=total_updates)
    return ThreadsRuntime(config, setup, total_updates=total_updates)


def build_driver(config: Any, *, rounds: int) -> tuple[Any, Driver]:
    """A runtime and its Driver for `rounds` rounds from the start of the config's data (no
    workdir, logging or checkpoints: what benchmarks and tests drive). Close the driver, then
    the runtime."""
    from rl.driver import driver_config_from
    from rl.tasks.data import load_task

    check_runtime_config(config)
    setup = Setup.from_config(config)
    data = load_task(setup.data, setup.tokenizer, max_prompt_tokens=setup.max_prompt_tokens)
    driver_cfg = driver_config_from(
        config.driver, sampling=setup.sampling, epoch_size=len(data.train)
    )
    runtime = make_runtime(config, setup, total_updates=rounds * driver_cfg.updates_per_round)
    try:
        prompts = setup.prompts(data.train, seed=config.seed)
        return runtime, runtime.driver(driver_cfg, prompts=prompts, rounds=rounds)
    except BaseException:
        runtime.close()
        raise
