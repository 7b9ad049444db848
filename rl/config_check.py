"""One validation pass over a whole run config, before anything is built or written.

    check_config(config)   # raises ConfigError naming every bad field, or returns None

`rl.run.train` calls it first, and `launch.train` before anything else: every field the run reads
is checked here (the typed configs' own checks, and the rules that tie fields together, such as a
group fitting the engine's slots or a response fitting its cache), in about a second, with no
compile, no data loaded, and nothing in the workdir touched. Each problem is one line naming the
field, what it received and what it expects; a field that does not exist names the closest one.
Known fields are those of configs/base.py and of the typed configs built from the sections.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Callable, Mapping
from typing import Any

from configs import base
from learner.config import LearnerConfig, OptimizerConfig, learner_config_from
from learner.distributed import distributed_config_from
from learner.mesh import MeshConfig, make_meshes
from rl.driver import DriverConfig
from rl.envs import get_environment
from rl.losses import LOSS_OPTIONS, LossConfig
from rl.models.build import model_config_from
from rl.models.config import DTYPES
from rl.models.sharding import normalize_rules
from rl.models.summary import tokenizer_from
from rl.overlong import OverlongPenalty
from rl.rewards import get_reward
from rl.rewards.runner import BACKENDS as REWARD_BACKENDS
from rl.round_planner import TailConfig
from rl.runtime.compose import borrow_config_from, migration_config_from
from rl.runtime.factory import RUNTIMES
from rl.runtime.ray_config import RayConfig, check_ray_config
from rl.sections import from_section
from rl.tasks.data import data_config_from
from rl.tasks.registry import TASKS
from rl.tracking import WANDB_MISSING, tracking_config_from, wandb_installed
from rl.types import SamplingParams
from sampler.engine import EngineConfig

RAY_SECTIONS = ("ray", "mesh", "elastic", "sft")  # the sections check_ray_config reads


class ConfigError(ValueError):
    """Bad config fields: `problems` holds one line per field."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        if len(self.problems) == 1:
            message = self.problems[0]
        else:
            lines = "\n".join(f"  {p}" for p in self.problems)
            message = f"{len(self.problems)} config fields are invalid:\n{lines}"
        super().__init__(message)


# Fields that are not where a user may look for them: path -> (the field to set instead, why).
# config.async_resume: how driver.mode=async checkpoints (rl/schedules/asynchronous.py)
ASYNC_RESUME = ("exact", "no_bubble")
MOVED = {
    "config.learner.temperature": (
        "config.sampling.temperature",
        "one temperature for sampling and the loss",
    ),
    "config.learner.max_length": (
        "config.engine.max_length",
        "the longest prompt + response, for the sampler's cache and the learner's row lengths",
    ),
    "config.learner.pack_max_length": (
        "config.engine.max_length",
        "packed rows are at most its power-of-two bucket long",
    ),
}


def _moved(path: str) -> str | None:
    """The message for a field in MOVED ("config.learner has no field 'temperature'; ..")."""
    if path not in MOVED:
        return None
    where, _, key = path.rpartition(".")
    target, why = MOVED[path]
    return f"{where} has no field {key!r}; expected {target} ({why})."


def _near(key: str, keys: list[str], where: str) -> str:
    near = difflib.get_close_matches(key, keys, n=1, cutoff=0.5)
    return f"did you mean {where}.{near[0]}?" if near else f"expected one of {sorted(keys)}."


def closest_field(config: Any, path: str) -> str | None:
    """For a dotted path that is not a field: "config.driver has no field 'mdoe'; did you mean ...".

    Args:
      config: a ConfigDict (or nested mappings).
      path: e.g. "driver.mdoe".

    Returns:
      The message, or None when `path` is a field.
    """
    if moved := _moved(f"config.{path}"):
        return moved
    node, where = config, "config"
    for key in path.split("."):
        if not hasattr(node, "keys"):
            return f"{where} is a {type(node).__name__}, not a section; it has no field {key!r}."
        if key not in node:
            return f"{where} has no field {key!r}; {_near(key, list(node.keys()), where)}"
        node, where = node[key], f"{where}.{key}"
    return None


