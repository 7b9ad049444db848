"""Checkpoints: exact resume in a fresh process, restore onto other meshes, clear errors.

Run as a script (`python test_checkpoint.py CKPT_DIR OUT.npz`), this file is the resumed process of
the exact-resume test: it restores CKPT_DIR, trains the remaining rounds and writes what it got.
"""

import json
import os
import pathlib
import subprocess
import sys
import threading

import grain
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from learner.checkpoint import CheckpointDamagedError, Checkpointer
from learner.config import LearnerConfig, OptimizerConfig
from learner.learner import Learner
from learner.mesh import MeshConfig, make_meshes
from learner.state import TrainState, make_optimizer, state_shardings
from rl.models import abstract_model, get_preset
from rl.types import Completion, Group, Request
from tests.host_arrays import assert_bitwise_equal, host_arrays

ROOT = pathlib.Path(__file__).resolve().parents[2]
CFG = LearnerConfig(optimizer=OptimizerConfig(lr=1e-3), micro_batch_rows=4)
ROUNDS, SAVED_ROUNDS, GROUPS, G = 4, 2, 2, 4  # rounds of one update of 2 groups of 4 samples
DATA_SEEN, DATA_NEXT = 7, 5  # grain elements consumed before the save, compared after it


def _mesh(devices: int, tp: int = 1) -> jax.sharding.Mesh:
    """A learner mesh of `devices` (fsdp x tp) beside a sampler mesh on the others."""
    cfg = MeshConfig(learner_devices=devices, learner_tp=tp, sampler_devices=8 - devices)
    return make_meshes(cfg)[0]


def _learner(mesh) -> Learner:
    """A Learner of the tiny model with seeded numpy weights (no init program to compile)."""
    graphdef, abstract = nnx.split(abstract_model(get_preset("tiny")))
    rng = np.random.default_rng(0)
    params = jax.tree.map(
        lambda x: np.ones(x.shape, x.dtype) if x.ndim == 1 else rng.normal(0, 0.05, x.shape),
        abstract,
    )
    return Learner(nnx.merge(graphdef, jax.tree.map(np.float32, params)), CFG, mesh=mesh)


def _groups(rnd: int) -> list[Group]:
    """Deterministic synthetic groups for one round: random tokens, log-probs and rewards."""
    rng = np.random.default_rng(rnd)
    out = []
    for uid in range(GROUPS):
        prompt = tuple(int(t) for t in rng.integers(1, 259, rng.integers(3, 9)))
        completions = []
        for s in range(G):
            n = int(rng.integers(2, 12))
            completions.append(
                Completion(
                    uid=uid,
                    round=rnd,
                    sample=s,
                    prompt=prompt,
                    tokens=tuple(int(t) for t in rng.integers(1, 259, n)),
                    logprobs=tuple(float(x) for x in -rng.exponential(2.0, n)),
                    versions=(rnd,) * n,
                    finish_reason="stop",
                    reward=float(rng.random()),
                )
            )
        request = Request(uid=uid, round=rnd, prompt=prompt, group_size=G)
        out.append(Group(request=request, completions=tuple(completions)))
    return out


def _train(learner: Learner, rounds: range) -> list[float]:
    """One update per round (the round's groups), as the driver runs it; returns the losses."""
    losses = []
    for rnd in rounds:
        learner.begin_round(1)
        learner.add_groups(_groups(rnd))
        losses.append(learner.update()["loss"])
    return losses


def _data_iter():
    return iter(grain.MapDataset.range(100).shuffle(seed=1).to_iter_dataset())


