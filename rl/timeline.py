"""A thread-safe recorder of spans and instants, written as Chrome-trace JSON and a Gantt PNG.

Clock-free: callers pass every time (float seconds, any origin), so the sampler and learner
threads (wall clock) and the discrete-event simulator (virtual clock) share it. Lanes the runtime
uses (free strings; the part before the first "/" is the lane group, one trace process each):

    sampler/slot{i}   one per engine slot: a span per sequence (args uid, sample, round, tokens)
    sampler/prefill   prefill spans
    sampler/groups    instants when a group completes
    sampler/migrate   long-tail migrations out of a replica (args round, uid, sequences, bytes,
                      src, dst); replica i > 0's non-slot lanes are sampler/replica{i}/...
    learner           spans "micro_step" and "update" (args step, round, tokens)
    publish           weight publish spans (args version)
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.figure import Figure

GROUP_ORDER = ("sampler", "learner", "publish")  # trace processes and Gantt rows, top to bottom
SLOT_PREFIX = "sampler/slot"
# Gantt bars
_CATEGORIES = ("sequence", "prefill", "migrate", "micro_step", "update", "publish", "other")
_COLORS = dict(zip(_CATEGORIES, ("C0", "C9", "C4", "C1", "C3", "C2", "C7"), strict=True))


@dataclasses.dataclass(frozen=True)
class Span:
    """Work on one lane over [start, end] seconds."""

    lane: str
    name: str
    start: float
    end: float
    args: Mapping[str, Any]

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclasses.dataclass(frozen=True)
class Instant:
    """A point event on one lane at `t` seconds."""

    lane: str
    name: str
    t: float
    args: Mapping[str, Any]


def _time(lane: str, name: str, key: str, t: Any) -> float:
    """`t` as a finite float, or a ValueError naming the event."""
    if not isinstance(lane, str) or not lane or not isinstance(name, str) or not name:
        raise ValueError(f"lane and name must be non-empty strings; received {lane!r}, {name!r}.")
    try:
        if math.isfinite(t := float(t)):
            return t
    except (TypeError, ValueError):
        pass
    raise ValueError(f"{lane}/{name}: {key} must be a finite number of seconds; received {t!r}.")


def replica_lane(lane: str, replica: int, offset: int) -> str:
    """Replica `replica`'s own lane on the run's timeline: slot lanes numbered across replicas
    (its slot i is slot offset + i), its other sampler lanes under sampler/replica{replica}/."""
    if lane.startswith(SLOT_PREFIX):
        return f"{SLOT_PREFIX}{offset + int(lane[len(SLOT_PREFIX) :])}"
    if lane.startswith("sampler/"):
        return f"sampler/replica{replica}/{lane.removeprefix('sampler/')}"
    return lane


def lane_group(lane: str) -> str:
    """The lane's group: the part before the first "/" ("sampler/slot3" -> "sampler")."""
    return lane.split("/", 1)[0]


def _lane_key(lane: str) -> tuple[Any, ...]:
    """Row order: groups in GROUP_ORDER, then others; slots, prefill, the rest; slot2 < slot10."""
    group = lane_group(lane)
    rank = GROUP_ORDER.index(group) if group in GROUP_ORDER else len(GROUP_ORDER)
    sub = 0 if lane.startswith(SLOT_PREFIX) else 1 if lane == "sampler/prefill" else 2
    return (rank, group, sub, [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", lane)])


def _jsonable(v: Any) -> Any:
    """Args as strict JSON: non-finite floats become null, numpy scalars plain numbers."""
    if v is None or isinstance(v, bool | int | str):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, Mapping):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_jsonable(x) for x in v]
    item = getattr(v, "item", None)  # numpy / jax scalars
    return _jsonable(item()) if callable(item) and getattr(v, "size", 0) == 1 else str(v)


def _meta(kind: str, pid: int, tid: int, name: str) -> list[dict[str, Any]]:
    """Trace metadata naming a process or thread, ordered by its id."""
    where = {"ph": "M", "pid": pid, "tid": tid}
    return [
        {**where, "name": f"{kind}_name", "args": {"name": name}},
        {**where, "name": f"{kind}_sort_index", "args": {"sort_index": tid or pid}},
    ]