def _unknown_fields(config: Any, schema: Mapping[str, Any], where: str = "config") -> list[str]:
    """One line per field of `config` that `schema` (nested dicts of known names) lacks."""
    out = []
    for key in config:
        if moved := _moved(f"{where}.{key}"):
            out.append(moved)
        elif key not in schema:
            out.append(f"{where} has no field {key!r}; {_near(key, list(schema), where)}")
        elif isinstance(schema[key], Mapping) and hasattr(config[key], "keys"):
            out += _unknown_fields(config[key], schema[key], f"{where}.{key}")
    return out


def _schema() -> dict[str, Any]:
    """Known field names: configs/base.py's fields and every field of the typed configs."""

    def names(cls: type, *drop: str) -> dict[str, Any]:
        return {f.name: None for f in dataclasses.fields(cls) if f.name not in drop}

    def tree(node: Any) -> Any:
        return {k: tree(v) for k, v in node.items()} if hasattr(node, "items") else None

    schema = tree(base.get_config())
    # config.task holds the options of every registered task (a user's too), not only base's
    options = {name: None for task in TASKS.values() for name in task.options}
    schema["task"] = {**options, **schema["task"]}
    typed = {
        "driver": names(DriverConfig, "sampling", "epoch_size"),
        "sampling": names(SamplingParams, "stop_token_ids"),
        "engine": names(EngineConfig, "seed"),
        "mesh": names(MeshConfig),
        "ray": names(RayConfig),
        "learner": names(LearnerConfig, "temperature"),  # set from sampling.temperature
    }
    for section, fields in typed.items():
        schema[section] = {**fields, **schema.get(section, {})}
    schema["driver"]["tail"] = {**names(TailConfig), **(schema["driver"].get("tail") or {})}
    for sub, cls in (("optimizer", OptimizerConfig), ("loss", LossConfig)):
        schema["learner"][sub] = {**names(cls, "custom"), **(schema["learner"].get(sub) or {})}
    for name, cls in LOSS_OPTIONS.items():  # each policy loss's options, user-registered ones too
        loss = schema["learner"]["loss"]
        loss[name] = {**names(cls), **(loss.get(name) or {})}
    return schema


