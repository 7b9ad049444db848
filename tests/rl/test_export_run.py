"""launch.export: any checkpoint of a run as a Hugging Face directory that transformers loads, its
logits equal to the checkpoint's params (float32); bad input is one line naming what was wrong."""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch  # in setup.py's [test] extras: if missing or broken, fail (never skip)
import transformers  # in setup.py's [test] extras: if missing or broken, fail (never skip)
from flax import nnx

from configs import smoke
from learner.checkpoint import Checkpointer
from learner.mesh import MeshConfig, make_meshes
from rl.export_run import RUN_CONFIG, export_checkpoint, load_run_config, save_run_config
from rl.runtime.compose import Setup, build_checked_model, build_learner

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOL = 1e-4  # max abs logit difference, float32


def _export(*args):
    return subprocess.run(
        [sys.executable, "-m", "launch.export", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"},
    )


def _saved_run(workdir, steps=(1, 2), lora_rank=0):
    """A run's workdir with checkpoints `steps` of distinct params, none of them the fresh init;
    returns {step: model with those params}. With `lora_rank`, the params are LoRA adapters (their
    B factors moved off zero) over the seed's base."""
    config = smoke.get_config()
    config.workdir = str(workdir)
    config.model.lora.rank = lora_rank
    setup = Setup.from_config(config)
    mesh, _ = make_meshes(MeshConfig(colocated=True), jax.devices()[:1])
    learner = build_learner(
        config, setup, build_checked_model(config, setup, mesh), mesh, total_updates=4
    )
    os.makedirs(workdir, exist_ok=True)
    save_run_config(config, str(workdir))
    ckpt = Checkpointer(os.path.join(workdir, "ckpt"))
    models = {}
    for step in steps:
        params = jax.tree.map(
            lambda x, s=step: x * (1.0 + 0.1 * s) + 0.01 * s, learner.state.params
        )
        learner.state = dataclasses.replace(learner.state, params=params)
        ckpt.save(step, learner.state, {"round": step, "version": 2 * step})
        model = nnx.merge(learner.graphdef, jax.tree.map(np.asarray, learner.params))
        models[step] = model
    ckpt.close()
    return models


def _logits(model, path):
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, model.config.vocab_size, size=(2, 9))
    positions = np.broadcast_to(np.arange(9), (2, 9)).copy()
    mask = np.ones((2, 9), np.int64)
    with torch.no_grad():
        ref = hf(
            input_ids=torch.tensor(tokens),
            attention_mask=torch.tensor(mask),
            position_ids=torch.tensor(positions),
        ).logits.numpy()
    ours = np.asarray(model(jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(mask)))
    return ref, ours


@pytest.mark.slow  # a CLI and a library export, three transformers loads (~22 s cold)
def test_export_writes_any_checkpoint_that_transformers_loads_with_equal_logits(tmp_path):
    models = _saved_run(tmp_path / "run")
    done = _export(f"--workdir={tmp_path / 'run'}", "--step=1")
    assert done.returncode == 0, done.stderr[-2000:]
    out = tmp_path / "run" / "hf-step1"
    assert (
        f"exported checkpoint 1 (weights version 2) of {tmp_path / 'run'} to {out}" in done.stdout
    )
    ref, ours = _logits(models[1], out)
    np.testing.assert_allclose(ref, ours, atol=TOL, rtol=0)
    # In the library: the newest checkpoint by default, its logits step 2's, not step 1's.
    done = export_checkpoint(str(tmp_path / "run"), str(tmp_path / "newest"))
    assert done == {"step": 2, "out": str(tmp_path / "newest"), "version": 4}
    ref, ours = _logits(models[2], tmp_path / "newest")
    np.testing.assert_allclose(ref, ours, atol=TOL, rtol=0)
    assert np.abs(_logits(models[1], tmp_path / "newest")[1] - ref).max() > 100 * TOL
    with pytest.raises(FileNotFoundError, match=r"holds no checkpoint 7; expected one of \[1, 2\]"):
        export_checkpoint(str(tmp_path / "run"), step=7)


@pytest.mark.slow  # one transformers load (~10 s cold)
def test_a_lora_runs_checkpoint_exports_merged_into_its_base(tmp_path):
    models = _saved_run(tmp_path / "run", steps=(1,), lora_rank=4)
    assert models[1].config.lora is not None
    done = export_checkpoint(str(tmp_path / "run"), str(tmp_path / "hf"))
    assert done["step"] == 1
    hf = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert not any("lora" in key for key in hf)
    ref, ours = _logits(models[1], tmp_path / "hf")  # ours: base + adapters, unmerged
    np.testing.assert_allclose(ref, ours, atol=TOL, rtol=0)


def test_export_errors_are_one_line_naming_what_was_wrong(tmp_path):
    done = _export(f"--workdir={tmp_path / 'none'}")
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == (
        f"launch.export: --workdir='{tmp_path / 'none'}' is not a directory; expected a run's. "
        "[FileNotFoundError]"
    )
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="holds no run config; expected the workdir of a"):
        export_checkpoint(str(tmp_path / "empty"))
    # With the config given instead: the missing checkpoint is named.
    with pytest.raises(FileNotFoundError, match="holds no checkpoint; expected a run trained"):
        export_checkpoint(str(tmp_path / "empty"), config=smoke.get_config())


def test_the_run_config_round_trips(tmp_path):
    config = smoke.get_config()
    save_run_config(config, str(tmp_path))
    loaded = load_run_config(str(tmp_path))
    assert loaded.to_dict() == json.loads(config.to_json_best_effort())
    assert Setup.from_config(loaded).rules == Setup.from_config(config).rules
    (tmp_path / RUN_CONFIG).write_text("[1, 2]")
    with pytest.raises(ValueError, match="holds a list; expected a JSON object"):
        load_run_config(str(tmp_path))
