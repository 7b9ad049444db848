"""Timeline: thread-safe recording, Chrome-trace JSON, the Gantt picture."""

import json
import math
import threading

import numpy as np
import pytest

from rl.timeline import Timeline


def _pipeline(num_slots: int = 3) -> Timeline:
    """A small scripted round: sequences on slots, a prefill, groups, learner steps, a publish."""
    tl = Timeline()
    t0 = 100.0  # any origin: traces and pictures count from the first event
    tl.span("sampler/prefill", "prefill", t0, t0 + 0.5, uid=0, round=0)
    for slot in range(num_slots):
        tl.span(
            f"sampler/slot{slot}", "seq", t0 + 0.5, t0 + 2.0 + slot, uid=0, sample=slot, round=0
        )
        tl.span(f"sampler/slot{slot}", "seq", t0 + 4.0, t0 + 5.0, uid=1, sample=slot, round=0)
    tl.instant("sampler/groups", "group", t0 + 2.0 + num_slots, uid=0, round=0)
    tl.span("learner", "update", t0 + 5.0, t0 + 6.0, step=0, round=0, tokens=64)
    tl.span("learner", "micro_step", t0 + 5.0, t0 + 5.5, step=0, round=0, tokens=64)
    tl.span("publish", "publish", t0 + 6.0, t0 + 6.25, version=1)
    return tl


def test_spans_from_many_threads_are_all_recorded():
    tl = Timeline()
    threads, per_thread = 8, 500
    barrier = threading.Barrier(threads + 1)

    def record(k: int) -> None:
        barrier.wait()
        for j in range(per_thread):
            tl.span(f"sampler/slot{k}", "seq", j, j + 0.5, round=0, sample=j)
            tl.instant("sampler/groups", "group", j, thread=k)

    workers = [threading.Thread(target=record, args=(k,)) for k in range(threads)]
    for w in workers:
        w.start()
    barrier.wait()
    while any(w.is_alive() for w in workers):  # readers run concurrently with the writers
        json.dumps(tl.to_chrome_trace())
    for w in workers:
        w.join()
    assert len(tl.spans()) == threads * per_thread
    assert len(tl.instants("sampler/groups")) == threads * per_thread
    for k in range(threads):
        mine = tl.spans(f"sampler/slot{k}")
        assert sorted(s.args["sample"] for s in mine) == list(range(per_thread))


def test_span_rejects_bad_times_naming_the_span():
    tl = Timeline()
    with pytest.raises(
        ValueError, match=r"learner/update ends before it starts.*start=2.0, end=1.0"
    ):
        tl.span("learner", "update", 2.0, 1.0)
    with pytest.raises(ValueError, match=r"publish/publish: end must be a finite number"):
        tl.span("publish", "publish", 0.0, math.inf)
    with pytest.raises(ValueError, match="non-empty"):
        tl.instant("", "group", 0.0)
    assert tl.spans() == []
    tl.span("learner", "update", np.float32(1.0), np.float64(1.0))  # zero length, numpy times
    assert tl.spans()[0].duration == 0.0


