"""The launcher runs the smoke config end to end and fails clearly on a bad config."""

import subprocess
import sys

import pytest

from configs import smoke
from rl.models.summary import summarize
from tests.host_arrays import assert_bitwise_equal


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
    # The compile budget: every learner program compiled at start, none in the rounds.
    train_rows = [x for x in lines if x["prefix"] == "train"]
    assert all(x["compiles_after_start"] == 0 for x in train_rows)
    saved = json.loads((tmp_path / "summary.json").read_text())
    learner_programs = {k: v for k, v in saved["compiles"].items() if k.startswith("learner.")}
    assert learner_programs["learner.accumulate"]["programs"] >= 1
    assert all(v["after_start"] == 0 for v in learner_programs.values()), learner_programs
    for key in ("heldout_acc_before", "heldout_acc_after"):
        assert 0.0 <= saved[key] <= 1.0
    assert saved["wall_s"] >= saved["sft_s"] + saved["rl_s"] > 0
    assert json.loads((tmp_path / "timeline.json").read_text())["traceEvents"]
    assert (tmp_path / "timeline.png").stat().st_size > 10_000
    assert list((tmp_path / "tb").iterdir())
    import matplotlib.image

    assert summary["learning_curve"] == str(tmp_path / "learning_curve.png")
    assert matplotlib.image.imread(summary["learning_curve"]).shape == (450, 1200, 4)


@pytest.mark.parametrize(
    "tail", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["plain", "tail"]
)
def test_resumed_run_continues_the_exact_trajectory(tmp_path, monkeypatch, tail):

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
    assert_bitwise_equal(second["state"], straight["state"])
    assert straight["rounds"][1]["reward_mean"] == second["rounds"][0]["reward_mean"]
    assert straight["rounds"][1]["grad_norm"] > 0  # the parameters did move
    kinds = [r["long_round"] for r in straight["rounds"]]
    assert kinds == ([0.0, 1.0] if tail else [0.0, 0.0])
    assert second["rounds"][0]["long_round"] == kinds[1]


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory):
    """Three rounds with a checkpoint after each, uninterrupted: the reference trajectory."""
    from rl.rewards import REWARDS, register_reward
    from rl.run import train

    REWARDS.pop("test_parity_resume", None)
    register_reward("test_parity_resume")(lambda request, text: float(len(text) % 2))

    def config(workdir):
        c = smoke.get_config()
        c.workdir, c.rounds, c.checkpoint_every, c.resume = str(workdir), 3, 1, True
        c.sft.max_steps = 0
        c.task.reward = "test_parity_resume"  # rewards with variance: the parameters move
        return c

    workdir = tmp_path_factory.mktemp("straight")
    summary = train(config(workdir), stdout=False)
    yield dict(workdir=workdir, summary=summary, config=config)
    REWARDS.pop("test_parity_resume", None)


def _tb_steps(tb_dir, tag):
    import glob
    import struct

    from tensorboardX.proto import event_pb2

    steps = []
    for path in sorted(glob.glob(f"{tb_dir}/events.out.tfevents.*")):
        data, pos = open(path, "rb").read(), 0
        while pos < len(data):
            (n,) = struct.unpack("<Q", data[pos : pos + 8])
            event = event_pb2.Event.FromString(data[pos + 12 : pos + 12 + n])
            steps += [event.step for v in event.summary.value if v.tag == tag]
            pos += 16 + n
    return sorted(steps)


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["save_unfinished", "bit_flipped"])
def test_kill_during_the_last_save_resumes_exactly_with_one_metrics_row_per_round(
    straight_run, tmp_path, damage
):
    """kill -9 while step 3 was being saved: round 2's row is in the log, its checkpoint is not
    usable (left as orbax's temporary directory, or written with a flipped bit)."""
    import json
    import shutil

    from rl.run import train

    workdir = tmp_path / "killed"
    shutil.copytree(straight_run["workdir"], workdir)
    for name in ("summary.json", "timeline.json", "timeline.png", "learning_curve.png"):
        (workdir / name).unlink(missing_ok=True)  # written at the end: a killed run has none
    step3 = workdir / "ckpt" / "3"
    if damage == "save_unfinished":
        step3.rename(workdir / "ckpt" / "3.orbax-checkpoint-tmp-1234")
    else:
        data = max(
            (p for p in (step3 / "state").rglob("*") if p.is_file() and p.parent.name == "d"),
            key=lambda p: p.stat().st_size,
        )
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0x01
        data.write_bytes(bytes(raw))

    resumed = train(straight_run["config"](workdir), stdout=False)

    assert resumed["first_round"] == 2 and len(resumed["rounds"]) == 1
    # the same parameters as the uninterrupted run
    assert_bitwise_equal(resumed["state"], straight_run["summary"]["state"])
    rows = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["prefix"] == "train"] == [0, 1, 2]
    assert _tb_steps(workdir / "tb", "train/reward_mean") == [0, 1, 2]
    if damage == "bit_flipped":
        assert (workdir / "ckpt" / "damaged" / "3").is_dir()


