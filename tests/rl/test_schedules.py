"""Schedules: pure properties over random completion orders (no jax), and the threaded driver and the
simulator training the same groups in the same order with the same versions, for every mode."""

import collections
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rl.formation import FORMERS, FifoBatches, register_former
from rl.round_planner import RoundCuts, RoundPlanner, TailConfig
from rl.schedules import (
    MODES,
    SCHEDULES,
    Add,
    Begin,
    Publish,
    RoundDone,
    ScheduleConfig,
    Submit,
    Update,
    make_schedule,
    mode_fields,
)
from rl.schedules.asynchronous import fill_groups_per_update, window_warning
from rl.schedules.config import FILL
from rl.types import Completion, Group, Prompt, SamplingParams


def _prompts(n=None):
    for uid in itertools.count() if n is None else range(n):
        yield Prompt(uid=uid, tokens=(1, 2, 3))


class Scripted:
    """A clock-free runtime: `choices` pick which submitted request completes next, or let the
    learner finish its pending update / publish (so groups can arrive while the learner works).
    Every token is stamped with the version at submission: the oldest any token can have."""

    def __init__(self, cfg, rounds, n_prompts=None, epoch_size=None, reward=None):
        self.reward = reward or (lambda request, sample: float(sample % 2))
        self.planner = RoundPlanner(
            cfg.tail,
            groups_per_round=cfg.groups_per_round,
            prompts=_prompts(n_prompts),
            epoch_size=epoch_size,
        )
        self.cfg, self.rounds = cfg, rounds
        self.schedule = make_schedule(
            cfg,
            planner=self.planner,
            requests_of=lambda plan: plan.requests(
                group_size=cfg.group_size, params=SamplingParams()
            ),
            rounds=rounds,
        )
        self.cuts = RoundCuts()
        self.running = {}  # key -> (request, version at submission)
        self.learner = collections.deque()  # Update / Publish waiting to finish
        self.updates = []  # (Update, versions of its tokens)
        self.done = []
        self.version = 0
        self.next_round = 0

    def do(self, actions):
        for a in actions:
            if isinstance(a, Submit):
                if a.cut is not None:
                    self.cuts.add(a.cut, a.requests)
                for r in a.requests:
                    assert r.key not in self.running
                    self.running[r.key] = (r, self.version)
            elif isinstance(a, (Update, Publish)):
                self.learner.append(a)
            elif isinstance(a, RoundDone):
                self.done.append(a)
            else:
                assert isinstance(a, (Begin, Add))

    def finish_learner(self):
        a = self.learner.popleft()
        if isinstance(a, Update):
            self.updates.append(a)
            self.do(self.schedule.on_update_done())
        else:
            self.version = a.version
            self.do(self.schedule.on_published())
            if self.done and self.done[-1].plan.round + 1 == self.next_round:
                self.begin()

    def begin(self):
        if self.next_round >= self.rounds:
            return
        try:
            self.do(self.schedule.begin(self.next_round))
        except StopIteration:
            return
        self.next_round += 1

    def complete(self, key):
        request, version = self.running.pop(key)
        g = Group(
            request=request,
            completions=tuple(
                Completion(
                    uid=request.uid,
                    round=request.round,
                    sample=i,
                    prompt=request.prompt,
                    tokens=(5, 6),
                    logprobs=(0.0, 0.0),
                    versions=(version, version),
                    finish_reason="stop",
                    reward=self.reward(request, i),
                )
                for i in range(request.group_size)
            ),
        )
        emitted, abort, _ = self.cuts.apply([g])
        for k in abort:
            self.running.pop(k, None)  # aborted: its prompt goes back to the long queue
        for g in emitted:
            self.do(self.schedule.on_group(g))

    def run(self, choices):
        self.begin()
        choices = iter(choices)
        while self.running or self.learner:
            c = next(choices, 0)
            if self.learner and (not self.running or c % 3 == 0):
                self.finish_learner()
            elif self.running:
                keys = sorted(self.running)
                self.complete(keys[c % len(keys)])
        return self


