"""The simulator: exact timing on hand-computable cases, the project's own policies, determinism,
tail batching's invariants, the runtime's timeline format."""

import collections
import dataclasses
import heapq

import pytest

from rl.admission import Frontier
from rl.elastic.stage import StageModel
from rl.formation import make_former
from rl.round_planner import TailConfig
from rl.sim.compare import ShuffledFCFS, make_admission, run_modes, sim_config, summarize
from rl.sim.sampler import SimSampler
from rl.sim.simulator import SimConfig, Simulator
from rl.sim.workload import Workload, WorkloadConfig
from rl.timeline import SLOT_PREFIX, Timeline
from rl.types import Request, SamplingParams

MODEL = StageModel(
    decode_a=0.01,
    steps_per_call=1,
    prefill_fixed=0.1,
    learner_fixed=0.5,
    update_s=0.25,
    publish_fixed=1.0,
)
GPU_LIKE = StageModel(
    decode_a=0.005,
    decode_b=1e-5,
    decode_c=3e-8,
    prefill_per_token=1e-5,
    learner_per_token=1e-5,
    learner_fixed=0.02,
    update_s=0.07,
    micro_batch_rows=8,
    publish_fixed=1.0,
)
WORKLOAD = WorkloadConfig(max_new_tokens=2048, median_tokens=300, runaway_fraction=0.1)
MODES = (
    "sync",
    "cgp+fcfs+fifo",
    "cgp+frontier+ordered",
    "cgp+shuffled+fifo",
    "sync+tail",
    "cgp+frontier+tail",
)


def small(mode, **kw):
    fields = dict(
        groups_per_round=8,
        groups_per_update=2,
        group_size=4,
        max_new_tokens=2048,
        slots=16,
        replicas=2,
    )
    fields.update(kw)
    return sim_config(mode, **fields)


def test_one_group_is_timed_exactly():
    workload = WorkloadConfig(max_new_tokens=64, fixed_lengths=(10,), prompt_min=3, prompt_max=3)
    cfg = SimConfig(
        mode="cgp",
        batching="fifo",
        groups_per_round=1,
        groups_per_update=1,
        group_size=2,
        max_new_tokens=64,
        slots=2,
    )
    result = Simulator(cfg, MODEL, Workload(workload)).run(5)
    (r,) = result.rounds  # the finite workload holds one prompt
    assert r["rollout_s"] == pytest.approx(0.1 + 10 * 0.01)  # prefill + 10 decode steps
    assert r["first_dispatch_s"] == pytest.approx(0.2)
    assert r["rollout_to_train_end_s"] == pytest.approx(0.2 + 0.5 + 0.25)
    assert r["trainer_wait_ratio"] == pytest.approx(0.2 / 0.95)
    assert result.end_s == pytest.approx(1.0 + 0.95 + 1.0)  # publish, round, publish
    assert r["sampler_tokens"] == 20 and r["updates"] == 1


@pytest.mark.parametrize("mode", MODES)
def test_same_seed_same_metrics(mode):
    def sim(workload):
        return Simulator(small(mode), GPU_LIKE, Workload(workload), make_admission=make_admission)

    a, b = sim(WORKLOAD).run(6), sim(WORKLOAD).run(6)
    assert a.rounds == b.rounds and a.counters == b.counters
    c = sim(dataclasses.replace(WORKLOAD, seed=1)).run(6)
    assert c.rounds != a.rounds


def test_the_simulator_calls_the_policy_and_former_it_is_given():
    calls = collections.Counter()

    class LastFirst(Frontier):  # admits the highest logical index first
        def submit(self, requests):
            calls["submit"] += 1
            super().submit(requests)

        def next(self, free_slots):
            calls["next"] += 1
            if not self._waiting:
                return None
            last = max(self._waiting.values(), key=lambda e: e[1].index)[1]
            return self.remove(last.key) if last.group_size <= free_slots else None

    def former(name, size, num_groups):
        calls[f"former:{name}"] += 1
        return make_former(name, size, num_groups)

    cfg = small("cgp+frontier+ordered", replicas=1, slots=4)  # one group at a time
    result = Simulator(
        cfg,
        GPU_LIKE,
        Workload(WORKLOAD),
        make_admission=lambda name: LastFirst(),
        make_batches=former,
    ).run(2)
    assert calls["submit"] == 2 and calls["next"] > 16 and calls["former:ordered"] == 2
    prefills = [
        s.args["uid"] for s in result.timeline.spans("sampler/prefill") if s.args["round"] == 0
    ]
    assert prefills == list(range(7, -1, -1))  # the custom policy's order, not logical order


