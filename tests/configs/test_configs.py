"""Every config file parses, builds its typed objects, and rejects bad arguments."""

import glob
import importlib
import os

import pytest

import configs
from learner.config import LearnerConfig, learner_config_from
from learner.mesh import MeshConfig
from rl.driver import DriverConfig
from rl.models.build import model_config_from
from rl.models.sharding import normalize_rules
from rl.sections import from_section
from rl.tasks.data import DataConfig, data_config_from
from rl.types import SamplingParams
from sampler.engine import EngineConfig

CONFIG_DIR = os.path.dirname(configs.__file__)
FILES = sorted(
    os.path.splitext(os.path.basename(p))[0]
    for p in glob.glob(os.path.join(CONFIG_DIR, "*.py"))
    if not p.endswith("__init__.py")
)


def test_config_files_exist():
    assert {"base", "smoke"} <= set(FILES)


@pytest.mark.parametrize("name", FILES)
@pytest.mark.parametrize("arg", [None, "smoke"])
def test_config_parses_and_builds_typed_objects(name, arg):
    config = importlib.import_module(f"configs.{name}").get_config(arg)
    assert config.model.hf_path or model_config_from(config.model).num_params() > 0
    normalize_rules(config.sharding_rules)
    learner_config_from(config.learner, total_updates=config.rounds)
    from_section(MeshConfig, config.mesh, name="mesh")
    if arg == "smoke":
        assert model_config_from(config.model).num_params() < 1_000_000
        assert config.tokenizer == "byte"


def test_cosine_without_total_steps_decays_over_the_runs_updates():
    config = importlib.import_module("configs.base").get_config()
    config.learner.optimizer.schedule = "cosine"
    config.learner.optimizer.total_steps = 0
    assert learner_config_from(config.learner, total_updates=640).optimizer.total_steps == 640
    config.learner.optimizer.total_steps = 100  # an explicit horizon wins
    assert learner_config_from(config.learner, total_updates=640).optimizer.total_steps == 100
    config.learner.optimizer.total_steps = 0
    with pytest.raises(ValueError, match="total_steps 0 means the run's rounds x updates"):
        learner_config_from(config.learner)


def test_base_rejects_unknown_arg():
    with pytest.raises(ValueError, match="Unknown config argument 'huge'"):
        importlib.import_module("configs.base").get_config("huge")


def test_tie_embeddings_overrides_the_preset():
    config = importlib.import_module("configs.base").get_config()
    config.model.preset = "tiny"  # a tied preset
    assert model_config_from(config.model).tie_embeddings
    config.model.tie_embeddings = "untied"
    untied = model_config_from(config.model)
    assert not untied.tie_embeddings
    tied_params = model_config_from({**config.model, "tie_embeddings": "tied"}).num_params()
    assert untied.num_params() == tied_params + untied.vocab_size * untied.d_model  # the head
    config.model.tie_embeddings = "yes"
    with pytest.raises(
        ValueError, match=r"tie_embeddings='yes'; expected one of \('preset', 'tied'"
    ):
        model_config_from(config.model)


# Each typed config, the config section it is built from, and its fields a run sets from
# elsewhere (not read from that section). Every other field must be in configs/base.py with the
# dataclass's default, so a default changed on one side only fails here.
def _typed_sections():
    from learner.config import LearnerConfig, OptimizerConfig
    from rl.driver import DriverConfig
    from rl.elastic.borrowing import BorrowConfig
    from rl.loss_config import BUILTIN_OPTIONS, LossConfig
    from rl.round_planner import TailConfig
    from rl.types import SamplingParams
    from sampler.engine import EngineConfig

    return [
        ("driver", DriverConfig, {"sampling", "epoch_size", "tail"}),  # epoch: the data's size
        ("driver.tail", TailConfig, set()),
        ("sampling", SamplingParams, {"stop_token_ids"}),  # the tokenizer's eos
        ("engine", EngineConfig, {"seed"}),  # config.seed
        ("mesh", MeshConfig, set()),
        # migration's fields: rl.elastic.migration.MigrationConfig (rl.runtime.compose)
        (
            "elastic",
            BorrowConfig,
            {"migration", "max_running_fraction", "min_tokens_left", "grow_tokens"},
        ),
        # temperature: config.sampling.temperature; max_length: config.engine.max_length; loss:
        # the losses' own configs (checked by the loss registry); distributed:
        # learner/distributed.py (0 / -1 there mean "from $JAX_*")
        (
            "learner",
            LearnerConfig,
            {"optimizer", "loss", "temperature", "max_length", "distributed"},
        ),
        ("learner.optimizer", OptimizerConfig, set()),
        # the built-in losses' sections are their options dataclasses, checked one by one below
        ("learner.loss", LossConfig, {"custom", *BUILTIN_OPTIONS}),
        *((f"learner.loss.{name}", cls, set()) for name, cls in BUILTIN_OPTIONS.items()),
    ]


