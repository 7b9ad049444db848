"""launch.sweep end to end: two pipelines on one pool, one of them failing alone."""

import json
import os
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_sweep_runs_each_pipeline_and_a_failing_one_stops_alone(tmp_path):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=3")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "launch.sweep",
            "--config=configs/default.py:smoke",
            "--sweep.values=sft.lr=1e-3,1e30",  # 1e30: a NaN SFT loss
            "--config.mesh.sampler_replicas=3",
            f"--config.workdir={tmp_path}",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert out.returncode == 1, out.stderr
    good, bad = "sft.lr=0.001", "sft.lr=1e+30"
    assert f"[{good}] round 2/2: reward" in out.stdout
    lines = out.stdout.splitlines()
    table = lines[next(i for i, x in enumerate(lines) if x.split()[:2] == ["pipeline", "status"]) :]
    assert table[1].startswith(good) and " done " in table[1]
    assert table[2].startswith(bad) and "failed: FloatingPointError" in table[2]
    assert f"launch.sweep: pipeline {bad} failed: FloatingPointError" in out.stderr
    assert "Traceback" not in out.stderr
    summary = json.loads((tmp_path / good / "summary.json").read_text())
    assert summary["heldout_acc_after"] >= 0 and summary["rl_s"] > 0
    assert not (tmp_path / bad / "summary.json").exists()
    assert f"pipeline {bad} stopped" in (tmp_path / "sweep.log").read_text()