def _abstract(mesh, **model_overrides) -> tuple[TrainState, TrainState]:
    """(abstract TrainState, shardings) for the tiny model on `mesh`, built without any compile."""
    params = nnx.state(abstract_model(get_preset("tiny", **model_overrides)))
    tx = make_optimizer(CFG.optimizer)
    abstract = TrainState(
        params=params,
        opt_state=jax.eval_shape(tx.init, params),
        step=jax.ShapeDtypeStruct((), jnp.int32),
    )
    return abstract, state_shardings(params, tx, mesh)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Rounds 0-1 on fsdp=2 x tp=2, an async save of step 2 (host state in meta), then rounds 2-3.

    Training on right after `save` returns checks the async save against donation: the next update
    donates the very buffers the save started from. The losses and final state are the
    uninterrupted 4-update trajectory (saving changes nothing in it); `at_save` is what was saved.
    """
    directory = tmp_path_factory.mktemp("ckpt")
    learner = _learner(_mesh(4, tp=2))
    losses = _train(learner, range(SAVED_ROUNDS))
    it = _data_iter()
    seen = [int(next(it)) for _ in range(DATA_SEEN)]
    data_state = it.get_state()  # a dict of ints ({"next_index": 7}): JSON-safe as it is
    meta = {
        "round": SAVED_ROUNDS,
        "policy_version": SAVED_ROUNDS,
        "data": data_state,
        "long_prompts": [[5, 6, 7]],
    }
    at_save = host_arrays(learner.state)
    ckpt = Checkpointer(directory, async_save=True)
    ckpt.save(learner.step, learner.state, meta)
    losses += _train(learner, range(SAVED_ROUNDS, ROUNDS))
    ckpt.wait()
    ckpt.close()
    data = seen + [int(next(it)) for _ in range(DATA_NEXT)]
    final = host_arrays(learner.state)
    return dict(dir=directory, meta=meta, at_save=at_save, final=final, losses=losses, data=data)


@pytest.mark.slow  # ~16 s cold: a fresh process; launch.train's resume tests stay quick
def test_resume_in_fresh_process_continues_the_exact_trajectory(run, tmp_path):
    out = tmp_path / "resumed.npz"
    env = dict(
        os.environ,
        PYTHONPATH=str(ROOT),
        JAX_PLATFORMS="cpu",
    )
    cmd = [sys.executable, __file__, str(run["dir"]), str(out)]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with np.load(out) as f:
        resumed = dict(f)
    assert json.loads(str(resumed.pop("meta"))) == run["meta"]
    assert resumed.pop("losses").tolist() == run["losses"][SAVED_ROUNDS:]
    assert resumed.pop("data").tolist() == run["data"][DATA_SEEN:]
    assert_bitwise_equal(
        resumed, run["final"]
    )  # params, optimizer state, step and rng, bit for bit


def _resume_main(directory: str, out: str) -> None:
    """The resumed process: restore, train rounds 2-3, write state, losses, meta and next data."""
    jax.config.update("jax_numpy_rank_promotion", "raise")
    learner = _learner(_mesh(4, tp=2))
    ckpt = Checkpointer(directory)
    learner.state, meta = ckpt.restore(abstract_state=learner.state, shardings=learner.shardings)
    ckpt.close()
    losses = _train(learner, range(meta["round"], ROUNDS))
    it = _data_iter()
    it.set_state(meta["data"])
    data = [int(next(it)) for _ in range(DATA_NEXT)]
    np.savez(out, meta=json.dumps(meta), losses=losses, data=data, **host_arrays(learner.state))


@pytest.mark.parametrize("devices,tp", [(2, 1), (1, 1), (6, 3)])
def test_restore_onto_another_mesh_layout_gives_identical_values(run, devices, tp):
    abstract, shardings = _abstract(_mesh(devices, tp))
    state, meta = Checkpointer(run["dir"]).restore(abstract_state=abstract, shardings=shardings)
    assert meta == run["meta"]
    assert_bitwise_equal(host_arrays(state), run["at_save"])
    assert jax.tree.leaves(jax.tree.map(lambda x: x.sharding, state)) == jax.tree.leaves(shardings)


@pytest.mark.parametrize(
    "overrides,error",
    [
        (
            dict(mlp_dim=96),
            r"params/layers/0/mlp/down/value has shape \(128, 64\) in the checkpoint; "
            r"expected \(96, 64\)",
        ),
        (dict(n_layers=3), r"has no array params/layers/2/attn/k/value; expected one of shape"),
        (dict(n_layers=1), r"arrays the model does not have: \['params/layers/1/"),
    ],
)
def test_checkpoint_of_another_model_shape_names_parameter_and_shapes(run, overrides, error):
    abstract, shardings = _abstract(_mesh(2), **overrides)
    with pytest.raises(ValueError, match=error):
        Checkpointer(run["dir"]).restore(abstract_state=abstract, shardings=shardings)


def test_missing_checkpoint_errors_name_directory_and_available_steps(run, tmp_path):
    abstract, shardings = _abstract(_mesh(2))
    empty = Checkpointer(tmp_path / "empty")
    assert empty.latest_step() is None
    with pytest.raises(FileNotFoundError, match=f"No checkpoint found in {tmp_path / 'empty'}"):
        empty.restore(abstract_state=abstract, shardings=shardings)
    with pytest.raises(FileNotFoundError, match=r"step 7 in .*; available steps: \[2\]"):
        Checkpointer(run["dir"]).restore(7, abstract_state=abstract, shardings=shardings)


def _small_state(step: int) -> TrainState:
    return TrainState(
        params={"w": jnp.full((4, 2), float(step))},
        opt_state=(jnp.zeros(3),),
        step=jnp.asarray(step, jnp.int32),
    )


def test_async_saves_keep_max_to_keep_and_bad_saves_are_refused(tmp_path):
    ckpt = Checkpointer(tmp_path, max_to_keep=2, async_save=True)
    for step in range(1, 5):
        ckpt.save(step, _small_state(step), {"round": step})
    ckpt.wait()
    assert ckpt.all_steps() == [3, 4] and ckpt.latest_step() == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["3", "4"]
    abstract = jax.eval_shape(lambda: _small_state(0))
    shardings = jax.tree.map(
        lambda _: jax.sharding.SingleDeviceSharding(jax.devices()[0]), abstract
    )
    state, meta = ckpt.restore(3, abstract_state=abstract, shardings=shardings)
    assert meta == {"round": 3}
    assert_bitwise_equal(state, _small_state(3))
    with pytest.raises(ValueError, match="steps must increase.*holds step 4"):
        ckpt.save(4, _small_state(4), {})
    with pytest.raises(TypeError, match=r"JSON-serialisable.*\['queue'\]"):
        ckpt.save(5, _small_state(5), {"round": 5, "queue": b"bytes"})
    ckpt.close()
    with pytest.raises(RuntimeError, match="step 5 was not saved.*is closed"):
        ckpt.save(5, _small_state(5), {"round": 5})
    other = Checkpointer(tmp_path / "other")  # the refused save left orbax free for the others
    other.save(1, _small_state(1), {})
    other.close()


def test_checkpointers_of_pipelines_in_threads_save_at_once_and_each_restores_its_own(tmp_path):
    # Pipelines multiplexed in threads (rl/runtime/pool.py) each save to their own directory;
    # orbax keys its operations on one process-wide counter, and two saves at once wrote into
    # each other's temporary directories (a sweep failed with "Directory not empty").
    pipelines, steps = 3, 4
    errors = []

    def run(p):
        try:
            ckpt = Checkpointer(tmp_path / str(p), max_to_keep=2)
            for step in range(1, steps + 1):
                ckpt.save(step, _small_state(10 * p + step), {"pipeline": p, "step": step})
            ckpt.close()
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=run, args=(p,)) for p in range(pipelines)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    abstract = jax.eval_shape(lambda: _small_state(0))
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shardings = jax.tree.map(lambda _: one, abstract)
    for p in range(pipelines):
        ckpt = Checkpointer(tmp_path / str(p))
        state, meta = ckpt.restore(abstract_state=abstract, shardings=shardings)
        assert ckpt.all_steps() == [steps - 1, steps] and not ckpt.damaged
        assert meta == {"pipeline": p, "step": steps}
        assert_bitwise_equal(state, _small_state(10 * p + steps))
        ckpt.close()


def test_a_state_holding_prng_keys_restores_them_as_keys(tmp_path):
    # TrainState holds no key, but a user's state may (e.g. dropout): typed keys are saved as
    # their key data and re-wrapped with their implementation on restore.
    state = {"w": jnp.arange(4.0), "key": jax.random.key(7, impl="rbg"), "k2": jax.random.key(8)}
    ckpt = Checkpointer(tmp_path)
    ckpt.save(1, state, {})
    ckpt.wait()
    abstract = jax.eval_shape(lambda: state)
    shardings = jax.tree.map(
        lambda _: jax.sharding.SingleDeviceSharding(jax.devices()[0]), abstract
    )
    got, _ = ckpt.restore(1, abstract_state=abstract, shardings=shardings)
    ckpt.close()
    assert str(jax.random.key_impl(got["key"])) == str(jax.random.key_impl(state["key"]))
    assert got["k2"].dtype == state["k2"].dtype
    assert_bitwise_equal(host_arrays(got), host_arrays(state))
    assert jax.random.uniform(got["k2"]) == jax.random.uniform(state["k2"])


def _data_files(step_dir: pathlib.Path) -> list[pathlib.Path]:
    """The step's array data files (orbax ocdbt chunks), largest first."""
    files = [p for p in (step_dir / "state").rglob("*") if p.is_file() and p.parent.name == "d"]
    return sorted(files, key=lambda p: -p.stat().st_size)