def test_modes_keep_the_drivers_structure_and_timeline_format(tmp_path):
    rows = run_modes(
        MODES,
        GPU_LIKE,
        WORKLOAD,
        rounds=6,
        **dict(
            groups_per_round=8,
            groups_per_update=2,
            group_size=4,
            max_new_tokens=2048,
            slots=16,
            replicas=2,
            tail=TailConfig(),
        ),
    )
    sync, cgp = rows["sync"], rows["cgp+fcfs+fifo"]
    assert sync["first_dispatch_s"] == pytest.approx(sync["rollout_s"])  # sync trains after
    assert cgp["first_dispatch_s"] < sync["first_dispatch_s"] / 2
    assert cgp["rollout_to_train_end_s"] < sync["rollout_to_train_end_s"]
    assert set(rows) == set(MODES)  # every mode ran and trained its rounds
    assert all(r["rollout_to_train_end_s"] > 0 and r["groups_per_s"] > 0 for r in rows.values())
    assert 0 < cgp["trainer_wait_ratio"] < sync["trainer_wait_ratio"] < 1
    result = Simulator(small("cgp+frontier+fifo"), GPU_LIKE, Workload(WORKLOAD)).run(2)
    lanes = {s.lane for s in result.timeline.spans()}
    assert {"learner", "publish", "sampler/prefill"} <= lanes
    assert all(int(x[len(SLOT_PREFIX) :]) < 32 for x in lanes if x.startswith(SLOT_PREFIX))
    names = {s.name for s in result.timeline.spans("learner")}
    assert names == {"micro_step", "update"}
    result.timeline.write_gantt_png(tmp_path / "g.png")
    result.timeline.write_chrome_trace(tmp_path / "t.json")
    assert (tmp_path / "g.png").stat().st_size > 1000


def test_fcfs_and_frontier_schedule_alike_with_one_round_in_logical_order():
    a = Simulator(small("cgp+fcfs+fifo"), GPU_LIKE, Workload(WORKLOAD)).run(4)
    b = Simulator(small("cgp+frontier+fifo"), GPU_LIKE, Workload(WORKLOAD)).run(4)
    assert a.rounds == b.rounds
    c = Simulator(
        small("cgp+shuffled+fifo", replicas=1),
        GPU_LIKE,
        Workload(WORKLOAD),
        make_admission=lambda n: ShuffledFCFS(),
    ).run(4)
    assert (
        c.rounds
        != Simulator(small("cgp+fcfs+fifo", replicas=1), GPU_LIKE, Workload(WORKLOAD)).run(4).rounds
    )


@pytest.mark.parametrize("mode", ["sync+tail", "cgp+frontier+tail"])
def test_tail_batching_trains_every_prompt_of_an_epoch_once(mode):
    lengths = tuple([12, 300, 15, 18, 900, 20, 11, 25] * 5)  # 40 prompts, long ones recur
    workload = WorkloadConfig(max_new_tokens=1024, fixed_lengths=lengths)
    cfg = small(mode, epoch_size=len(lengths), tail=TailConfig(eta=1.5))
    sim = Simulator(cfg, GPU_LIKE, Workload(workload))
    result = sim.run(100)
    uids = [s.args["uid"] for s in result.timeline.spans("sampler/groups")] or [
        i.args["uid"] for i in result.timeline.instants("sampler/groups")
    ]
    assert sorted(uids) == list(range(len(lengths)))
    kinds = [r["kind"] for r in result.rounds]
    assert "short" in kinds and "long" in kinds
    assert result.counters["groups_aborted"] == sum(
        r["groups_launched"] - r["groups_trained"] for r in result.rounds
    )
    short_max = max(float(r["sampler_tokens"]) for r in result.rounds if r["kind"] == "short")
    assert short_max > 0
    assert summarize(result)["time_per_group_s"] > 0


def test_response_over_provisioning_keeps_the_first_g_samples():
    cfg = small("cgp+frontier+tail", tail=TailConfig(eta=1.25, response_eta=1.5))
    result = Simulator(cfg, GPU_LIKE, Workload(WORKLOAD)).run(3)
    assert result.counters["samples_cut"] > 0
    per_group = collections.Counter(
        (s.args["round"], s.args["uid"]) for s in result.timeline.spans(SLOT_PREFIX)
    )
    assert max(per_group.values()) <= 6  # ceil(1.5 * 4) launched, at least 4 kept