def config(mode, **kw):
    mf = mode_fields(mode)
    tail = TailConfig(enabled=mf.pop("tail_enabled"), eta=1.5)
    fields = dict(groups_per_round=4, groups_per_update=2, group_size=2, tail=tail)
    fields.update(kw)
    return ScheduleConfig(**mf, **fields)


ALL = (
    "sync",
    "cgp+frontier+ordered",
    "cgp+fcfs+fifo",
    "sync+tail",
    "cgp+frontier+tail",
    "async+frontier+s0",
    "async+frontier+s1",
    "async+fcfs+s2",
)


def test_one_list_of_modes_and_names():
    assert MODES == ("sync", "cgp", "async") == tuple(SCHEDULES)
    for name in ALL:
        assert config(name).name == name
    with pytest.raises(ValueError, match=r"Mode 'async\+frontier'; expected"):
        mode_fields("async+frontier")
    # an async row's own groups per update: "+u<N>", or "+fill" (resolved against the slots)
    assert mode_fields("async+frontier+s4+u64")["groups_per_update"] == 64
    assert mode_fields("async+frontier+s4+fill")["groups_per_update"] == FILL
    for bad in ("async+frontier+s4+u0", "async+frontier+s4+x", "cgp+frontier+fifo+u8"):
        with pytest.raises(ValueError, match="expected"):
            mode_fields(bad)
    with pytest.raises(ValueError, match="tail.enabled=True; expected tail batching off"):
        ScheduleConfig(mode="async", tail=TailConfig(enabled=True))
    with pytest.raises(ValueError, match="max_staleness must be >= 0; received -1"):
        ScheduleConfig(mode="async", max_staleness=-1)


@pytest.mark.parametrize(
    "slots,g,s,r,factor,expected",
    [
        (580, 8, 1, 64, 1.0, 64),  # 37 groups needed: the smallest divisor of 64 above is 64
        (580, 8, 4, 64, 1.0, 16),  # 15 needed
        (580, 8, 4, 64, 3.8, 64),  # a long tail: 56 needed
        (580, 8, 0, 32, 4.0, 32),  # more than a round: the round
        (16, 8, 1, 8, 1.0, 1),
    ],
)
def test_fill_keeps_every_slot_busy_with_the_smallest_batch(slots, g, s, r, factor, expected):
    u = fill_groups_per_update(
        slots=slots, group_size=g, max_staleness=s, groups_per_round=r, tail_factor=factor
    )
    assert u == expected and r % u == 0
    if u < r:  # the window holds the slots' worth of sequences, and a smaller divisor would not
        assert (s + 1) * u * g >= slots * factor
        assert all((s + 1) * d * g < slots * factor for d in range(1, u) if r % d == 0)


def test_an_async_window_smaller_than_the_slots_is_named_in_the_log():
    small = config("async+frontier+s1", groups_per_round=64, groups_per_update=2, group_size=8)
    text = window_warning(small, slots=580)
    assert "(1 + 1) x 2 x 8 = 32 sequences in flight on 580 sampler slots" in text
    assert "groups_per_update=64" in text
    big = config("async+frontier+s4", groups_per_round=64, groups_per_update=16, group_size=8)
    assert window_warning(big, slots=580) is None  # 5 x 16 x 8 = 640 >= 580
    assert window_warning(config("cgp+frontier+ordered"), slots=580) is None