class _Problems:
    """Collects one line per bad field; `build` runs a typed constructor and keeps its message."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def add(self, line: str) -> None:
        self.lines.append(line)

    def build(self, where: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except (ValueError, TypeError, OSError) as e:
            text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            self.add(text if text.startswith("config.") else f"config.{where}: {text}")
            return None

    def integer(self, section: Any, where: str, name: str, low: int, meaning: str) -> bool:
        """`section[name]` must be an int >= low (absent: not checked); True if it is."""
        if name not in section:
            return True
        value = section[name]
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            self.add(f"config.{where}{name}={value!r}; expected an integer >= {low} ({meaning}).")
            return False
        return True

    def positive(self, section: Any, where: str, name: str, meaning: str) -> None:
        """`section[name]` must be a finite number > 0 (absent: not checked)."""
        value = section.get(name, 1.0)
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        if not (ok and math.isfinite(value) and value > 0):
            self.add(f"config.{where}{name}={value!r}; expected a number > 0 ({meaning}).")


def check_config(config: Any) -> None:
    """Checks every field a run reads; see the module docstring.

    Args:
      config: the run's ConfigDict (configs/base.py lists every field).

    Raises:
      ConfigError: one line per bad field (what it received, what it expects).
    """

    p = _Problems()
    unknown = _unknown_fields(config, _schema())
    for line in unknown:
        p.add(line)
    typo = {line.split(" has no field")[0].removeprefix("config.") for line in unknown}

    def clean(*sections: str) -> bool:  # no misspelled field in these sections (or below)
        return not any(t == s or t.startswith(s + ".") for t in typo for s in sections)

    # Run-level fields.
    p.integer(config, "", "rounds", 0, "RL rounds in total")
    p.integer(config, "", "checkpoint_every", 0, "rounds between checkpoints; 0: never")
    p.integer(config, "", "timeline_rounds", 0, "rounds drawn in timeline.png; 0: all")
    seed = config.get("seed")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**31:
        p.add(f"config.seed={seed!r}; expected an integer in [0, 2**31).")
        seed = 0
    for name in ("resume", "resume_strict", "overwrite"):
        if name in config and not isinstance(config[name], bool):
            p.add(f"config.{name}={config[name]!r}; expected True or False.")
    if config.get("async_resume", "exact") not in ASYNC_RESUME:
        p.add(f"config.async_resume={config.async_resume!r}; expected one of {ASYNC_RESUME}.")
    if not str(config.get("workdir") or "").strip():
        p.add(f"config.workdir={config.get('workdir')!r}; expected a directory path.")
    sampler_dtype = config.get("sampler_dtype", "")
    if sampler_dtype and sampler_dtype not in DTYPES:
        p.add(f"config.sampler_dtype={sampler_dtype!r}; expected one of {tuple(DTYPES)} or ''.")

    # Task, data, model, tokenizer.
    data = p.build("data", lambda: data_config_from(config)) if clean("data", "task") else None
    p.build("sharding_rules", lambda: normalize_rules(config.sharding_rules))
    model = p.build("model", lambda: model_config_from(config.model)) if clean("model") else None
    tokenizer = p.build("tokenizer", lambda: tokenizer_from(config))
    if tokenizer is not None and model is not None and tokenizer.vocab_size > model.vocab_size:
        p.add(
            f"config.tokenizer: its vocabulary ({tokenizer.vocab_size}) is larger than the "
            f"model's vocab_size ({model.vocab_size}); expected the tokenizer of the same model."
        )
    p.build("task.reward", lambda: get_reward(config.task.reward))
    if p.integer(config.eval, "eval.", "pass_k", 0, "k of held-out pass@k; <= 1: off") and (
        p.integer(config.eval, "eval.", "pass_n", 0, "samples per problem for pass@k; 0: pass_k")
    ):
        pass_k, pass_n = config.eval.get("pass_k", 0), config.eval.get("pass_n", 0)
        if pass_k > 1 and pass_n and pass_n < pass_k:
            p.add(
                f"config.eval.pass_n={pass_n} is below config.eval.pass_k={pass_k}; expected "
                "n >= k samples per problem (or 0: n = k)."
            )
    export = config.get("export", {})
    if not isinstance(export.get("hf", False), bool):
        p.add(f"config.export.hf={export.get('hf')!r}; expected True or False.")
    if export.get("dtype", "") and export.get("dtype") not in DTYPES:
        p.add(
            f"config.export.dtype={export.get('dtype')!r}; expected one of {tuple(DTYPES)} or ''."
        )
    tracking = p.build("log", lambda: tracking_config_from(config)) if clean("log") else None
    if tracking is not None and tracking.wandb and not wandb_installed():
        p.add(WANDB_MISSING)
    if clean("overlong") and config.overlong.cache_tokens:
        cap = config.sampling.get("max_new_tokens", 0)
        penalty = p.build(
            "overlong",
            lambda: OverlongPenalty(
                get_reward, cache_tokens=config.overlong.cache_tokens, factor=config.overlong.factor
            ),
        )
        if penalty is not None and isinstance(cap, int) and penalty.cache_tokens > cap:
            p.add(
                f"config.overlong.cache_tokens={penalty.cache_tokens} exceeds "
                f"config.sampling.max_new_tokens={cap}; expected at most the response cap."
            )
    if clean("env") and config.env.get("name"):
        p.build("env.name", lambda: get_environment(config.env.name))
        p.integer(config.env, "env.", "max_turns", 1, "the model's turns per episode")
        p.positive(config.env, "env.", "timeout_s", "seconds")
        p.integer(config.env, "env.", "workers", 1, "environment steps run at once")
        if config.overlong.cache_tokens:
            p.add(
                f"config.overlong.cache_tokens={config.overlong.cache_tokens} with config.env."
                f"name={config.env.name!r}: an episode's reward is its environment's; expected "
                "overlong.cache_tokens=0 (or env.name='')."
            )
    p.positive(config.task, "task.", "reward_timeout_s", "seconds")
    p.integer(config.task, "task.", "reward_workers", 1, "reward calls run at once")
    backend = config.task.get("reward_backend", "thread")
    if backend not in REWARD_BACKENDS:
        p.add(f"config.task.reward_backend={backend!r}; expected one of {REWARD_BACKENDS}.")
    task = TASKS.get(config.task.get("name"), None)
    if task is not None and task.source == "generate":
        p.integer(config.task, "task.", "train_size", 1, "generated training problems")

    # Sampling, engine, driver, learner, mesh: the typed configs' own checks.
    sampling = engine = driver = learner = mesh = meshes = None
    if clean("sampling"):
        sampling = p.build(
            "sampling", lambda: from_section(SamplingParams, config.sampling, name="sampling")
        )
    if clean("engine"):
        engine = p.build(
            "engine",
            lambda: from_section(EngineConfig, config.engine, name="engine", seed=seed),
        )
    if sampling is not None and clean("driver"):
        driver = p.build(
            "driver",
            lambda: from_section(
                DriverConfig, config.driver, name="driver", sampling=sampling, epoch_size=0
            ),
        )
    if clean("learner"):
        rounds = config.rounds if isinstance(config.get("rounds"), int) else 0
        total = max(0, rounds) * (driver.updates_per_round if driver is not None else 1)
        warmup = config.learner.get("optimizer", {}).get("warmup_steps", 0)
        learner = p.build(
            "learner",
            lambda: learner_config_from(
                config.learner,
                total_updates=total or (warmup if isinstance(warmup, int) else 0) + 1,
                temperature=sampling.temperature if sampling is not None else 1.0,
                **(
                    {"max_length": config.engine.max_length}
                    if isinstance(config.get("engine", {}).get("max_length"), int)
                    and config.engine.max_length >= 2
                    else {}
                ),
            ),
        )
        group = p.build(
            "learner.distributed",
            lambda: distributed_config_from(config.learner.get("distributed")),
        )
        runtime = config.get("runtime", "threads")
        if group is not None and group.multi_process and runtime == "threads":
            p.add(
                f"config.learner.distributed.num_processes={group.num_processes} (a multi-process "
                f"learner) with config.runtime={runtime!r}; expected 1: the threads runtime runs "
                "the learner and the sampler in one process."
            )
        if runtime not in RUNTIMES:
            p.add(f"config.runtime={runtime!r}; expected one of {RUNTIMES}.")
        elif runtime == "ray" and all(k in config and clean(k) for k in RAY_SECTIONS):
            p.build("ray", lambda: check_ray_config(config))
    elastic = None
    if clean("elastic") and "elastic" in config:
        p.build("elastic", lambda: migration_config_from(config))
        elastic = p.build("elastic", lambda: borrow_config_from(config))
        if elastic is not None and elastic.borrowing != "off" and not elastic.stage_model:
            p.add(
                f"config.elastic.borrowing={elastic.borrowing!r} with no config.elastic."
                "stage_model; expected a launch.profile JSON or 'preset:<model>:<gpu>' to predict "
                "gains with."
            )
        if elastic is not None and elastic.borrowing != "off":
            if config.get("mesh", {}).get("colocated"):
                p.add(
                    f"config.elastic.borrowing={elastic.borrowing!r} with config.mesh.colocated="
                    "True; expected disjoint learner and sampler devices (colocated sides already "
                    "share every device)."
                )
            mode = config.get("driver", {}).get("mode")
            if mode == "async" and elastic.allows("sampler") and config.get("env", {}).get("name"):
                p.add(
                    f"config.elastic.borrowing={elastic.borrowing!r} with config.driver.mode="
                    f"'async' and config.env.name={config.env.name!r}; expected no environment "
                    "or borrowing='learner': an episode waiting for its environment cannot move "
                    "off a replica taken back."
                )
    if clean("mesh"):
        mesh = p.build("mesh", lambda: from_section(MeshConfig, config.mesh, name="mesh"))
        if mesh is not None and mesh.split == "plan":
            if not config.get("elastic", {}).get("stage_model"):
                p.add(
                    "config.mesh.split='plan' with no config.elastic.stage_model; expected a "
                    "launch.profile JSON or 'preset:<model>:<gpu>' for the planner."
                )
            mesh = None  # the planner picks the counts: the fixed checks below do not apply
        meshes = p.build("mesh", lambda: make_meshes(mesh)) if mesh is not None else None

    # Rules between sections.
    if engine is not None and driver is not None:
        launched = math.ceil(driver.tail.response_eta * driver.group_size)
        if launched > engine.max_slots:
            what = f"config.driver.group_size={driver.group_size}" + (
                f" x driver.tail.response_eta={driver.tail.response_eta}"
                if launched > driver.group_size
                else ""
            )
            p.add(
                f"{what} ({launched} samples per group) exceeds config.engine.max_slots="
                f"{engine.max_slots}; expected at most max_slots (a group is admitted whole)."
            )
    if engine is not None and sampling is not None:
        caps = [("sampling.max_new_tokens", sampling.max_new_tokens)]
        if driver is not None and driver.tail.long_max_new_tokens:
            caps.append(("driver.tail.long_max_new_tokens", driver.tail.long_max_new_tokens))
        for field, new in caps:
            if new >= engine.max_length:
                p.add(
                    f"config.{field}={new} leaves no room for a prompt in config.engine."
                    f"max_length={engine.max_length} (prompt + response); expected max_length > "
                    f"{new}."
                )
    if engine is not None and model is not None:
        if engine.max_length > model.max_position_embeddings:
            p.add(
                f"config.engine.max_length={engine.max_length} exceeds the model's "
                f"max_position_embeddings ({model.max_position_embeddings}); expected at most that."
            )
    if meshes is not None:
        learner_mesh, sampler_mesh = meshes
        fsdp = learner_mesh.shape["fsdp"]
        data_axis = sampler_mesh.shape["data"] // mesh.sampler_replicas
        if learner is not None and learner.micro_batch_rows % fsdp:
            p.add(
                f"config.learner.micro_batch_rows={learner.micro_batch_rows} is not divisible by "
                f"the learner mesh's fsdp axis ({fsdp}); expected a multiple of {fsdp}."
            )
        if engine is not None and engine.max_slots % data_axis:
            p.add(
                f"config.engine.max_slots={engine.max_slots} is not divisible by the sampler "
                f"mesh's data axis ({data_axis}); expected a multiple of {data_axis}."
            )

    # Warm start and evaluation.
    sft = config.get("sft") or {}
    if sft and p.integer(sft, "sft.", "max_steps", 0, "SFT warm-start steps; 0: none"):
        if sft.get("max_steps", 0) > 0:
            p.integer(sft, "sft.", "batch_size", 1, "records per SFT step")
            p.integer(sft, "sft.", "examples_per_row", 1, "records one after another in a row")
            p.integer(sft, "sft.", "eval_every", 1, "SFT steps between evaluations")
            p.positive(sft, "sft.", "lr", "the SFT learning rate")
            target = sft.get("target_accuracy", 0.0)
            if not (isinstance(target, int | float) and 0 <= target <= 1):
                p.add(f"config.sft.target_accuracy={target!r}; expected a number in [0, 1].")
            size, batch = config.task.get("train_size", 0), sft.get("batch_size", 0)
            generated = data is not None and data.source == "generate"
            if generated and isinstance(batch, int) and isinstance(size, int) and batch > size > 0:
                p.add(
                    f"config.sft.batch_size={batch} exceeds config.task.train_size={size}; "
                    "expected at most the training problems."
                )
    if "eval" in config:
        p.integer(config.eval, "eval.", "every_rounds", 0, "rounds between evaluations; 0: ends")
    if p.lines:
        raise ConfigError(p.lines)