def _section(config, path):
    for key in path.split("."):
        config = config[key]
    return config


@pytest.mark.parametrize(
    "path,cls,derived", _typed_sections(), ids=lambda x: getattr(x, "__name__", x)
)
def test_every_typed_default_is_base_py_s(path, cls, derived):
    import dataclasses

    base = _section(importlib.import_module("configs.base").get_config(), path)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.name not in derived}
    missing = sorted(set(fields) - set(base))
    assert not missing, (
        f"{cls.__name__} fields missing from configs/base.py config.{path}: {missing}"
    )
    drift = {name: (f.default, base[name]) for name, f in fields.items() if f.default != base[name]}
    assert not drift, f"{cls.__name__} default vs configs/base.py config.{path}: {drift}"
    unread = sorted(k for k in base if k not in fields and k not in derived)
    assert not unread, (
        f"configs/base.py config.{path} fields {cls.__name__} does not read: {unread}"
    )


def test_the_drift_check_sees_a_changed_default(monkeypatch):
    """The check above fails when base.py and a dataclass disagree (here: engine.max_slots)."""
    from configs import base

    get_config = base.get_config

    def drifted(arg=None):
        config = get_config(arg)
        config.engine.max_slots += 1
        return config

    monkeypatch.setattr(base, "get_config", drifted)
    path, cls, derived = next(s for s in _typed_sections() if s[0] == "engine")
    with pytest.raises(AssertionError, match=r"'max_slots': \(64, 65\)"):
        test_every_typed_default_is_base_py_s(path, cls, derived)


@pytest.mark.parametrize("name", FILES)
@pytest.mark.parametrize("arg", [None, "smoke"])
def test_every_typed_config_builds_from_every_config_file(name, arg):
    config = importlib.import_module(f"configs.{name}").get_config(arg)
    if not config.data.train_path:  # the JSONL recipes take their files on the command line
        config.data.train_path = "/data/train.jsonl"
    if not config.data.heldout_path and not config.eval.heldout_size:
        config.data.heldout_path = "/data/test.jsonl"
    sampling = from_section(SamplingParams, config.sampling, name="sampling")
    assert isinstance(data_config_from(config), DataConfig)
    engine = from_section(EngineConfig, config.engine, name="engine", seed=config.seed)
    assert isinstance(engine, EngineConfig)
    driver = from_section(DriverConfig, config.driver, name="driver", sampling=sampling)
    assert isinstance(driver, DriverConfig) and driver.sampling == sampling
    learner = learner_config_from(
        config.learner, total_updates=config.rounds, temperature=sampling.temperature
    )
    assert isinstance(learner, LearnerConfig)
    assert learner.temperature == (sampling.temperature or 1.0)  # the one temperature


def test_the_learner_reads_the_sampling_temperature():
    config = importlib.import_module("configs.base").get_config()
    assert learner_config_from(config.learner, temperature=0.7).temperature == 0.7
    assert learner_config_from(config.learner, temperature=0.0).temperature == 1.0  # greedy
    with config.unlocked():
        config.learner.temperature = 0.7
    with pytest.raises(ValueError, match="learner uses config.sampling.temperature"):
        learner_config_from(config.learner)


def test_data_config_and_task_option_defaults_are_base_py_s():
    import dataclasses

    from rl.tasks.data import DataConfig
    from rl.tasks.registry import get_task

    config = importlib.import_module("configs.base").get_config()
    where = {"task": "task.name", "seed": "seed", "train_size": "task.train_size",
             "heldout_size": "eval.heldout_size"}  # fmt: skip
    for f in dataclasses.fields(DataConfig):
        if f.name == "options":
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        assert _section(config, where.get(f.name, f"data.{f.name}")) == default, f.name
    assert set(config.data) == {f.name for f in dataclasses.fields(DataConfig)} - set(where) - {
        "options"
    }
    for name in ("addition", "countdown", "gsm8k", "math"):  # the built-in tasks' options
        for option, default in get_task(name).options.items():
            assert config.task[option] == default, (name, option)


def test_init_std_overrides_the_preset():
    config = importlib.import_module("configs.base").get_config("smoke")
    assert model_config_from(config.model).init_std == 0.02  # 0: the preset's
    config.model.init_std = 0.3
    assert model_config_from(config.model).init_std == 0.3
    config.model.init_std = -1.0
    with pytest.raises(ValueError, match=r"init_std must be a number >= 0 .*received -1.0"):
        model_config_from(config.model)
