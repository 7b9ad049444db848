"""A reward function that raises, or one that sleeps past the timeout, does not stop a run.

Both are registered by name through the public registry; every such call scores 0 and is counted
in the run's per-round metrics (metrics.jsonl) and in summary.json.
"""

import json
import time

import pytest

from configs import smoke
from rl.rewards import REWARDS, register_reward
from rl.run import train


def _raises(request, text):
    raise RuntimeError(f"broken verifier on uid={request.uid}")


def _sleeps(request, text):
    time.sleep(0.3)
    return 1.0


@pytest.mark.slow  # a launch.train run each (~30 s cold); RewardRunner's own tests stay quick
@pytest.mark.parametrize(
    ("name", "fn", "counter"),
    [("test_raises", _raises, "reward_errors"), ("test_sleeps", _sleeps, "reward_timeouts")],
)
def test_faulty_reward_is_counted_and_the_run_completes(name, fn, counter, tmp_path, monkeypatch):
    monkeypatch.delitem(REWARDS, name, raising=False)
    register_reward(name)(fn)
    config = smoke.get_config()
    config.workdir = str(tmp_path)
    config.sft.max_steps = 0
    config.task.reward = name
    config.task.reward_timeout_s = 0.05

    summary = train(config, stdout=False)

    assert len(summary["rounds"]) == config.rounds
    samples = config.driver.groups_per_round * config.driver.group_size
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rounds = [x for x in lines if x["prefix"] == "train"]
    assert [x[counter] for x in rounds] == [samples] * config.rounds  # every call, every round
    other = ({"reward_errors", "reward_timeouts"} - {counter}).pop()
    assert [x[other] for x in rounds] == [0] * config.rounds
    assert all(x["reward_mean"] == 0.0 for x in rounds)  # each failed call scored 0
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved[counter] == samples * config.rounds and saved[other] == 0
    assert saved["reward_stats"]["rollout"]["calls"] == samples * config.rounds
    assert saved["reward_stats"]["eval"][counter.removeprefix("reward_")] > 0  # eval: its own


def test_bench_rewards_prints_its_table_and_hostile_answers_cost_no_timeout():
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    # A timeout far above any call's cost (the bench's 2 s default is one a loaded machine can
    # reach with 4 calls sharing the GIL): no timeout then means that no answer hangs a worker.
    cmd = [
        sys.executable, "-m", "launch.bench_rewards", "--calls=32", "--backends=thread",
        "--timeout_s=30", "--repeats=1",
    ]  # fmt: skip
    out = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line.split() for line in out.stdout.splitlines() if line.startswith("thread")]
    assert [row[1] for row in rows] == ["0%", "10%", "50%"]
    for row in rows:
        assert row[5:] == ["0", "0", "as", "expected"]  # no timeout, nothing stuck, right scores
    assert "compiles timed: 0" in out.stdout
