"""launch.profile on a tiny engine and learner: it runs to the end, compiles nothing while measuring,
and writes a fitted stage model that launch.simulate can load."""

import json
import math
import os
import subprocess
import sys

import pytest

from rl.elastic.stage import StageModel

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The smallest workload the profile's learner batches fit: responses up to 48 (its batches have
# 40-token responses), 16 slots of groups of 4.
FLAGS = [
    "--slots=16",
    "--group_size=4",
    "--groups_per_update=2",
    "--steps_per_call=2",
    "--max_new_tokens=48",
    "--prompt_max=8",
    "--repeats=1",
]


@pytest.mark.slow  # 1-2 minutes on 2 shared cores: its compile pass covers every shape
def test_profile_writes_a_loadable_fit_and_compiles_nothing_while_measuring(tmp_path):
    out = tmp_path / "profile.json"
    cmd = [sys.executable, "-m", "launch.profile", f"--json={out}", *FLAGS]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "compiles timed: 0" in proc.stdout

    saved = json.loads(out.read_text())
    assert set(saved) == {"model", "fit", "config"}
    assert saved["config"]["slots"] == 16 and saved["config"]["steps_per_call"] == 2
    fit = saved["fit"]
    assert fit["compiles_timed"] == 0 and fit["compiles"]["compiled_while_timed"] == {}
    for stage in ("decode", "prefill", "micro_step", "publish"):
        assert fit[stage]["n"] > 0, stage
        assert all(math.isfinite(v) and v >= 0 for v in fit[stage]["coef"].values()), stage
    spread = fit["update_s_spread"]
    assert spread["n"] == 5 and 0 < spread["min"] <= spread["median"] <= spread["max"]
    assert fit["memory_maps"] > 0

    model = StageModel.load(out)  # what `launch.simulate --profile` reads
    assert model.to_dict() == saved["model"]
    assert model.update_s > 0 and 0 <= model.contention
