"""One validation pass over the whole config: every bad field named, before anything is built."""

import glob
import importlib
import json
import os

import pytest

import configs
from configs import smoke
from rl.config_check import ConfigError, check_config, closest_field

NAMES = sorted(
    os.path.splitext(os.path.basename(p))[0]
    for p in glob.glob(os.path.join(os.path.dirname(configs.__file__), "*.py"))
    if not p.endswith("__init__.py")
)


@pytest.mark.parametrize("name", NAMES)
def test_every_config_file_passes_with_its_smoke_arg(name, tmp_path):
    config = importlib.import_module(f"configs.{name}").get_config("smoke")
    if config.task.name in ("gsm8k", "math"):  # JSONL recipes name their data file
        row = {"question": "1+1?", "answer": "#### 2", "problem": "1+1?", "solution": "\\boxed{2}"}
        (tmp_path / "train.jsonl").write_text(json.dumps(row) + "\n")
        config.data.train_path = str(tmp_path / "train.jsonl")
    check_config(config)


def test_every_bad_field_is_named_in_one_pass_with_received_and_expected():
    config = smoke.get_config()
    config.rounds = -1
    config.checkpoint_every = -1
    config.driver.group_size = 16  # > engine.max_slots = 8
    config.sampling.max_new_tokens = 40  # >= engine.max_length = 32: no room for a prompt
    config.engine.max_prefill_length = 16
    config.task.reward_backend = "gpu"
    config.sampler_dtype = "float8"
    config.sft.eval_every = 0
    with pytest.raises(ConfigError) as e:
        check_config(config)
    problems = e.value.problems
    expected = [
        "config.rounds=-1; expected an integer >= 0",
        "config.checkpoint_every=-1; expected an integer >= 0",
        "config.driver.group_size=16 (16 samples per group) exceeds config.engine.max_slots=8",
        "config.sampling.max_new_tokens=40 leaves no room for a prompt in config.engine.max_length=32",
        "config.task.reward_backend='gpu'; expected one of ('thread', 'process')",
        "config.sampler_dtype='float8'; expected one of",
        "config.sft.eval_every=0; expected an integer >= 1",
    ]
    for fragment in expected:
        assert sum(fragment in p for p in problems) == 1, (fragment, problems)
    assert len(problems) == len(expected) and all("\n" not in p for p in problems)
    assert str(e.value).startswith(f"{len(expected)} config fields are invalid:\n  config.")


def test_typed_sections_report_their_own_checks():
    config = smoke.get_config()
    config.driver.mode = "synk"
    config.learner.optimizer.lr = 0.0
    config.mesh.learner_tp = 0
    with pytest.raises(ConfigError) as e:
        check_config(config)
    assert e.value.problems == [
        "config.driver: driver.mode='synk'; expected one of ('sync', 'cgp', 'async').",
        "config.learner: optimizer.lr must be > 0; received 0.0.",
        "config.mesh: mesh.learner_tp must be >= 1; received 0.",
    ]


def test_a_negative_flush_halvings_is_refused():
    config = smoke.get_config()
    config.learner.flush_halvings = -1
    with pytest.raises(ConfigError) as e:
        check_config(config)
    assert e.value.problems == [
        "config.learner: learner.flush_halvings must be an int >= 0; received -1."
    ]