@settings(max_examples=60, deadline=None)
@given(
    s=st.integers(0, 3),
    u=st.sampled_from([1, 2, 4]),
    rounds=st.integers(1, 4),
    choices=st.lists(st.integers(0, 50), max_size=300),
)
def test_async_lag_is_bounded_and_every_planned_prompt_is_trained_once(s, u, rounds, choices):
    cfg = config(f"async+frontier+s{s}", groups_per_update=u)
    run = Scripted(cfg, rounds).run(choices)
    trained = [g.request.key for up in run.updates for g in up.batch]
    assert sorted(trained) == [(r, uid) for r in range(rounds) for uid in range(4 * r, 4 * r + 4)]
    for k, up in enumerate(run.updates):
        assert up.version == k  # a publish after every update
        assert [g.request.index for g in up.batch] == sorted(g.request.index for g in up.batch)
        lags = [up.version - v for g in up.batch for c in g.completions for v in c.versions]
        assert 0 <= min(lags) and max(lags) <= s
    assert [d.plan.round for d in run.done] == list(range(rounds))
    if s == 0:  # on-policy: every token of update k comes from version k
        assert all(
            max(up.version - v for g in up.batch for c in g.completions for v in c.versions) == 0
            for up in run.updates
        )


@settings(max_examples=40, deadline=None)
@given(
    mode=st.sampled_from(["sync+tail", "cgp+frontier+tail", "cgp+fcfs+tail"]),
    choices=st.lists(st.integers(0, 50), max_size=300),
)
def test_tail_rounds_lose_nothing_to_aborts_and_train_every_prompt_once(mode, choices):
    cfg = config(mode)
    run = Scripted(cfg, rounds=50, n_prompts=10, epoch_size=10).run(choices)
    trained = sorted(g.request.uid for up in run.updates for g in up.batch)
    assert trained == list(range(10))  # aborted prompts come back in long/flush rounds
    for d in run.done:  # round modes: every token of a round from the version that began it
        assert {v for g in d.trained for c in g.completions for v in c.versions} == {d.version}


def test_async_s0_trains_like_cgp_ordered_with_one_update_per_round():
    a = Scripted(config("async+frontier+s0", groups_per_update=4), 3).run([])
    c = Scripted(config("cgp+frontier+ordered", groups_per_update=4), 3).run([])
    key = lambda run: [(u.round, [g.request.key for g in u.batch], u.version) for u in run.updates]
    assert key(a) == key(c)


def _flat_unless_3(request, sample):
    """Two prompts in three have rewards all equal (zero variance); uid % 3 == 2 ones differ."""
    return float(sample % 2) if request.uid % 3 == 2 else float(request.uid % 2)


