"""Weights & Biases tracking (rl/tracking.py): offline runs read back from their .wandb files."""

import glob
import json
import os
import struct
import sys
import time

import matplotlib.image
import pytest
import wandb  # in setup.py's [test] extras: if missing or broken, fail (never skip)
from google.protobuf.message import DecodeError
from wandb.proto import wandb_internal_pb2

from configs import smoke
from rl.config_check import ConfigError, check_config
from rl.metrics_writer import MetricsWriter
from rl.run import train
from rl.tracking import (
    RUN_ID_FILE,
    WANDB_MISSING,
    TrackingConfig,
    WandbTracker,
    flat_config,
    open_tracker,
    tracking_config_from,
)

OFFLINE = TrackingConfig(wandb=True, wandb_mode="offline")


@pytest.fixture
def wandb_env(tmp_path, monkeypatch):
    """Offline, quiet W&B writing under tmp_path; its session ends with the test."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_dir"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    os.makedirs(tmp_path / "wandb_dir")
    yield tmp_path / "wandb_dir"
    wandb.teardown()  # the next test's W&B session reads its own environment


def _records(path) -> list:
    """The Record protos of a .wandb file: a ":W&B" header (7 bytes), then LevelDB-log records
    (32 KiB blocks; per record a CRC, a length, a type: FULL 1, FIRST 2, MIDDLE 3, LAST 4)."""
    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B", data[:7]
    pos, part, out = 7, b"", []
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        length, kind = struct.unpack("<HB", data[pos + 4 : pos + 7])
        if left < 7 or kind == 0:  # a block's zero-filled tail
            pos += left
            continue
        part += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            out.append(wandb_internal_pb2.Record.FromString(part))
            part = b""
    return out


def _key(item) -> str:
    return item.key or "/".join(item.nested_key)


def _offline_run(wandb_dir, run_id: str, timeout_s: float = 30.0) -> dict:
    """What an offline run wrote: its history rows, x axes, config, summary and exit code.

    W&B's service process writes the file after `finish` returns, at times: it is read again
    until its exit record is there."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            out = _read_offline_run(wandb_dir, run_id)
        except (ValueError, AssertionError, DecodeError):  # not yet written, or cut short
            out = None
        if (out is not None and out["exit_code"] is not None) or time.monotonic() > deadline:
            return out if out is not None else _read_offline_run(wandb_dir, run_id)
        time.sleep(0.1)


def _read_offline_run(wandb_dir, run_id: str) -> dict:
    (path,) = glob.glob(f"{wandb_dir}/wandb/offline-run-*-{run_id}/run-{run_id}.wandb")
    out = {"rows": [], "step_metric": {}, "config": {}, "summary": {}, "exit_code": None}
    for r in _records(path):
        kind = r.WhichOneof("record_type")
        if kind == "history":
            out["rows"].append({_key(i): json.loads(i.value_json) for i in r.history.item})
        elif kind == "metric" and r.metric.step_metric:
            out["step_metric"][r.metric.name] = r.metric.step_metric
        elif kind in ("run", "config"):
            updates = r.run.config.update if kind == "run" else r.config.update
            out["config"].update({_key(i): json.loads(i.value_json) for i in updates})
        elif kind == "summary":
            out["summary"].update({_key(i): json.loads(i.value_json) for i in r.summary.update})
        elif kind == "exit":
            out["exit_code"] = r.exit.exit_code
    return out


def _user_rows(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if not k.startswith("_")} for row in rows]


def test_writer_rows_config_summary_and_pictures_go_to_an_offline_run(tmp_path, wandb_env):
    workdir = tmp_path / "run"
    os.makedirs(workdir)
    picture = tmp_path / "learning_curve.png"
    matplotlib.image.imsave(picture, [[0.0, 1.0], [1.0, 0.0]])
    config = smoke.get_config()
    with open_tracker(OFFLINE, workdir=workdir, config=config, resume=False) as tracker:
        with MetricsWriter(workdir, tensorboard=False, stdout=False, tracker=tracker) as w:
            w.write(10, {"loss": 2.0, "heldout_acc": 0.0}, prefix="sft")
            w.write(0, {"round": 0, "loss": 0.5}, prefix="train")
            w.write(1, {"round": 1, "loss": float("nan"), "kl": 0.25}, prefix="train")
            w.write(3, {"loss": 1.0})  # no prefix: keys as they are, "step" their x axis
        tracker.log_final(
            {"heldout_acc_after": 0.75, "data": {"train": 12}},
            pictures=[str(picture), str(tmp_path / "timeline.png")],  # the second is missing
        )
        run_id = tracker.run.id
    assert (workdir / RUN_ID_FILE).read_text() == run_id
    run = _offline_run(wandb_env, run_id)
    *rows, pictures = _user_rows(run["rows"])
    assert rows == [
        {"sft/step": 10, "sft/loss": 2.0, "sft/heldout_acc": 0.0},
        {"train/step": 0, "train/round": 0.0, "train/loss": 0.5},
        {"train/step": 1, "train/round": 1.0, "train/kl": 0.25},  # NaN left out, as in TB
        {"step": 3, "loss": 1.0},
    ]
    # the picture that exists, as an image (its fields flattened in the file); no "timeline"
    assert pictures["learning_curve/_type"] == "image-file"
    assert {k.split("/")[0] for k in pictures} == {"learning_curve"}
    assert run["step_metric"] == {
        "sft/loss": "sft/step",
        "sft/heldout_acc": "sft/step",
        "train/round": "train/step",
        "train/loss": "train/step",
        "train/kl": "train/step",
        "loss": "step",
    }
    assert run["config"]["learner.optimizer.lr"] == config.learner.optimizer.lr
    assert run["config"]["log.wandb_project"] == "rolloutpipe"
    assert run["summary"]["heldout_acc_after"] == 0.75
    assert run["summary"]["data"] == {"train": 12}
    assert run["exit_code"] == 0