def test_a_misspelled_field_names_the_closest_one():
    config = smoke.get_config()
    with config.unlocked():
        config.driver.mdoe = "sync"  # a config built in Python (a Colab cell) is not locked
        config.learner.optimizer.learning_rate = 1e-3  # nothing close: the fields are listed
    with pytest.raises(ConfigError) as e:
        check_config(config)
    assert e.value.problems == [
        "config.driver has no field 'mdoe'; did you mean config.driver.mode?",
        "config.learner.optimizer has no field 'learning_rate'; expected one of ['b1', 'b2', "
        "'end_lr_ratio', 'eps', 'grad_clip_norm', 'lr', 'schedule', 'total_steps', "
        "'warmup_steps', 'weight_decay'].",
    ]
    assert closest_field(smoke.get_config(), "drivr.mode") == (
        "config has no field 'drivr'; did you mean config.driver?"
    )
    assert closest_field(smoke.get_config(), "driver.mode") is None


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("rounds", -1, "config.rounds=-1; expected an integer >= 0"),
        ("checkpoint_every", -1, "config.checkpoint_every=-1; expected an integer >= 0"),
        ("driver.group_size", 16, "exceeds config.engine.max_slots=8"),
    ],
)
def test_train_stops_before_building_or_writing_anything(tmp_path, field, value, message):
    # Today's bugs: rounds=-1 and checkpoint_every=-1 ran to completion; group_size > max_slots
    # was found after the model was built and SFT had run, with the workdir created.
    from rl.run import train

    config = smoke.get_config()
    config.workdir = str(tmp_path / "run")
    section, _, name = field.rpartition(".")
    (config[section] if section else config)[name] = value
    with pytest.raises(ValueError, match=message):
        train(config, stdout=False)
    assert not (tmp_path / "run").exists()


def test_train_stops_on_prompts_that_do_not_fit_before_the_workdir_is_touched(tmp_path):
    from rl.run import train

    config = smoke.get_config()
    config.workdir = str(tmp_path / "run")
    config.engine.max_prefill_length = 4  # every addition prompt ("123+45=") is longer
    config.engine.max_length = 4 + config.sampling.max_new_tokens
    with pytest.raises(
        ValueError, match=r"prompts take up to \d+ tokens .* config.engine.max_prefill_length >="
    ):
        train(config, stdout=False)
    assert not (tmp_path / "run").exists()


def test_the_learner_temperature_points_to_the_sampling_one():
    config = smoke.get_config()
    with config.unlocked():
        config.learner.temperature = 0.7
    with pytest.raises(ConfigError) as e:
        check_config(config)
    assert e.value.problems == [
        "config.learner has no field 'temperature'; expected config.sampling.temperature (one "
        "temperature for sampling and the loss)."
    ]
    assert closest_field(smoke.get_config(), "learner.temperature") == e.value.problems[0]


def test_each_losss_options_come_from_the_command_line_and_typos_name_the_closest(tmp_path):
    import subprocess
    import sys

    from learner.config import learner_config_from

    config = smoke.get_config()
    config.learner.policy_loss = "gspo"
    config.learner.loss.gspo.clip_low = 0.01
    config.learner.loss.tis_reinforce.clip = 2.0
    check_config(config)
    cfg = learner_config_from(config.learner)
    assert cfg.loss.options("gspo").clip_low == 0.01 and cfg.loss.gspo.clip_high == 4e-4
    assert cfg.loss.tis_reinforce.clip == 2.0
    config.learner.loss.gspo.clip_lo = 0.1
    with pytest.raises(ConfigError) as e:
        check_config(config)
    assert "config.learner.loss.gspo has no field 'clip_lo'; did you mean " in e.value.problems[0]
    # The launcher's flags reach the same field (checked before anything is built).
    root = os.path.dirname(os.path.dirname(configs.__file__))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "launch.train",
            "--config=configs/smoke.py",
            f"--config.workdir={tmp_path}",
            "--config.learner.loss.gspo.clip_low=2.0",
        ],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0
    assert "learner.loss.gspo.clip_low must be in [0, 1); received 2.0" in proc.stderr


def test_overlong_penalty_must_fit_the_response_cap():
    config = smoke.get_config()  # max_new_tokens 8
    config.overlong.cache_tokens = 9
    with pytest.raises(ConfigError, match=r"config.overlong.cache_tokens=9 exceeds "):
        check_config(config)
    config.overlong.cache_tokens = 4
    config.overlong.factor = -1.0
    with pytest.raises(ConfigError, match=r"overlong.factor must be finite and >= 0"):
        check_config(config)
    config.overlong.factor = 1.0
    check_config(config)


