"""MetricsWriter: a run's metrics to workdir/metrics.jsonl, TensorBoard (workdir/tb) and stdout.

    writer = MetricsWriter(workdir)
    writer.write(step, {"round": r, "loss": 0.1, **round_metrics(...)}, prefix="train")

One JSON line per write, TensorBoard scalars "prefix/key", a one-line stdout summary
(SUMMARY_KEYS), and, given a `tracker` (rl/tracking.py: Weights & Biases), one row there. A run
resumed from a checkpoint rewinds both logs to the steps saved with it (`rewind_to`), so every step
has exactly one row (a tracker's rows stay). What the metrics mean: rl/metrics.py.
"""

from __future__ import annotations

import json
import math
import os
import struct
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any, Protocol

SUMMARY_KEYS = tuple(  # printed on stdout when present, in this order
    "round reward reward_mean accuracy loss kl rollout_to_train_end_s first_dispatch_s "
    "trainer_wait_ratio slot_occupancy".split()
)


def _finite_or_none(key: str, value: Any) -> float | None:
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"Metric {key!r} must be a number; received {value!r}.") from None
    return x if math.isfinite(x) else None


def _prefix_of(tag: str) -> str:
    return tag.split("/", 1)[0] if "/" in tag else ""


def _kept(prefix: str, step: int, upto: Mapping[str, int]) -> bool:
    return prefix in upto and step <= upto[prefix]


def _rewind_jsonl(path: str, upto: Mapping[str, int] | None) -> dict[str, int]:
    """Rewrites `path` without the rows `upto` rules out (and any half-written line).

    Returns the last step of each prefix among the rows kept.
    """
    if not os.path.exists(path):
        return {}
    kept, last, changed = [], {}, False
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                row = json.loads(line)
                prefix, step = str(row["prefix"]), int(row["step"])
            except (ValueError, KeyError, TypeError):  # a line cut short by a kill
                changed = True
                continue
            if upto is not None and not _kept(prefix, step, upto):
                changed = True
                continue
            kept.append(line if line.endswith("\n") else line + "\n")
            last[prefix] = max(step, last.get(prefix, step))
    if changed:
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(kept)
        os.replace(tmp, path)
    return last


def _rewind_tensorboard(logdir: str, upto: Mapping[str, int]) -> None:
    """Drops the scalar events `upto` rules out from the event files under `logdir`, in place.

    Event files are TFRecord files: per record, a uint64 length, a uint32 CRC of it, the Event
    proto and a uint32 CRC of that. Kept records are copied byte for byte (CRCs unchanged); a
    record cut short by a kill is dropped.
    """
    from tensorboardX.proto import event_pb2

    if not os.path.isdir(logdir):
        return
    for root, _, names in os.walk(logdir):
        for name in names:
            if "tfevents" not in name:
                continue
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                data = f.read()
            out, pos, changed = [], 0, False
            while pos < len(data):
                if pos + 12 > len(data):
                    changed = True
                    break
                (n,) = struct.unpack("<Q", data[pos : pos + 8])
                end = pos + 12 + n + 4
                if end > len(data):
                    changed = True
                    break
                event = event_pb2.Event.FromString(data[pos + 12 : pos + 12 + n])
                tags = [v.tag for v in event.summary.value]
                if tags and not _kept(_prefix_of(tags[0]), event.step, upto):
                    changed = True
                else:
                    out.append(data[pos:end])
                pos = end
            if changed:
                with open(path + ".tmp", "wb") as f:
                    f.writelines(out)
                os.replace(path + ".tmp", path)


class Tracker(Protocol):
    """Where each written row goes too (rl.tracking.WandbTracker); the writer does not close it."""

    def log(self, step: int, values: Mapping[str, float | None], prefix: str) -> None:
        """One row: the write's metrics, non-finite ones as None."""


class _NoProgress:
    """The progress bar of a writer with stdout off: shows nothing, starts nothing."""

    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


