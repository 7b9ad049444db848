"""The launcher runs the smoke config end to end and fails clearly on a bad config."""

import subprocess
import sys

import pytest

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
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines if x["prefix"] == "train"] == list(range(config.rounds))
    assert [x["step"] for x in lines if x["prefix"] == "sft"] == [10, 20]
    saved = json.loads((tmp_path / "summary.json").read_text())
    for key in ("heldout_acc_before", "heldout_acc_after"):
        assert 0.0 <= saved[key] <= 1.0
    assert saved["wall_s"] >= saved["sft_s"] + saved["rl_s"] > 0
    assert json.loads((tmp_path / "timeline.json").read_text())["traceEvents"]
    assert (tmp_path / "timeline.png").stat().st_size > 10_000
    assert list((tmp_path / "tb").iterdir())


@pytest.mark.parametrize("tail", [False, True], ids=["plain", "tail"])
def test_resumed_run_continues_the_exact_trajectory(tmp_path, monkeypatch, tail):
    import jax
    import numpy as np

    from rl.rewards import REWARDS, register_reward
    from rl.run import train

    # An untrained model never gets an addition right: a registered reward with variance instead,
    # so the updates move the parameters.
    monkeypatch.delitem(REWARDS, "test_parity", raising=False)
    register_reward("test_parity")(lambda request, text: float(len(text) % 2))

    def config(workdir, rounds):
        c = smoke.get_config()
        c.workdir, c.rounds, c.checkpoint_every, c.resume = str(workdir), rounds, 1, True
        c.task.reward = "test_parity"
        # eta 2: round 0 trains 4 of 8 prompts, the other 4 make round 1 a long round, which a
        # resumed run must plan from the checkpointed long-prompt queue
        c.driver.tail.enabled, c.driver.tail.eta = tail, 2.0
        return c

    straight = train(config(tmp_path / "straight", 2), stdout=False)
    first = train(config(tmp_path / "resumed", 1), stdout=False)
    assert first["first_round"] == 0 and len(first["rounds"]) == 1
    second = train(config(tmp_path / "resumed", 2), stdout=False)
    assert second["first_round"] == 1 and len(second["rounds"]) == 1
    for a, b in zip(
        jax.tree.leaves(straight["state"]), jax.tree.leaves(second["state"]), strict=True
    ):
        if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert straight["rounds"][1]["reward_mean"] == second["rounds"][0]["reward_mean"]
    assert straight["rounds"][1]["grad_norm"] > 0  # the parameters did move
    kinds = [r["long_round"] for r in straight["rounds"]]
    assert kinds == ([0.0, 1.0] if tail else [0.0, 0.0])
    assert second["rounds"][0]["long_round"] == kinds[1]