def _truncate(step_dir):
    f = _data_files(step_dir)[0]
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    return f"{f.relative_to(step_dir)} has {f.stat().st_size} bytes; expected"


def _empty(step_dir):
    f = _data_files(step_dir)[0]
    f.write_bytes(b"")
    return f"{f.relative_to(step_dir)} has 0 bytes; expected"


def _flip_bit(step_dir):
    f = _data_files(step_dir)[0]
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x10
    f.write_bytes(bytes(data))
    return f"{f.relative_to(step_dir)} does not match its checksum"


def _truncate_meta(step_dir):
    f = step_dir / "meta" / "metadata"
    f.write_text(f.read_text()[:3])
    return "meta/metadata has 3 bytes; expected"


def _remove_state(step_dir):
    import shutil

    shutil.rmtree(step_dir / "state")
    return "state/"  # the first file of state/ in the manifest is named missing


DAMAGE = {
    "data_file_truncated": _truncate,
    "data_file_emptied": _empty,
    "bit_flipped": _flip_bit,
    "meta_truncated": _truncate_meta,
    "state_dir_removed": _remove_state,
}


def _saved_steps(directory, steps=(1, 2, 3)) -> None:
    ckpt = Checkpointer(directory, max_to_keep=3, async_save=True)
    for step in steps:
        ckpt.save(step, _small_state(step), {"round": step})
    ckpt.close()


