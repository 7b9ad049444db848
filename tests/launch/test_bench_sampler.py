"""launch.bench_sampler runs on CPU; its static-batching baseline refills only an empty loop.

The baseline lives in the benchmark (its flags clash with other launch modules' in one process,
so it runs as a program here).
"""

import json
import os
import subprocess
import sys

import pytest


@pytest.mark.slow  # ~18 s cold: the benchmark's baseline loop, not product code
def test_static_baseline_runs_each_full_batch_for_its_longest_group(tmp_path):
    out = tmp_path / "bench.json"
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
    )
    # 6 groups of 2 in 4 slots: static batching admits 2 groups whenever every slot is free.
    flags = "--groups=6 --group_size=2 --slots=4 --max_new_tokens=12 --short_tokens=4"
    flags += " --prompt_max=12 --steps_per_call=2 --repeats=1 --modes=loop"
    cmd = [sys.executable, "-m", "launch.bench_sampler", *flags.split(), f"--json={out}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    # Each batch of slots // G groups (FCFS) runs for its longest group, in whole generate calls:
    # the benchmark's own count of that equals the static loop's, so no slot was refilled early.
    assert result["static_occupancy"] == result["static_occupancy_full_batches"]
    assert result["continuous_vs_static_calls"] >= 1.0
    assert result["groups_with_different_outputs"] == 0
    assert result["new_compiles_while_timed"] == 0
