"""The composition root: every component of a run built from one config, in one place.

The threaded runtime (rl.runtime.threads) builds them all in this process; the Ray runtime's
workers each build their own part from the same config (the learner worker its Learner, each
sampler replica its Engine and reward runner), so both runtimes, the benchmarks and the launchers
wire nothing by hand. This module only builds parts; rl.runtime.factory picks the runtime.

    setup = Setup.from_config(config)              # tokenizer, sampling, rules: cheap, anywhere
    learner = build_learner(config, setup, model, mesh, total_updates=...)
    engine = build_engine(config, setup, mesh, model)
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Callable
from typing import Any

from absl import logging
from flax import nnx
from jax.sharding import Mesh

from learner.config import learner_config_from
from learner.learner import Learner
from learner.mesh import lent_meshes
from learner.publish import published_shapes
from learner.sft import SftTrainer
from rl.device_split import Split
from rl.driver import DriverConfig
from rl.elastic.borrowing import BorrowConfig, BorrowPolicy
from rl.elastic.migration import (
    MigrationConfig,
    MigrationPolicy,
    make_migration_policy,
)
from rl.envs import EnvRunner, get_environment
from rl.evaluate import evaluate
from rl.models.build import build_model
from rl.models.export import export_hf
from rl.models.sharding import Rules, normalize_rules
from rl.models.summary import tokenizer_from
from rl.overlong import OverlongPenalty
from rl.rewards import RewardRunner, get_reward
from rl.runtime.lending import LearnerBorrower, SamplerLender
from rl.runtime.mesh_plan import split_models
from rl.schedules.asynchronous import window_warning
from rl.sections import from_section
from rl.tasks.data import DataConfig, data_config_from
from rl.tasks.pipeline import prompt_dataset
from rl.types import SamplingParams
from sampler.engine import Engine, EngineConfig


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
            sampling=from_section(
                SamplingParams,
                config.sampling,
                name="sampling",
                stop_token_ids=(tokenizer.eos_id,),
            ),
            max_prompt_tokens=max(1, min(config.engine.max_prefill_length, max_prompt)),
        )

    def driver_config(self, config: Any, *, epoch_size: int) -> DriverConfig:
        """config.driver as the driver's typed config (this setup's sampling; `epoch_size`
        prompts per epoch). An async window smaller than the sampler's slots is logged
        (rl.schedules.asynchronous.window_warning)."""
        cfg = from_section(
            DriverConfig,
            config.driver,
            name="driver",
            sampling=self.sampling,
            epoch_size=epoch_size,
        )
        slots = config.engine.max_slots * config.mesh.sampler_replicas
        if (warning := window_warning(cfg, slots)) is not None:
            logging.warning("%s", warning)
        return cfg

    def prompts(self, records: Any, *, seed: int) -> Any:
        """The training prompt stream over `records` (a grain iterator: get_state / set_state),
        rendered and tokenized as the task says, shuffled per epoch from `seed`."""
        return iter(
            prompt_dataset(
                records,
                self.tokenizer,
                seed=seed,
                meta_fields=self.data.meta_fields,
                **self.data.prompt_kwargs,
            )
        )


def build_checked_model(config: Any, setup: Setup, mesh: Mesh | None) -> Any:
    """The model config.model names on `mesh`: local HF weights (hf_path) or a fresh init."""
    model = build_model(config.model, seed=config.seed, mesh=mesh, rules=setup.rules)
    if model.config.lora is not None and not config.model.hf_path:
        logging.warning(
            "LoRA on a freshly initialised model: only the adapters train (the SFT warm start "
            "too), over random base weights, which caps what the model can learn; start from a "
            "trained base (config.model.hf_path, e.g. the export of an SFT run: README, LoRA)."
        )
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
    return SftTrainer(
        learner,
        records,
        setup.tokenizer,
        batch_size=config.sft.batch_size,
        lr=config.sft.lr,
        warmup_steps=config.sft.warmup_steps,
        seed=config.seed,
        min_length_bucket=config.learner.min_length_bucket,  # rows padded as in RL, not to 32
        examples_per_row=config.sft.examples_per_row,
        **setup.data.prompt_kwargs,
    )


def build_engine(config: Any, setup: Setup, mesh: Mesh, model: Any) -> Engine:
    """A sampler Engine on `mesh`; `model` gives its structure (weights come by WeightSync)."""
    return Engine(
        model,
        from_section(EngineConfig, config.engine, name="engine", seed=config.seed),
        mesh=mesh,
        rules=setup.rules,
    )


def precompile_engine(config: Any, engine: Engine, params_like: Any) -> None:
    """Compiles, now, every program the run calls on `engine` (sampler/engine.py `precompile`)
    for published parameters like `params_like` (`learner.publish.published_shapes`): re-prefill
    with driver.recompute_kv or async borrowing, and migration's export/import of up to a request's launched samples
    when config.elastic.migration can move requests between replicas."""
    migrates = config.elastic.migration != "off" and config.mesh.sampler_replicas > 1
    launched = math.ceil(config.driver.tail.response_eta * config.driver.group_size)
    # async borrowing takes lent replicas back mid-rollout: their samples resume re-prefilled
    resumes = config.driver.mode == "async" and config.elastic.borrowing != "off"
    engine.precompile(
        params_like,
        recompute=config.driver.recompute_kv or resumes,
        migrate_rows=launched if migrates else 0,
        multi_turn=bool(config.env.name),
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


# config.env's own fields; the rest are the environment's options (those its constructor takes)
ENV_FIELDS = ("name", "max_turns", "timeout_s", "workers")


def build_environment(config: Any, setup: Setup) -> EnvRunner | None:
    """The multi-turn environment of config.env (rl/envs) on its runner, or None (env.name "":
    single-turn). The environment is given the tokenizer, the task's reward and the options of
    config.env its constructor names."""
    if not config.env.name:
        return None
    factory = get_environment(config.env.name)
    takes = inspect.signature(factory).parameters
    options = {k: v for k, v in config.env.items() if k not in ENV_FIELDS and k in takes}
    env = factory(tokenizer=setup.tokenizer, reward=get_reward(config.task.reward), **options)
    return EnvRunner(
        env,
        vocab_size=setup.tokenizer.vocab_size,
        max_turns=config.env.max_turns,
        timeout_s=config.env.timeout_s,
        workers=config.env.workers,
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
    config: Any,
    setup: Setup,
    engine: Engine,
    published: Any,
    records: Any,
    reward: Any,
    k: int,
    environment: EnvRunner | None = None,
) -> dict[str, float]:
    """Greedy accuracy of published params on `records`, and pass@k from config.eval.pass_n
    samples when k > 1 (rl.evaluate), episodes in `environment` if any; every runtime evaluates
    through this."""
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
        environment=environment,
        **setup.data.prompt_kwargs,
    )


def export_policy(config: Any, setup: Setup, learner: Learner, path: str) -> None:
    """`learner`'s policy as a Hugging Face directory at `path`, with the tokenizer's files when
    one was loaded from a directory (rl.models.export; in the process that owns the learner)."""
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
    cfg = borrow_config_from(config)
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
    cfg = borrow_config_from(config)
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
    threaded sampler), their programs compiled before they decode (`precompile_engine`)."""
    per, tp = config.mesh.sampler_devices or 1, config.mesh.sampler_tp
    engines = [build_engine(config, setup, m, model) for m in lent_meshes(devices, per, tp)]
    published = published_shapes(nnx.state(model), config.sampler_dtype)
    for engine in engines:
        precompile_engine(config, engine, published)
    return engines