def _small_abstract():
    abstract = jax.eval_shape(lambda: _small_state(0))
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return abstract, jax.tree.map(lambda _: device, abstract)


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_damaged_newest_step_falls_back_to_the_newest_intact_one(tmp_path, kind, monkeypatch):
    from learner import checkpoint

    _saved_steps(tmp_path)
    named = DAMAGE[kind](tmp_path / "3")
    warnings = []
    monkeypatch.setattr(checkpoint.logging, "warning", lambda *a: warnings.append(a[0] % a[1:]))
    abstract, shardings = _small_abstract()
    ckpt = Checkpointer(tmp_path, max_to_keep=3)
    state, meta = ckpt.restore(abstract_state=abstract, shardings=shardings)
    assert meta == {"round": 2}
    assert_bitwise_equal(host_arrays(state), host_arrays(_small_state(2)))
    [(step, problem)] = ckpt.damaged
    assert step == 3 and named in problem
    [line] = warnings  # one line naming the step and the file
    assert f"Checkpoint step 3 in {tmp_path} is damaged: {problem}" in line and "\n" not in line
    assert (tmp_path / "damaged" / "3").is_dir() and not (tmp_path / "3").exists()
    ckpt.save(3, _small_state(3), {"round": 3})  # the run goes on from step 2
    ckpt.close()
    assert Checkpointer(tmp_path).verify(3) is None


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_damaged_newest_step_with_strict_resume_stops_naming_step_and_file(tmp_path, kind):
    _saved_steps(tmp_path)
    named = DAMAGE[kind](tmp_path / "3")
    abstract, shardings = _small_abstract()
    with pytest.raises(CheckpointDamagedError, match="Checkpoint step 3 in .* is damaged: ") as e:
        Checkpointer(tmp_path).restore(abstract_state=abstract, shardings=shardings, strict=True)
    assert named in str(e.value) and "\n" not in str(e.value)
    assert (tmp_path / "3").is_dir()  # strict: nothing is moved


