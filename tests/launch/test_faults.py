"""Faults from outside: `launch.train` (and `launch.sweep`) killed with SIGKILL at random instants,
or sent SIGTERM.

Each case runs the launcher in a subprocess, as a user would: once uninterrupted, then killed at
instants drawn from a seeded generator and rerun with the same command until it finishes. The
rerun needs no hand (whatever instant the kill hit: startup, SFT, a round, a save, a publish),
ends with the uninterrupted run's parameters (the exact modes) or with as many updates, each
round training all its groups (async_resume=no_bubble, which re-samples the prompts in flight at
a checkpoint: tests/rl/test_driver.py checks there that each is trained once), and has one
metrics row per round.
"""

import json
import os
import random
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ROUNDS = 4
SEEDS = [0, 1]  # of the kill instants: two kills each, then a rerun to the end
# The smoke model after its SFT warm start, on the per-digit reward: some rounds have reward
# variance, so the updates move the parameters and a wrong resume shows.
COMMON = [
    "--config=configs/smoke.py",
    f"--config.rounds={ROUNDS}",
    "--config.checkpoint_every=1",
    "--config.resume=True",
    "--config.eval.every_rounds=0",
    "--config.task.reward=digits",
]
MODES = {
    "cgp": [],
    "async": ["--config.driver.mode=async", "--config.driver.max_staleness=1"],
    "async_no_bubble": [
        "--config.driver.mode=async",
        "--config.driver.max_staleness=1",
        "--config.async_resume=no_bubble",
    ],
    "2_replicas_migration": [
        "--config.mesh.sampler_replicas=2",
        "--config.elastic.migration=always",
    ],
}


# launch.sweep: two pipelines (seeds) multiplexed on two sampler replicas, each its own workdir
SWEEP = ["--sweep.values=seed=0,1", "--config.mesh.sampler_replicas=2"]
PIPELINES = ["seed=0", "seed=1"]


def _start(workdir, flags, program: str = "launch.train") -> subprocess.Popen:
    cmd = [sys.executable, "-m", program, *COMMON, *flags, f"--config.workdir={workdir}"]
    return subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _finish(proc: subprocess.Popen, timeout: float = 600) -> str:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-3000:]
    return out


def _state(workdir) -> dict:
    return ocp.StandardCheckpointer().restore(os.path.join(workdir, "ckpt", str(ROUNDS), "state"))


def _params(workdir) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(_state(workdir))]


def _train_rows(workdir) -> list[dict]:
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["prefix"] == "train"]


def _straight(workdir, flags) -> tuple[list[np.ndarray], float]:
    seconds = _timed(workdir, flags)
    assert any(r["grad_norm"] > 0 for r in _train_rows(workdir))  # the parameters moved
    return _params(workdir), seconds


def _timed(workdir, flags, program: str = "launch.train") -> float:
    """Seconds an uninterrupted run takes."""
    t = time.monotonic()
    _finish(_start(workdir, flags, program))
    return time.monotonic() - t


def _killed_and_rerun(
    workdir, flags, seconds: float, seed: int, kills: int = 2, program: str = "launch.train"
) -> int:
    """Runs with SIGKILL at `kills` random instants within the uninterrupted run's `seconds`,
    then reruns until the run finishes. Returns how many kills hit a running process."""
    rng, hit = random.Random(seed), 0
    for _ in range(kills):
        proc = _start(workdir, flags, program)
        try:
            proc.wait(timeout=rng.uniform(0.05, 0.8) * seconds)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGKILL)
            hit += 1
        proc.communicate()
    _finish(_start(workdir, flags, program))
    return hit


def _assert_resumed_exactly(workdir, straight: list[np.ndarray]) -> None:
    for a, b in zip(straight, _params(workdir), strict=True):
        np.testing.assert_array_equal(a, b)
    assert [r["step"] for r in _train_rows(workdir)] == list(range(ROUNDS))


def _assert_resumed_once(workdir, straight_dir) -> None:
    """Not bitwise: the same number of updates, every round trained whole, one row each."""
    assert int(_state(workdir)["step"]) == int(_state(straight_dir)["step"])
    rows, straight = _train_rows(workdir), _train_rows(straight_dir)
    assert [r["step"] for r in rows] == list(range(ROUNDS))
    assert [r["groups_trained"] for r in rows] == [r["groups_trained"] for r in straight]


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
def test_kill_at_random_instants_then_a_plain_rerun_ends_as_the_uninterrupted_run(tmp_path, mode):
    straight, seconds = _straight(tmp_path / "straight", MODES[mode])
    if mode == "async_no_bubble":  # its checkpoints were taken with prompts in flight
        metas = (tmp_path / "straight" / "ckpt").glob("*/meta/metadata")
        assert any(json.loads(p.read_text())["in_flight"] for p in metas)
    hits = 0
    for seed in SEEDS:
        workdir = tmp_path / f"killed{seed}"
        hits += _killed_and_rerun(workdir, MODES[mode], seconds, seed)
        if mode == "async_no_bubble":
            _assert_resumed_once(workdir, tmp_path / "straight")
        else:
            _assert_resumed_exactly(workdir, straight)
    assert hits >= 1  # at least one kill landed in a running process


@pytest.mark.slow
def test_kill_at_random_instants_under_ray(ray_cluster, tmp_path):
    flags = [
        "--config.runtime=ray",
        f"--config.ray.address={ray_cluster.get_runtime_context().gcs_address}",
    ]
    straight, seconds = _straight(tmp_path / "straight", flags)
    hits = 0
    for seed in SEEDS:
        hits += _killed_and_rerun(tmp_path / f"killed{seed}", flags, seconds, seed)
        _assert_resumed_exactly(tmp_path / f"killed{seed}", straight)
    assert hits >= 1


@pytest.mark.slow
def test_a_killed_sweep_continues_every_pipeline_on_a_plain_rerun(tmp_path):
    """Killed anywhere (start-up, one pipeline's save while the other samples on its replicas),
    a rerun of the same launch.sweep command ends each pipeline as its uninterrupted run."""
    seconds = _timed(tmp_path / "straight", SWEEP, "launch.sweep")
    hits = _killed_and_rerun(tmp_path / "killed", SWEEP, seconds, seed=0, program="launch.sweep")
    for name in PIPELINES:
        straight = tmp_path / "straight" / name
        assert any(r["grad_norm"] > 0 for r in _train_rows(straight))  # the parameters moved
        _assert_resumed_exactly(tmp_path / "killed" / name, _params(straight))
    assert hits >= 1


@pytest.mark.slow
def test_sigterm_saves_at_the_next_round_and_exits_0_then_a_rerun_continues(tmp_path):
    straight, _ = _straight(tmp_path / "straight", [])
    workdir = tmp_path / "preempted"
    proc = _start(workdir, [])
    deadline = time.monotonic() + 600
    while not (workdir / "metrics.jsonl").is_file() or not _train_rows(workdir):
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)  # during round 1 (or at its start)
    out = _finish(proc, timeout=120)  # the rest of one round and a save (the bound: not hung)
    assert "stopped by SIGTERM after round" in out
    stopped = int(out.split("stopped by SIGTERM after round ")[1].split()[0]) + 1
    assert stopped < ROUNDS
    assert max(int(p.name) for p in (workdir / "ckpt").iterdir() if p.name.isdigit()) == stopped
    assert not (workdir / "summary.json").exists()
    _finish(_start(workdir, []))
    _assert_resumed_exactly(workdir, straight)