class MetricsWriter:
    """Writes metrics to workdir/metrics.jsonl, TensorBoard (workdir/tb) and stdout.

    writer = MetricsWriter(workdir)
    bar = writer.progress(total=R, desc=f"round {r}")  # bar.update(1) per group, bar.close()
    writer.write(step, {"round": r, "loss": 0.1, **round_metrics(...)}, prefix="train")
    meta["metrics"] = writer.last_steps  # saved with a checkpoint ...
    writer = MetricsWriter(workdir, rewind_to=meta["metrics"])  # ... and the log cut back to it
    writer.close()

    Steps increase within a prefix ("train": rounds, "sft": SFT steps). A run resumed from a
    checkpoint passes the `last_steps` saved with it as `rewind_to`: rows written after the
    checkpoint (rounds that will run again) are removed from metrics.jsonl and TensorBoard, so every
    step has exactly one row.
    """

    def __init__(
        self,
        workdir: str | os.PathLike,
        *,
        tensorboard: bool = True,
        stdout: bool = True,
        rewind_to: Mapping[str, int] | None = None,
        tracker: Tracker | None = None,
    ) -> None:
        """Opens the outputs (creates workdir; appends to an existing metrics.jsonl).

        Args:
          workdir: directory for metrics.jsonl and tb/.
          tensorboard: log scalars with tensorboardX.
          stdout: print a one-line summary per write and show progress bars.
          rewind_to: prefix -> last step to keep: rows of other prefixes or later steps are
            removed from metrics.jsonl and the TensorBoard event files first. None: keep all.
          tracker: also log each write there (its owner closes it); None: nowhere else.
        """
        os.makedirs(workdir, exist_ok=True)
        self.workdir = os.fspath(workdir)
        self.stdout = stdout
        self._tracker = tracker
        self._lock = threading.Lock()
        jsonl = os.path.join(self.workdir, "metrics.jsonl")
        upto = None if rewind_to is None else {str(k): int(v) for k, v in rewind_to.items()}
        self._last = _rewind_jsonl(jsonl, upto)
        if upto is not None:
            _rewind_tensorboard(os.path.join(self.workdir, "tb"), upto)
        self._jsonl = open(jsonl, "a", encoding="utf-8")
        self._tb = None
        if tensorboard:
            from tensorboardX import SummaryWriter

            # A unique suffix: event files are named by the second, and a resumed run's writer
            # must not truncate the file of a run that ended within the same second.
            self._tb = SummaryWriter(
                os.path.join(self.workdir, "tb"), filename_suffix=f".{time.time_ns()}"
            )

    def write(self, step: int, metrics: Mapping[str, float], prefix: str = "") -> None:
        """Appends one JSON line, logs TensorBoard scalars ("prefix/key"), prints a summary.

        The writer's tracker, if any, logs the same row.

        Args:
          step: the x axis (optimizer step or round).
          metrics: name -> number; NaN/inf are written as null (and skipped in TensorBoard).
          prefix: a namespace such as "train" or "eval"; kept as the line's "prefix" field.
        """
        for reserved in ("step", "prefix"):
            if reserved in metrics:
                raise ValueError(f"Metric name {reserved!r} is reserved; received it in metrics.")
        values = {k: _finite_or_none(k, v) for k, v in metrics.items()}
        line = json.dumps({"step": int(step), "prefix": prefix, **values}, allow_nan=False)
        with self._lock:
            self._jsonl.write(line + "\n")
            self._jsonl.flush()
            self._last[prefix] = max(int(step), self._last.get(prefix, int(step)))
            if self._tb is not None:
                for k, v in values.items():
                    if v is not None:
                        self._tb.add_scalar(f"{prefix}/{k}" if prefix else k, v, int(step))
                self._tb.flush()
            if self._tracker is not None:
                self._tracker.log(int(step), values, prefix)
        if self.stdout:
            from tqdm import tqdm

            tqdm.write(self.summary(step, values, prefix), file=sys.stdout)

    @property
    def last_steps(self) -> dict[str, int]:
        """Prefix -> the last step written (this run and the rows kept from before it)."""
        with self._lock:
            return dict(self._last)

    @staticmethod
    def summary(step: int, values: Mapping[str, float | None], prefix: str = "") -> str:
        """The compact stdout line: step, then SUMMARY_KEYS present in `values`."""
        head = f"[{prefix}] step {int(step)}" if prefix else f"step {int(step)}"
        fmt = lambda v: "nan" if v is None else f"{v:.4g}"
        return " | ".join([head] + [f"{k} {fmt(values[k])}" for k in SUMMARY_KEYS if k in values])

    def progress(self, total: int, desc: str) -> Any:
        """A tqdm progress bar (none when stdout is off); call .update(n) and .close()."""
        if not self.stdout:  # a disabled tqdm bar still starts tqdm's monitor thread, for good
            return _NoProgress()
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, leave=False, file=sys.stdout)

    def close(self) -> None:
        """Flushes and closes the JSONL file and the TensorBoard writer."""
        with self._lock:
            if self._tb is not None:
                self._tb.close()
                self._tb = None
            if not self._jsonl.closed:
                self._jsonl.close()

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