def _category(span: Span) -> str:
    if span.lane.startswith(SLOT_PREFIX):
        return "sequence"
    if lane_group(span.lane) == "sampler" and span.name in ("prefill", "migrate"):
        return span.name  # any replica's prefill lane, its migrations (rl.elastic)
    if span.name in ("micro_step", "update"):
        return span.name
    return "publish" if lane_group(span.lane) == "publish" else "other"


class Timeline:
    """Records spans and instants from any thread; see the module docstring for the lanes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: list[Span] = []
        self._instants: list[Instant] = []

    def span(self, lane: str, name: str, start: float, end: float, **args: Any) -> Span:
        """Records a span.

        Args:
          lane: e.g. "sampler/slot0", "learner".
          name: what ran, e.g. "update".
          start: start time in seconds (the caller's clock).
          end: end time in seconds, >= start.
          **args: free annotations (round, step, tokens, ...).

        Returns:
          The recorded Span.
        """
        start, end = _time(lane, name, "start", start), _time(lane, name, "end", end)
        if end < start:
            raise ValueError(
                f"Span {lane}/{name} ends before it starts: start={start}, end={end}; "
                "expected end >= start."
            )
        s = Span(lane, name, start, end, dict(args))
        with self._lock:
            self._spans.append(s)
        return s

    def instant(self, lane: str, name: str, t: float, **args: Any) -> Instant:
        """Records a point event at time `t` (seconds) on `lane`; returns it."""
        i = Instant(lane, name, _time(lane, name, "t", t), dict(args))
        with self._lock:
            self._instants.append(i)
        return i

    def spans(self, lane_prefix: str | None = None, *, since: float | None = None) -> list[Span]:
        """Spans whose lane starts with `lane_prefix` (all if None), by start (outer span first).

        With `since`, only spans that end at or after that time (a round's metrics need only the
        recent ones, and sorting the whole history every round grows with the run).
        """
        prefix, since = lane_prefix or "", -math.inf if since is None else since
        with self._lock:
            out = [s for s in self._spans if s.end >= since and s.lane.startswith(prefix)]
        return sorted(out, key=lambda s: (s.start, -s.end))

    def take(self) -> tuple[list[Span], list[Instant]]:
        """Removes and returns everything recorded so far, in recording order (a remote worker
        ships its events to the driver's timeline this way)."""
        with self._lock:
            out = self._spans, self._instants
            self._spans, self._instants = [], []
        return out

    def instants(self, lane_prefix: str | None = None) -> list[Instant]:
        """Instants whose lane starts with `lane_prefix` (all if None), sorted by time."""
        with self._lock:
            out = [i for i in self._instants if i.lane.startswith(lane_prefix or "")]
        return sorted(out, key=lambda i: i.t)

    def _snapshot(self) -> tuple[list[Span], list[Instant], float, list[str]]:
        """Spans, instants, the first event's time (0 if none), lanes in display order."""
        spans, instants = self.spans(), self.instants()
        times = [s.start for s in spans] + [i.t for i in instants]
        lanes = sorted({s.lane for s in spans} | {i.lane for i in instants}, key=_lane_key)
        return spans, instants, min(times, default=0.0), lanes

    def to_chrome_trace(self) -> dict[str, Any]:
        """The Chrome trace event format (opens in Perfetto / chrome://tracing).

        One process (pid) per lane group, one thread (tid) per lane, named by metadata events;
        spans are "X" events and instants "i" events, with ts/dur in microseconds from the first
        event (whose time in the caller's clock is in otherData.time_origin_s).
        """
        spans, instants, t0, lanes = self._snapshot()
        pid = {g: i + 1 for i, g in enumerate(dict.fromkeys(map(lane_group, lanes)))}
        tid = {lane: i + 1 for i, lane in enumerate(lanes)}
        events = [e for g, p in pid.items() for e in _meta("process", p, 0, g)]
        events += [
            e for lane, t in tid.items() for e in _meta("thread", pid[lane_group(lane)], t, lane)
        ]

        def event(ph: str, name: str, lane: str, t: float, **extra: Any) -> dict[str, Any]:
            where = {"pid": pid[lane_group(lane)], "tid": tid[lane], "ts": (t - t0) * 1e6}
            return {"ph": ph, "name": name, "cat": lane, **where, **extra}

        events += [
            event("X", s.name, s.lane, s.start, dur=s.duration * 1e6, args=_jsonable(s.args))
            for s in spans
        ]
        events += [event("i", i.name, i.lane, i.t, s="t", args=_jsonable(i.args)) for i in instants]
        return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"time_origin_s": t0}}

    def write_chrome_trace(self, path: str | os.PathLike) -> None:
        """Writes `to_chrome_trace()` as strict JSON to `path`."""
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_chrome_trace(), f, allow_nan=False)

    def gantt_figure(
        self,
        title: str = "",
        *,
        since: float | None = None,
        color_by: Callable[[Span], str] | None = None,
    ) -> Figure:
        """A matplotlib Figure (Agg canvas): one row per lane, x = seconds from the first event.

        Sampler slots (a bar per sequence), prefill, learner (updates, micro steps drawn thinner
        inside), publish; instants (group completions) as tick marks on their own rows. With
        `since`, only what happens from that time on (a long run's last rounds, where the bubble is
        visible), x = seconds from `since`. With `color_by`, a bar's color and legend entry are
        color_by(span) (e.g. the pipeline it belongs to) instead of its kind.
        """
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch

        spans, instants, t0, lanes = self._snapshot()
        if since is not None:
            spans = [s for s in spans if s.end >= since]
            instants = [i for i in instants if i.t >= since]
            t0, lanes = (
                since,
                sorted({s.lane for s in spans} | {i.lane for i in instants}, key=_lane_key),
            )
        row = {lane: r for r, lane in enumerate(lanes)}
        fig = Figure(figsize=(12.0, min(max(2.5, 1.2 + 0.3 * len(lanes)), 16.0)), dpi=100)
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        bars: dict[tuple[str, str], list[tuple[float, float]]] = {}
        for s in spans:
            cat = _category(s) if color_by is None else color_by(s)
            bars.setdefault((s.lane, cat), []).append((s.start - t0, s.duration))
        labels = list(_CATEGORIES) if color_by is None else sorted({c for _, c in bars})
        colors = _COLORS if color_by is None else {c: f"C{i % 10}" for i, c in enumerate(labels)}
        for (lane, cat), xranges in bars.items():
            half = 0.22 if cat == "micro_step" else 0.4
            style = dict(facecolors=colors[cat], edgecolor="white", linewidth=0.3, zorder=3 - half)
            ax.broken_barh(xranges, (row[lane] - half, 2 * half), **style)
        present = {cat for _, cat in bars}
        handles: list[Any] = [Patch(color=colors[c], label=c) for c in labels if c in present]
        for name in dict.fromkeys(i.name for i in instants):
            xs, ys = zip(
                *[(i.t - t0, row[i.lane]) for i in instants if i.name == name], strict=True
            )
            handles += ax.plot(xs, ys, "|", markersize=10, color="black", zorder=4, label=name)
        ax.set_yticks(range(len(lanes)), lanes, fontsize=8 if len(lanes) <= 40 else 5)
        ax.set_ylim(max(len(lanes), 1) - 0.5, -0.5)  # first lane on top
        ax.set_xlabel("seconds from first event" if since is None else "seconds")
        if since is not None:
            ax.set_xlim(left=0.0)
        ax.grid(axis="x", alpha=0.3)
        ax.set_title(title)
        if handles:
            ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
        height = fig.get_figheight()
        fig.subplots_adjust(left=0.1, right=0.87, bottom=0.6 / height, top=1 - 0.4 / height)
        return fig

    def write_gantt_png(
        self,
        path: str | os.PathLike,
        title: str = "",
        *,
        since: float | None = None,
        color_by: Callable[[Span], str] | None = None,
    ) -> None:
        """Writes `gantt_figure(title, since=since, color_by=color_by)` as a PNG (1200 px wide)."""
        self.gantt_figure(title, since=since, color_by=color_by).savefig(path, format="png")