@pytest.mark.slow
@pytest.mark.parametrize("killed", ["before_any_checksums", "before_the_first_save"])
def test_a_run_killed_with_no_intact_checkpoint_starts_over_on_a_plain_rerun(
    straight_run, tmp_path, killed
):
    """kill -9 after orbax wrote every step but before its checksums.json, or before the first
    save at all: the rerun needs no hand, it starts over and ends as the uninterrupted run."""
    import json
    import shutil

    from rl.run import train

    workdir = tmp_path / "killed"
    shutil.copytree(straight_run["workdir"], workdir)
    for name in ("summary.json", "timeline.json", "timeline.png", "learning_curve.png"):
        (workdir / name).unlink(missing_ok=True)
    if killed == "before_any_checksums":
        for checksums in (workdir / "ckpt").glob("*/checksums.json"):
            checksums.unlink()
    else:
        shutil.rmtree(workdir / "ckpt")

    resumed = train(straight_run["config"](workdir), stdout=False)

    assert resumed["first_round"] == 0 and len(resumed["rounds"]) == 3
    assert_bitwise_equal(resumed["state"], straight_run["summary"]["state"])
    rows = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["prefix"] == "train"] == [0, 1, 2]
    assert _tb_steps(workdir / "tb", "train/reward_mean") == [0, 1, 2]
    if killed == "before_any_checksums":
        assert sorted(p.name for p in (workdir / "ckpt" / "damaged").iterdir()) == ["1", "2", "3"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["countdown", "countdown_retry"])
def test_countdown_smoke_run_scores_every_response_without_reward_errors(tmp_path, name):
    import importlib

    from rl.run import train

    config = importlib.import_module(f"configs.{name}").get_config("smoke")
    config.workdir = str(tmp_path)
    summary = train(config, stdout=False)
    assert len(summary["rounds"]) == config.rounds
    # The verifier raises on a record without its numbers and target: such calls count as errors.
    assert summary["reward_errors"] == 0 and summary["data"]["too_long"] == 0
    assert (tmp_path / "learning_curve.png").exists()


def test_train_ends_every_thread_and_process_it_started_when_it_returns_or_raises(
    tmp_path, monkeypatch
):
    import multiprocessing
    import threading

    from rl import run

    # Compared as sets, not counts: a thread of an earlier test that ends meanwhile is no leak.
    before = set(threading.enumerate())

    def started_threads_end():
        # A thread that is still finishing gets a few seconds: tensorboardX's close() closes its
        # multiprocessing queue without joining the queue's feeder thread, which then ends on its
        # own a moment later. A thread the run leaves behind never ends.
        for t in set(threading.enumerate()) - before:
            t.join(timeout=5.0)
        return set(threading.enumerate()) <= before

    c = smoke.get_config()
    c.workdir, c.rounds, c.sft.max_steps = str(tmp_path / "returns"), 1, 0
    run.train(c, stdout=False)
    assert started_threads_end(), threading.enumerate()
    assert multiprocessing.active_children() == []

    def fail(*args, **kwargs):
        raise RuntimeError("injected")

    monkeypatch.setattr(run.MetricsWriter, "write", fail)
    c.workdir = str(tmp_path / "raises")
    with pytest.raises(RuntimeError, match="injected"):
        run.train(c, stdout=False)
    assert started_threads_end(), threading.enumerate()
    assert multiprocessing.active_children() == []


@pytest.mark.slow  # two smoke runs
def test_a_stop_during_the_sft_warm_start_ends_it_at_once_and_a_rerun_starts_over(tmp_path):
    """SIGTERM (launch.train's stop) during the warm start ends it after the running step, with
    nothing saved; the plain rerun starts the run over and finishes it."""
    import threading

    from rl.run import train

    config = smoke.get_config()
    config.workdir = str(tmp_path)
    config.resume = True  # as the default recipe: a rerun continues (or, with no save, restarts)
    stop = threading.Event()
    stop.set()
    summary = train(config, stdout=False, stop=stop)
    assert summary["stopped_at"] == 0 and summary["sft_steps"] == 1 and summary["rounds"] == []
    assert not (tmp_path / "summary.json").exists() and not list(tmp_path.glob("ckpt/[0-9]*"))
    again = train(config, stdout=False)
    assert again["sft_steps"] > 1 and len(again["rounds"]) == config.rounds
    assert (tmp_path / "summary.json").is_file()