def test_spans_filter_by_lane_prefix_and_sort_by_start():
    tl = _pipeline()
    assert {s.lane for s in tl.spans("sampler/slot")} == {f"sampler/slot{i}" for i in range(3)}
    assert [s.name for s in tl.spans("learner")] == [
        "update",
        "micro_step",
    ]  # same start: outer first
    starts = [s.start for s in tl.spans()]
    assert starts == sorted(starts)
    t = sorted(s.end for s in tl.spans())[len(starts) // 2]
    assert tl.spans(since=t) == [s for s in tl.spans() if s.end >= t]
    assert [s.lane for s in tl.spans("learner", since=t)] == [
        s.lane for s in tl.spans("learner") if s.end >= t
    ]


def test_chrome_trace_units_processes_and_thread_names(tmp_path):
    tl = _pipeline()
    tl.span("learner", "update", 110.0, 111.0, loss=float("nan"), step=np.int64(1))
    path = tmp_path / "trace.json"
    tl.write_chrome_trace(path)
    trace = json.loads(path.read_text())
    events = trace["traceEvents"]
    assert trace["otherData"]["time_origin_s"] == 100.0

    procs = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert sorted(procs.values()) == ["learner", "publish", "sampler"]
    threads = {
        (e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"
    }
    lanes = {"sampler/prefill", "sampler/groups", "learner", "publish"}
    assert set(threads.values()) == lanes | {f"sampler/slot{i}" for i in range(3)}
    assert len(set(threads)) == len(threads)  # one tid per lane
    for (pid, _), lane in threads.items():
        assert procs[pid] == lane.split("/")[0]

    complete = [e for e in events if e["ph"] == "X"]
    assert len(complete) == len(tl.spans())
    for e in complete:  # every X event sits on its lane's named thread
        assert threads[(e["pid"], e["tid"])] == e["cat"]
    update = next(e for e in complete if e["name"] == "update" and e["args"]["step"] == 0)
    assert update["ts"] == pytest.approx(5.0e6) and update["dur"] == pytest.approx(1.0e6)
    late = next(e for e in complete if e["args"].get("step") == 1)
    assert late["args"]["loss"] is None and late["ts"] == pytest.approx(10.0e6)

    (group,) = [e for e in events if e["ph"] == "i"]
    assert group["ts"] == pytest.approx(5.0e6) and group["s"] == "t"
    assert threads[(group["pid"], group["tid"])] == "sampler/groups"


def test_gantt_png_has_the_expected_size_and_lanes(tmp_path):
    import matplotlib.image

    tl = _pipeline(num_slots=4)
    fig = tl.gantt_figure(title="round 0")
    (ax,) = fig.axes
    rows = [t.get_text() for t in ax.get_yticklabels()]
    assert rows[:4] == [f"sampler/slot{i}" for i in range(4)]  # slots on top, in slot order
    assert rows[4:] == ["sampler/prefill", "sampler/groups", "learner", "publish"]
    legend = {t.get_text() for t in ax.get_legend().get_texts()}
    assert legend == {"sequence", "prefill", "micro_step", "update", "publish", "group"}
    assert ax.get_title() == "round 0"
    assert ax.get_xlim()[0] <= 0.0 and ax.get_xlim()[1] >= 6.25  # seconds from the first event

    path = tmp_path / "gantt.png"
    tl.write_gantt_png(path, title="round 0")
    assert path.stat().st_size > 0
    width, height = fig.get_size_inches() * fig.dpi
    assert width == 1200
    assert matplotlib.image.imread(path).shape == (round(height), 1200, 4)


def test_gantt_height_grows_with_lanes_and_is_capped():
    small = _pipeline(num_slots=2).gantt_figure().get_figheight()
    big = _pipeline(num_slots=16).gantt_figure().get_figheight()
    huge = _pipeline(num_slots=200).gantt_figure().get_figheight()
    assert small < big < huge == 16.0
    assert Timeline().gantt_figure().axes  # an empty timeline still draws


def test_gantt_since_draws_only_the_window():
    tl = _pipeline(num_slots=2)  # first wave of sequences ends by 103.5; the second starts at 104
    fig = tl.gantt_figure(since=104.0)
    (ax,) = fig.axes
    rows = [t.get_text() for t in ax.get_yticklabels()]
    assert rows == ["sampler/slot0", "sampler/slot1", "sampler/groups", "learner", "publish"]
    xs = np.concatenate([p.vertices[:, 0] for c in ax.collections for p in c.get_paths()])
    assert xs.min() == 0.0 and xs.max() == 2.25  # seconds from `since`: 104 -> 0, 106.25 -> 2.25
    assert ax.get_xlim()[0] == 0.0
    whole = tl.gantt_figure().axes[0]
    assert "sampler/prefill" in [t.get_text() for t in whole.get_yticklabels()]