def borrow_config_from(config: Any) -> BorrowConfig:
    """config.elastic's borrowing fields as a typed rl.elastic.borrowing.BorrowConfig."""
    return from_section(BorrowConfig, config.elastic, name="elastic", shared=True)


def migration_config_from(config: Any) -> MigrationConfig:
    """config.elastic as a typed rl.elastic.migration.MigrationConfig (validated)."""
    return from_section(
        MigrationConfig, config.elastic, name="elastic", shared=True, rename={"migration": "policy"}
    )


def build_migration(config: Any, *, pooled: bool = False) -> MigrationPolicy:
    """The run's long-tail migration policy (config.elastic.migration). `tail` has no consumer
    for the replicas it would free in one pipeline (rl/elastic/migration.py) and would only slow
    the run; it is off then, and the log says so. In a multiplexed pool (`pooled`,
    rl/runtime/pool.py) the other pipelines are the consumer: `tail` runs on demand, emptying the
    replicas the pool recalls and spreading onto the ones that join."""
    cfg = migration_config_from(config)
    if pooled:
        return make_migration_policy(dataclasses.replace(cfg, on_demand=True), consumer=True)
    if cfg.policy == "tail":
        logging.warning(
            "config.elastic.migration='tail': in one pipeline the replicas it would free get no "
            "work the others would not take anyway, and consolidating a tail only slows it "
            "(rl/elastic/migration.py); migration is off for this run (a multiplexed sweep, "
            "launch.sweep, is its consumer). 'always' moves at every chance (the exactness "
            "tests' forcing mode)."
        )
    return make_migration_policy(cfg)
