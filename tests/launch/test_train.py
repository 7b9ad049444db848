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


def test_default_run_trains_pipelined_rounds_and_writes_its_files(tmp_path):
    import json

    from rl.run import train

    config = smoke.get_config()
    config.workdir = str(tmp_path)
    summary = train(config, stdout=False)
    assert summary["mode"] == "cgp+frontier+ordered" and len(summary["rounds"]) == config.rounds
    for r in summary["rounds"]:
        assert 0 < r["first_dispatch_s"] <= r["rollout_to_train_end_s"]
        assert r["updates"] == config.driver.groups_per_round // config.driver.groups_per_update
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(config.rounds))
    assert json.loads((tmp_path / "timeline.json").read_text())["traceEvents"]
    assert (tmp_path / "timeline.png").stat().st_size > 10_000
    assert list((tmp_path / "tb").iterdir())