def test_a_resumed_run_continues_the_same_wandb_run_and_a_failed_one_exits_1(tmp_path, wandb_env):
    workdir = tmp_path / "run"
    os.makedirs(workdir)
    config = {"rounds": 2}
    with open_tracker(OFFLINE, workdir=workdir, config=config, resume=False) as tracker:
        tracker.log(0, {"loss": 1.0}, prefix="train")
        first = tracker.run.id
    with pytest.raises(RuntimeError, match="boom"):
        with open_tracker(OFFLINE, workdir=workdir, config=config, resume=True) as tracker:
            assert tracker.run.id == first
            tracker.log(1, {"loss": 0.5}, prefix="train")
            raise RuntimeError("boom")
    with open_tracker(OFFLINE, workdir=workdir, config=config, resume=False) as tracker:
        fresh = tracker.run.id
    assert fresh != first  # a fresh run: a new W&B run
    assert (workdir / RUN_ID_FILE).read_text() == fresh
    # offline: a directory per start, offline-run-<time>-<id>[-<n>]; `wandb sync` uploads both
    starts = glob.glob(f"{wandb_env}/wandb/offline-run-*-{first}*/run-{first}.wandb")
    exits = [r.exit.exit_code for p in starts for r in _records(p) if r.HasField("exit")]
    assert sorted(exits) == [0, 1]  # the first finished, the resumed one failed


def test_tracking_off_opens_nothing(tmp_path):
    with open_tracker(TrackingConfig(), workdir=tmp_path, config={}, resume=False) as tracker:
        assert tracker is None
    assert not os.listdir(tmp_path)


def test_flat_config_and_defaults_match_base_py():
    config = smoke.get_config()
    flat = flat_config(config)
    assert flat["learner.loss.ppo_clip.clip_high"] == 0.28 and flat["rounds"] == config.rounds
    assert tracking_config_from(config) == TrackingConfig()  # base.py's config.log = the defaults
    assert tracking_config_from({}) == TrackingConfig()  # a config without a log section


def test_bad_tracking_fields_are_named_by_check_config():
    config = smoke.get_config()
    config.log.wandb_mode = "ofline"
    with pytest.raises(ConfigError, match=r"config.log.wandb_mode='ofline'; expected one of \("):
        check_config(config)
    config.log.wandb_mode = ""
    with config.unlocked():
        config.log.wandb_projetc = "x"
    with pytest.raises(ConfigError, match="did you mean config.log.wandb_project"):
        check_config(config)


def test_wandb_not_installed_is_one_clear_line(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    config = smoke.get_config()
    config.log.wandb = True
    with pytest.raises(ConfigError) as e:
        check_config(config)
    assert str(e.value) == WANDB_MISSING and 'pip install -e ".[wandb]"' in str(e.value)
    with pytest.raises(ImportError, match=r'pip install -e "\.\[wandb\]"'):
        WandbTracker.start(OFFLINE, workdir=tmp_path, config={}, resume=False)
    config.log.wandb = False
    check_config(config)  # tracking off: wandb is not needed


@pytest.mark.slow  # an end-to-end run: ~10 s on a 2-core CPU with a warm compilation cache
def test_a_smoke_run_logs_its_rows_summary_and_pictures(tmp_path, wandb_env):
    config = smoke.get_config()
    config.workdir = str(tmp_path / "run")
    config.log.wandb, config.log.wandb_mode = True, "offline"
    summary = train(config, stdout=False)
    run = _offline_run(wandb_env, (tmp_path / "run" / RUN_ID_FILE).read_text())
    *rows, pictures = _user_rows(run["rows"])
    jsonl = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert rows == [  # metrics.jsonl's rows (sft steps, then rounds), null values left out
        {f"{x['prefix']}/{k}": v for k, v in x.items() if k != "prefix" and v is not None}
        for x in map(json.loads, jsonl)
    ]
    assert [r["train/step"] for r in rows if "train/step" in r] == list(range(config.rounds))
    assert {k.split("/")[0] for k in pictures} == {"timeline", "learning_curve"}
    assert run["summary"]["heldout_acc_after"] == summary["heldout_acc_after"]
    assert run["config"]["task.name"] == config.task.name
    assert run["exit_code"] == 0