@settings(max_examples=40, deadline=None)
@given(
    mode=st.sampled_from(["sync", "cgp+frontier+ordered", "cgp+fcfs+ordered", "cgp+fcfs+fifo"]),
    u=st.sampled_from([1, 2, 4]),
    choices=st.lists(st.integers(0, 50), max_size=300),
)
def test_dynamic_sampling_refills_every_round_with_informative_groups(mode, u, choices):
    cfg = config(mode, groups_per_update=u, dynamic_sampling=True, max_oversample=4.0)
    run = Scripted(cfg, rounds=3, reward=_flat_unless_3).run(choices)
    # Prompts are drawn in uid order and a refill is drawn only while launched - discarded < R,
    # so round r draws exactly up to its 4th informative uid (2, 5, 8, 11, ...): 12 prompts per
    # round, whatever the completion order.
    assert [d.plan.round for d in run.done] == [0, 1, 2]
    for r, d in enumerate(run.done):
        assert [p.uid for p in d.plan.prompts] == list(range(12 * r, 12 * r + 12))
        assert sorted(g.request.uid for g in d.trained) == [12 * r + 2 + 3 * k for k in range(4)]
        assert sorted(g.request.uid for g in d.discarded) == [
            uid for uid in range(12 * r, 12 * r + 12) if uid % 3 != 2
        ]
        assert all(len(set(g.rewards)) == 1 for g in d.discarded)
    assert [len(up.batch) for up in run.updates] == [u] * (12 // u)
    if mode != "cgp+fcfs+fifo":  # logical order: batch k is the k-th U informative groups
        trained = [g.request.uid for up in run.updates for g in up.batch]
        assert trained == list(range(2, 36, 3))


def test_dynamic_sampling_cgp_ordered_performs_the_updates_of_sync():
    key = lambda run: [(u.round, [g.request.key for g in u.batch], u.version) for u in run.updates]
    runs = [
        Scripted(config(m, dynamic_sampling=True), 3, reward=_flat_unless_3).run(c)
        for m, c in [("sync", []), ("cgp+frontier+ordered", [7, 1, 3] * 40)]
    ]
    assert key(runs[0]) == key(runs[1]) and len(runs[0].updates) == 6


@pytest.mark.parametrize("mode", ["sync", "cgp+frontier+ordered", "cgp+fcfs+fifo"])
def test_dynamic_sampling_stops_at_the_oversampling_budget(mode):
    # R = 4, max_oversample 1.5: at most 6 prompts a round. Informative uids 2, 5 (round 0) and
    # 8, 11 (round 1): each round trains the 2 it found, in one update; all-flat rounds train none.
    cfg = config(mode, dynamic_sampling=True, max_oversample=1.5)
    run = Scripted(cfg, rounds=2, reward=_flat_unless_3).run([2, 5] * 50)
    assert [len(d.plan.prompts) for d in run.done] == [6, 6]
    assert [sorted(g.request.uid for g in d.trained) for d in run.done] == [[2, 5], [8, 11]]
    assert [len(d.discarded) for d in run.done] == [4, 4]
    assert [u.round for u in run.updates] == [0, 1]
    flat = Scripted(cfg, rounds=2, reward=lambda request, sample: 1.0).run([])
    assert [(len(d.plan.prompts), d.trained) for d in flat.done] == [(6, ()), (6, ())]
    assert flat.updates == [] and flat.schedule.version == 2  # rounds still end and publish


def test_dynamic_sampling_config_errors():
    with pytest.raises(ValueError, match="dynamic_sampling=True with mode='async'"):
        config("async+frontier+s0", dynamic_sampling=True)
    with pytest.raises(ValueError, match="tail.enabled=True; expected mode sync or cgp without"):
        config("sync+tail", dynamic_sampling=True)
    with pytest.raises(ValueError, match="group_size=1; expected group_size >= 2"):
        config("sync", dynamic_sampling=True, group_size=1)
    with pytest.raises(ValueError, match="max_oversample must be a finite number >= 1"):
        config("sync", dynamic_sampling=True, max_oversample=0.5)
    FORMERS["test_only_former"] = FifoBatches
    try:
        with pytest.raises(ValueError, match="batching='test_only_former'; expected 'fifo' or"):
            config("cgp+fcfs+test_only_former", dynamic_sampling=True)
    finally:
        del FORMERS["test_only_former"]


def test_a_registered_former_is_used_by_cgp():
    made = []

    @register_former("test_recording")
    def recording(size, num_groups=None):
        made.append((size, num_groups))
        return FifoBatches(size, num_groups)

    try:
        run = Scripted(config("cgp+frontier+test_recording"), 2).run([3, 1, 2])
    finally:
        del FORMERS["test_recording"]
    assert made == [(1, 1), (2, 4), (2, 4)]  # the config's check, then one former per round
    assert len(run.updates) == 4


# --------------------------------------------------------------------- driver vs simulator


def _trace(updates):
    return [(u.round, [g.request.key for g in u.batch], u.version) for u in updates]


@pytest.fixture(scope="module")
def tiny():
    from rl.models import create_model, get_preset

    return create_model(get_preset("tiny", init_std=0.3), seed=0)


def _lifo_policy():
    from rl.admission import Frontier

    class LastFirst(Frontier):  # admits the highest logical index first: a non-logical order
        def next(self, free_slots):
            if not self._waiting:
                return None
            last = max(self._waiting.values(), key=lambda e: (e[1].round, e[1].index))[1]
            return self.remove(last.key) if last.group_size <= free_slots else None

    return LastFirst


CROSS = (
    "sync",
    "cgp+frontier+ordered",
    "cgp+test_lastfirst+fifo",
    "cgp+test_lastfirst+ordered",
    "sync+tail",
    "cgp+test_lastfirst+tail",
    "async+frontier+s0",
    "async+frontier+s1",
)


@pytest.mark.parametrize("mode", CROSS)
def test_driver_and_simulator_train_the_same_groups_in_the_same_order(mode, tiny):
    """One group in flight at a time (G slots): the completion order is the admission order in
    both runtimes; the schedule must then give the same updates, batches and versions."""
    from learner.config import LearnerConfig, OptimizerConfig
    from learner.learner import Learner
    from learner.mesh import MeshConfig, make_meshes
    from learner.publish import DevicePutSync
    from rl.admission import POLICIES
    from rl.driver import DriverConfig
    from rl.elastic.stage import StageModel
    from rl.runtime.threads import threaded_driver
    from rl.sim.simulator import SimConfig, Simulator
    from rl.sim.workload import Workload, WorkloadConfig
    from sampler.engine import Engine, EngineConfig

    R, U, G, rounds = 4, 2, 2, 3
    mf = mode_fields(mode)
    tail = TailConfig(enabled=mf.pop("tail_enabled"), eta=1.5)
    POLICIES.setdefault("test_lastfirst", _lifo_policy())
    shape = dict(groups_per_round=R, groups_per_update=U, group_size=G, tail=tail, epoch_size=12)
    lm, sm = make_meshes(MeshConfig(learner_devices=1, sampler_devices=1))
    learner = Learner(
        tiny, LearnerConfig(optimizer=OptimizerConfig(lr=1e-2), micro_batch_rows=U * G), mesh=lm
    )
    engine = Engine(
        tiny,
        EngineConfig(max_slots=G, max_length=32, max_prefill_length=16, steps_per_call=2),
        mesh=sm,
    )
    cfg = DriverConfig(**mf, **shape, sampling=SamplingParams(max_new_tokens=6))
    driver = threaded_driver(
        cfg,
        engine=engine,
        learner=learner,
        weight_sync=DevicePutSync(learner.params, sm),
        prompts=_prompts(),
        reward_fn=lambda req, c: float(c.tokens[0] % 2),
        rounds=rounds,
    )
    d_updates, arrivals = [], []
    driver.on_update = d_updates.append
    driver.on_group = lambda g: arrivals.append(g.request.key)
    try:
        results = [driver.run_round(r) for r in range(rounds)]
    finally:
        driver.close()
    s = mf["max_staleness"]
    for u in d_updates:  # the real tokens' versions: never more than s behind
        lags = [u.version - v for g in u.batch for c in g.completions for v in c.versions]
        assert 0 <= min(lags) and max(lags) <= s

    sim = Simulator(
        SimConfig(**mf, **shape, max_new_tokens=6, slots=G),
        StageModel(decode_a=0.01, prefill_fixed=0.1, learner_fixed=0.3, update_s=0.2),
        Workload(WorkloadConfig(max_new_tokens=6, median_tokens=4)),
        planner=RoundPlanner(tail, groups_per_round=R, prompts=_prompts(), epoch_size=12),
    )
    s_updates, s_arrivals = [], []
    sim.on_update = s_updates.append
    emit = sim.sampler._emit
    sim.sampler._emit = lambda g, t: (s_arrivals.append(g.request.key), emit(g, t))
    result = sim.run(rounds)

    assert s_arrivals[: len(arrivals)] == arrivals  # the premise: the same completion order
    assert len(result.rounds) == rounds
    assert _trace(s_updates) == _trace(d_updates)
    assert [(r.kind, float(r.version)) for r in results] == [
        (m["kind"], m["version"]) for m in result.rounds
    ]
    assert driver.version == sim.schedule.version