def test_pass_k_and_export_fields_are_checked():
    config = smoke.get_config()
    config.eval.pass_k = 4
    config.eval.pass_n = 2
    config.export.dtype = "int8"
    with pytest.raises(ConfigError) as e:
        check_config(config)
    assert e.value.problems == [
        "config.eval.pass_n=2 is below config.eval.pass_k=4; expected n >= k samples per "
        "problem (or 0: n = k).",
        "config.export.dtype='int8'; expected one of ('float32', 'bfloat16', 'float16') or ''.",
    ]
    config.eval.pass_n = 8
    config.export.dtype = "float32"
    check_config(config)


def test_task_options_are_known_fields_and_a_typo_names_the_closest(monkeypatch):
    from rl.tasks.registry import TASKS, register_task

    monkeypatch.delitem(TASKS, "parity_cc", raising=False)
    register_task("parity_cc", options={"bits": 4})(lambda split, n, *, seed, bits: [])
    monkeypatch.setitem(TASKS, "parity_cc", TASKS.pop("parity_cc"))  # removed after the test
    config = smoke.get_config()
    with config.unlocked():
        config.task.bits = 6  # a registered task's option: a known field
        config.task.digitz = 2
    with pytest.raises(ConfigError) as e:
        check_config(config)
    assert e.value.problems == [
        "config.task has no field 'digitz'; did you mean config.task.digits?"
    ]


def test_replica_and_migration_fields_are_checked():
    config = smoke.get_config()
    config.elastic.migration = "sometimes"
    config.mesh.sampler_routing = "random"
    with pytest.raises(ConfigError) as e:
        check_config(config)
    assert e.value.problems == [
        "config.elastic: elastic.migration='sometimes'; expected one of ('off', 'tail', 'always').",
        "config.mesh: mesh.sampler_routing='random'; expected one of "
        "('round_robin', 'least_loaded').",
    ]
    config = smoke.get_config()
    config.mesh.sampler_replicas = 2
    config.elastic.migration = "tail"
    check_config(config)  # two replicas of one device each (colocated smoke) migrate: fine
    config.driver.tail.enabled = True
    check_config(config)  # and cut tail-batched rounds across the replicas (ReplicaSampler)


def test_elastic_borrowing_and_the_open_split_are_checked():
    config = smoke.get_config()  # colocated, no stage model
    config.elastic.borrowing = "learner"
    config.driver.mode = "async"
    config.mesh.split = "plan"
    config.runtime = "ray"
    with pytest.raises(ConfigError) as e:
        check_config(config)
    text = "\n".join(e.value.problems)
    for expected in (
        "config.elastic.borrowing='learner' with no config.elastic.stage_model",
        "config.elastic.borrowing='learner' with config.mesh.colocated=True",
        "config.mesh.split='plan' with no config.elastic.stage_model",
    ):
        assert expected in text, text
    config = smoke.get_config()  # the Ray learner worker lends its devices to the sampler
    config.runtime, config.mesh.colocated = "ray", False
    config.elastic.borrowing, config.elastic.stage_model = "sampler", "preset:qwen3-1.7b:h100"
    check_config(config)
    config = smoke.get_config()  # async: the sampler borrows (both runtimes), no environment
    config.mesh.colocated, config.driver.mode = False, "async"
    config.elastic.borrowing, config.elastic.stage_model = "sampler", "preset:qwen3-1.7b:h100"
    check_config(config)
    config.runtime = "ray"
    check_config(config)
    config.env.name = "retry"
    with pytest.raises(ConfigError) as e:
        check_config(config)
    text = "\n".join(e.value.problems)
    assert "config.env.name='retry'; expected no environment" in text
    config.elastic.borrowing = "learner"
    check_config(config)  # the learner borrows only a drained sampler: no episode is running
    config = smoke.get_config()
    config.elastic.borrowing = "sometimes"
    config.mesh.split = "open"
    with pytest.raises(ConfigError) as e:
        check_config(config)
    text = "\n".join(e.value.problems)
    assert "config.elastic.borrowing='sometimes'; expected one of ('off'" in text
    assert "mesh.split='open'; expected one of ('fixed', 'plan')" in text