def test_empty_step_directory_left_by_a_crash_is_skipped(tmp_path):
    _saved_steps(tmp_path, steps=(1, 2))
    (tmp_path / "3").mkdir()  # what a crash during a save can leave
    abstract, shardings = _small_abstract()
    ckpt = Checkpointer(tmp_path)
    state, meta = ckpt.restore(abstract_state=abstract, shardings=shardings)
    assert meta == {"round": 2}
    assert ckpt.damaged == [(3, "checksums.json is missing (its save did not finish)")]
    ckpt.close()


def test_every_step_damaged_or_an_explicit_damaged_step_is_an_error(tmp_path):
    _saved_steps(tmp_path, steps=(1, 2))
    _flip_bit(tmp_path / "2")
    abstract, shardings = _small_abstract()
    with pytest.raises(CheckpointDamagedError, match=r"Checkpoint step 2 in .* is damaged: state/"):
        Checkpointer(tmp_path).restore(2, abstract_state=abstract, shardings=shardings)
    _truncate_meta(tmp_path / "1")
    with pytest.raises(
        CheckpointDamagedError, match=r"No intact checkpoint in .*step 2: .*step 1: meta/"
    ):
        Checkpointer(tmp_path).restore(abstract_state=abstract, shardings=shardings)


def test_a_state_with_nan_is_never_saved(tmp_path):
    bad = TrainState(
        params={"w": jnp.full((4, 2), jnp.inf)},
        opt_state=(jnp.zeros(3),),
        step=jnp.asarray(1, jnp.int32),
    )
    ckpt = Checkpointer(tmp_path)
    with pytest.raises(FloatingPointError, match=r"step 1 was not saved: params/w holds NaN/inf"):
        ckpt.save(1, bad, {})
    ckpt.close()
    assert not (tmp_path / "1").exists()


def _killed_main(directory: str, seed: str) -> None:
    """The killed process: a save after each round; SIGKILL at a seeded point of one save.

    The save of step 2 (save + wait) is timed; the save of step `kill_at` (3 or 4) arms a timer of
    a seeded fraction (0 to 1.2) of that time and the process waits, so the kill lands while
    orbax writes, before or while the checksums are written, or just after the save.
    """
    import random
    import signal
    import threading
    import time

    rng = random.Random(int(seed))
    kill_at, fraction = rng.randint(3, ROUNDS), rng.uniform(0.0, 1.2)
    learner = _learner(_mesh(4, tp=2))
    ckpt = Checkpointer(directory)
    took = 0.0
    for rnd in range(kill_at):
        _train(learner, range(rnd, rnd + 1))
        t = time.perf_counter()
        if rnd + 1 == kill_at:
            threading.Timer(fraction * took, os.kill, (os.getpid(), signal.SIGKILL)).start()
        ckpt.save(rnd + 1, learner.state, {"round": rnd + 1})
        ckpt.wait()
        took = time.perf_counter() - t
    time.sleep(60)  # the timer kills the process


# On a 2-core CPU these seeds left: step 4 as orbax's temporary directory (0); every step intact
# (3); step 4 finished by orbax but without checksums (7); that, and step 1 half deleted by
# max_to_keep (11). Elsewhere the kills land elsewhere: the invariant holds for any point.
@pytest.mark.parametrize("seed", [0, 3, 7, 11])
def test_save_killed_at_a_random_point_resumes_from_an_intact_step_to_the_same_params(
    run, tmp_path, seed
):
    env = dict(
        os.environ,
        PYTHONPATH=str(ROOT),
        JAX_PLATFORMS="cpu",
    )
    directory = tmp_path / "ckpt"
    cmd = [sys.executable, __file__, "kill", str(directory), str(seed)]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr[-3000:]  # killed, not finished
    learner = _learner(_mesh(4, tp=2))
    ckpt = Checkpointer(directory)
    learner.state, meta = ckpt.restore(abstract_state=learner.state, shardings=learner.shardings)
    step = meta["round"]
    assert ckpt.verify(step) is None and ckpt.all_steps()[-1] == step  # newer damaged: moved
    _train(learner, range(step, ROUNDS))
    ckpt.close()
    assert_bitwise_equal(
        host_arrays(learner.state), run["final"]
    )  # as if never interrupted, bit for bit


if __name__ == "__main__":
    if sys.argv[1] == "kill":
        _killed_main(*sys.argv[2:])
    else:
        _resume_main(*sys.argv[1:])
