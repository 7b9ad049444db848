"""Every config file parses, builds its typed objects, and rejects bad arguments."""

import glob
import importlib
import os

import pytest

import configs
from learner.config import learner_config_from
from learner.mesh import MeshConfig
from rl.models.build import model_config_from
from rl.models.sharding import normalize_rules

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
    MeshConfig(**config.mesh)
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