def test_contention_slows_overlap_only():
    model = GPU_LIKE.replace(contention=0.5)
    for mode, slower in (("sync", False), ("cgp+fcfs+fifo", True)):
        a = summarize(Simulator(small(mode), GPU_LIKE, Workload(WORKLOAD)).run(3))
        b = summarize(Simulator(small(mode), model, Workload(WORKLOAD)).run(3))
        assert (b["rollout_to_train_end_s"] > a["rollout_to_train_end_s"] * 1.01) == slower


def test_round_robin_and_shared_routing_both_finish():
    for routing in ("shared", "round_robin"):
        result = Simulator(
            small("cgp+fcfs+fifo", replicas=3, routing=routing), GPU_LIKE, Workload(WORKLOAD)
        ).run(3)
        assert [r["groups_trained"] for r in result.rounds] == [8.0] * 3


def test_bad_configs_say_what_they_got():
    with pytest.raises(ValueError, match=r"slots \(2\) must be >= group_size \(4\)"):
        small("sync", slots=2)
    with pytest.raises(ValueError, match=r"mode='lifo'; expected one of \('sync', 'cgp', 'async'"):
        SimConfig(mode="lifo")
    with pytest.raises(ValueError, match="mode='async' with batching='fifo'; expected 'ordered'"):
        SimConfig(mode="async")
    with pytest.raises(ValueError, match="max_staleness=1 needs mode='async'"):
        SimConfig(mode="cgp", max_staleness=1)
    with pytest.raises(ValueError, match=r"Mode 'cgp\+fcfs'"):
        sim_config("cgp+fcfs")
    with pytest.raises(ValueError, match="rounds must be >= 1; received 0"):
        Simulator(small("sync"), MODEL, Workload(WORKLOAD)).run(0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_frontier_beats_arrival_order_under_async(seed):
    """Several versions' requests wait together under async; with requests arriving out of
    logical order (asynchronous clients: `shuffled`), `frontier` still starts the groups the next
    update needs first, so the first update is dispatched earlier and no round trains later."""
    workload = dataclasses.replace(WORKLOAD, seed=seed)

    def run(admission):
        cfg = small(f"async+{admission}+s2", replicas=1, slots=8)
        return Simulator(cfg, GPU_LIKE, Workload(workload)).run(4)

    frontier, shuffled = run("frontier"), run("shuffled")
    prefills = [s.args for s in frontier.timeline.spans("sampler/prefill")]
    order = [(a["round"], a["uid"]) for a in prefills]
    assert order == sorted(order)  # logical order whatever the arrival order
    shuffled_order = [
        (s.args["round"], s.args["uid"]) for s in shuffled.timeline.spans("sampler/prefill")
    ]
    assert shuffled_order != sorted(shuffled_order)
    f0, s0 = frontier.rounds[0], shuffled.rounds[0]
    assert f0["first_dispatch_s"] < s0["first_dispatch_s"]
    for r in frontier.rounds + shuffled.rounds:
        assert r["lag_max"] <= 2


@pytest.mark.parametrize("routing", ["round_robin", "shared"])
def test_a_busy_replica_admits_a_submission_at_its_next_call_boundary(routing):
    # A request submitted while its replica decodes a long sequence and has free slots starts
    # at the end of the call in flight, as in sampler/loop.py, not when that sequence finishes.
    events, emitted = [], {}

    def schedule(t, fn):
        heapq.heappush(events, (t, len(events), fn))

    timeline = Timeline()
    sampler = SimSampler(
        MODEL,
        Workload(WorkloadConfig(max_new_tokens=2048, fixed_lengths=(1000, 10))),
        [make_admission("frontier")],
        replicas=1,
        slots=8,
        routing=routing,
        schedule=schedule,
        emit=lambda g, t: emitted.setdefault(g.request.uid, t),
        on_busy=lambda busy, t: None,
        timeline=timeline,
    )
    params = SamplingParams(max_new_tokens=2048)
    req = [Request(uid=u, index=u, prompt=(0,), group_size=2, params=params) for u in (0, 1)]
    sampler.submit([req[0]], 0.0)
    schedule(1.0, lambda t: sampler.submit([req[1]], t))
    while events:
        t, _, fn = heapq.heappop(events)
        fn(t)
    start = {s.args["uid"]: s.start for s in timeline.spans("sampler/prefill")}
    assert 1.0 <= start[1] <= 1.0 + MODEL.decode_a
    assert emitted[1] < 1.0 + 2 * MODEL.prefill_fixed + 11 * MODEL.decode_a < emitted[0]
