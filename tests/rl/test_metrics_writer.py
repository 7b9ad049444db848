"""MetricsWriter's JSONL, TensorBoard and stdout, and its rewind on resume."""

import glob
import json
import struct
import threading

import pytest

from rl.metrics_writer import MetricsWriter


def _tb_scalars(tb_dir) -> dict[str, list[tuple[int, float]]]:
    """Reads scalar summaries from tensorboardX event files (TFRecord framing, CRCs skipped)."""
    from tensorboardX.proto import event_pb2

    out: dict[str, list[tuple[int, float]]] = {}
    (path,) = glob.glob(f"{tb_dir}/events.out.tfevents.*")
    with open(path, "rb") as f:
        data = f.read()
    pos = 0
    while pos < len(data):
        (n,) = struct.unpack("<Q", data[pos : pos + 8])
        event = event_pb2.Event.FromString(data[pos + 12 : pos + 12 + n])
        pos += 12 + n + 4
        for v in event.summary.value:
            out.setdefault(v.tag, []).append((event.step, v.simple_value))
    return out


def test_metrics_writer_jsonl_tensorboard_and_stdout(tmp_path, capsys):
    with MetricsWriter(tmp_path / "run") as w:
        w.write(0, {"round": 0, "loss": 0.5, "trainer_wait_ratio": 0.25}, prefix="train")
        w.write(1, {"loss": float("nan"), "kl": float("inf"), "reward": 1.0})
        bar = w.progress(total=4, desc="round 1")
        bar.update(4)
        bar.close()
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x) for x in lines] == [
        {"step": 0, "prefix": "train", "round": 0.0, "loss": 0.5, "trainer_wait_ratio": 0.25},
        {"step": 1, "prefix": "", "loss": None, "kl": None, "reward": 1.0},
    ]
    scalars = _tb_scalars(tmp_path / "run" / "tb")
    assert scalars["train/loss"] == [(0, 0.5)] and scalars["reward"] == [(1, 1.0)]
    assert "loss" not in scalars and "kl" not in scalars  # non-finite values are skipped
    out = capsys.readouterr().out
    assert "[train] step 0 | round 0 | loss 0.5 | trainer_wait_ratio 0.25" in out
    assert "step 1 | reward 1 | loss nan | kl nan" in out


def test_metrics_writer_quiet_without_tensorboard_appends(tmp_path, capsys):
    for step in range(2):
        w = MetricsWriter(tmp_path, tensorboard=False, stdout=False)
        w.write(step, {"loss": 1.0})
        threads = set(threading.enumerate())
        bar = w.progress(total=3, desc="round")  # prints nothing, starts no thread
        bar.update(1)
        bar.close()
        assert set(threading.enumerate()) <= threads  # (a thread of an earlier test may end)
        w.close()
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2
    assert not (tmp_path / "tb").exists() and capsys.readouterr().out == ""
    with MetricsWriter(tmp_path, tensorboard=False, stdout=False) as w:
        with pytest.raises(ValueError, match="'step' is reserved"):
            w.write(0, {"step": 1.0})
        with pytest.raises(ValueError, match="'loss' must be a number; received 'x'"):
            w.write(0, {"loss": "x"})
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2  # nothing half-written


def _tb_events(tb_dir) -> list[tuple[str, int]]:
    """(tag, step) of every scalar in all event files under tb_dir, CRCs checked."""
    from tensorboardX.proto import event_pb2
    from tensorboardX.record_writer import masked_crc32c

    out = []
    for path in sorted(glob.glob(f"{tb_dir}/events.out.tfevents.*")):
        with open(path, "rb") as f:
            data = f.read()
        pos = 0
        while pos < len(data):
            (n,) = struct.unpack("<Q", data[pos : pos + 8])
            body = data[pos + 12 : pos + 12 + n]
            assert struct.unpack("<I", data[pos + 8 : pos + 12])[0] == masked_crc32c(
                data[pos : pos + 8]
            )
            assert struct.unpack("<I", data[pos + 12 + n : pos + 16 + n])[0] == masked_crc32c(body)
            pos += 16 + n
            event = event_pb2.Event.FromString(body)
            out += [(v.tag, event.step) for v in event.summary.value]
    return sorted(out)


def test_resume_rewinds_jsonl_and_tensorboard_to_the_checkpoint(tmp_path):
    # A run writes SFT rows and rounds 0-2; its checkpoint was taken after round 1, then kill -9
    # (mid-write of a line). The resumed run rewinds to the checkpoint and writes round 2 again:
    # every step has exactly one row, in the JSONL and in TensorBoard.
    with MetricsWriter(tmp_path, stdout=False) as w:
        for step in (10, 20):
            w.write(step, {"loss": 1.0}, prefix="sft")
        for r in range(3):
            w.write(r, {"loss": float(r)}, prefix="train")
            if r == 1:
                at_checkpoint = w.last_steps
    assert at_checkpoint == {"sft": 20, "train": 1}
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "prefix": "tra')  # the kill
    with MetricsWriter(tmp_path, stdout=False, rewind_to=at_checkpoint) as w:
        assert w.last_steps == at_checkpoint
        w.write(2, {"loss": 2.5}, prefix="train")
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(x["prefix"], x["step"]) for x in rows] == [
        ("sft", 10), ("sft", 20), ("train", 0), ("train", 1), ("train", 2)
    ]  # fmt: skip
    assert rows[-1]["loss"] == 2.5
    assert _tb_events(tmp_path / "tb") == [
        ("sft/loss", 10), ("sft/loss", 20), ("train/loss", 0), ("train/loss", 1),
        ("train/loss", 2),
    ]  # fmt: skip
