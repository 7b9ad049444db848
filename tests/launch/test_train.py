"""The launcher runs the smoke config end to end and fails clearly on a bad config."""

import subprocess
import sys

from configs import smoke
from rl.models.summary import summarize


def test_summarize_smoke_config():
    s = summarize(smoke.get_config(), new_tokens=4)
    assert s["params"] == 90_688 and s["family"] == "qwen3"
    assert s["prompt_tokens"] == len(smoke.get_config().prompt.encode()) + 1  # bytes + bos
    assert -20.0 < s["mean_logprob"] < 0.0
    assert isinstance(s["greedy_continuation"], str)


def test_launch_train_reports_bad_config_without_traceback(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "launch.train",
        "--config=configs/smoke.py",
        f"--config.model.hf_path={tmp_path / 'missing'}",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    assert "Traceback" not in out.stderr
    assert "missing' does not exist" in out.stderr
