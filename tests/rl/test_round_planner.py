"""Round planning / tail batching: every prompt of an epoch trained exactly once, whatever the
completion order; rounds train exactly P0 groups except a declared final flush; resume is exact."""

import dataclasses
import itertools
import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rl.round_planner import RoundCut, RoundPlanner, TailConfig
from rl.types import Prompt, SamplingParams


class Source:
    """A checkpointable prompt source: epochs of `n` prompts (uid = position in the stream)."""

    def __init__(self, n: int, epochs: int | None = None):
        self.n, self.epochs, self.pos = n, epochs, 0

    def __iter__(self):
        return self

    def __next__(self) -> Prompt:
        if self.epochs is not None and self.pos >= self.n * self.epochs:
            raise StopIteration
        p = Prompt(uid=self.pos, tokens=(1 + self.pos % 7, 2), meta={"answer": str(self.pos)})
        self.pos += 1
        return p


def simulate_round(planner, r, rng):
    """Plays one round: random completion order, the cut keeps the first `target` to complete."""
    plan = planner.plan(r)
    cut = RoundCut(plan.target)
    order = rng.permutation(len(plan.prompts))
    trained = [plan.prompts[i].uid for i in order if cut.offer(plan.prompts[i].uid)]
    moved = planner.finish(plan, trained)
    return plan, trained, moved


@settings(max_examples=60, deadline=None)
@given(
    p0=st.integers(1, 9),
    n=st.integers(1, 60),
    eta=st.sampled_from([1.0, 1.25, 1.5, 2.0]),
    epochs=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_flush_trains_every_prompt_of_each_epoch_exactly_once(p0, n, eta, epochs, seed):
    rng = np.random.default_rng(seed)
    planner = RoundPlanner(
        TailConfig(enabled=True, eta=eta),
        groups_per_round=p0,
        prompts=Source(n),
        epoch_size=n,
    )
    trained_by_epoch = [[] for _ in range(epochs)]
    epoch, flushes = 0, 0
    for r in itertools.count():
        plan, trained, moved = simulate_round(planner, r, rng)
        assert len(trained) == plan.target
        assert plan.target == p0 or plan.kind == "flush"
        assert len(plan.prompts) <= math.ceil(eta * p0)
        if plan.kind in ("long", "flush"):
            assert plan.target == len(plan.prompts) and not moved
        else:
            assert [p.uid for p in moved] == sorted(set(p.uid for p in plan.prompts) - set(trained))
        flushes += plan.kind == "flush"
        assert all(u // n == epoch for u in trained)  # an epoch never trains the next one's prompts
        trained_by_epoch[epoch] += trained
        if planner.epoch_complete:
            assert sorted(trained_by_epoch[epoch]) == list(range(epoch * n, (epoch + 1) * n))
            epoch += 1
            if epoch == epochs:
                break
        assert r < 10 * n * epochs  # terminates
    assert flushes <= epochs


@settings(max_examples=40, deadline=None)
@given(
    p0=st.integers(1, 6),
    n=st.integers(1, 40),
    epoch_end=st.sampled_from(["flush", "carry"]),
    enabled=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_finite_source_is_trained_exactly_once_then_stops(p0, n, epoch_end, enabled, seed):
    rng = np.random.default_rng(seed)
    cfg = TailConfig(enabled=enabled, epoch_end=epoch_end)
    planner = RoundPlanner(cfg, groups_per_round=p0, prompts=Source(n, epochs=2), epoch_size=n)
    seen = []
    with pytest.raises(StopIteration):
        for r in range(10 * n + 10):
            plan, trained, _ = simulate_round(planner, r, rng)
            assert plan.target == p0 or plan.kind == "flush"
            seen += trained
    assert sorted(seen) == list(range(2 * n))


@settings(max_examples=40, deadline=None)
@given(
    p0=st.integers(1, 6),
    n=st.integers(2, 40),
    split=st.integers(0, 30),
    epoch_end=st.sampled_from(["flush", "carry"]),
    seed=st.integers(0, 2**16),
)
def test_resume_between_rounds_continues_the_same_queue_and_rounds(p0, n, split, epoch_end, seed):
    cfg = TailConfig(enabled=True, eta=1.5, epoch_end=epoch_end, long_max_new_tokens=64)

    def fresh(source):
        return RoundPlanner(cfg, groups_per_round=p0, prompts=source, epoch_size=n)

    def play(planner, rounds, first, rng):
        out = []
        for r in range(first, first + rounds):
            plan, trained, _ = simulate_round(planner, r, rng)
            out.append((plan.kind, [p.uid for p in plan.prompts], trained, planner.long_queue))
        return out

    rng = np.random.default_rng(seed)
    a = fresh(Source(n))
    play(a, split, 0, rng)
    state = json.loads(json.dumps({"planner": a.state_dict(), "pos": a.prompts.pos}))
    rng_state = rng.bit_generator.state
    expected = play(a, 12, split, rng)

    source = Source(n)
    source.pos = state["pos"]
    b = fresh(source)
    b.load_state_dict(state["planner"])
    rng.bit_generator.state = rng_state
    got = play(b, 12, split, rng)
    strip = lambda rows: [
        (k, p, t, [(q.uid, q.tokens, dict(q.meta)) for q in lq]) for k, p, t, lq in rows
    ]
    assert strip(got) == strip(expected)


def test_short_round_overprovisions_and_long_round_runs_the_queue():
    planner = RoundPlanner(
        TailConfig(enabled=True, eta=1.25, long_max_new_tokens=99),
        groups_per_round=8,
        prompts=Source(10**6),
    )
    plan = planner.plan(0)
    assert (plan.kind, len(plan.prompts), plan.target, plan.max_new_tokens) == (
        "short",
        10,
        8,
        None,
    )
    moved = planner.finish(plan, [p.uid for p in plan.prompts[2:]])  # the first two ran long
    assert [p.uid for p in moved] == [0, 1] and planner.long_queue == plan.prompts[:2]
    for r in (1, 2, 3):
        plan = planner.plan(r)
        assert plan.kind == "short"
        planner.finish(plan, [p.uid for p in plan.prompts[:8]])
    assert len(planner.long_queue) == 8
    plan = planner.plan(4)
    assert (plan.kind, len(plan.prompts), plan.target, plan.max_new_tokens) == ("long", 8, 8, 99)
    reqs = plan.requests(group_size=4, params=SamplingParams(max_new_tokens=7))
    assert [r.index for r in reqs] == list(range(8)) and {r.round for r in reqs} == {4}
    assert {r.params.max_new_tokens for r in reqs} == {99} and {r.group_size for r in reqs} == {4}
    planner.finish(plan, [p.uid for p in plan.prompts])
    assert planner.long_queue == ()


def test_response_overprovisioning_launches_more_samples_and_keeps_g():
    planner = RoundPlanner(
        TailConfig(enabled=True, response_eta=1.5), groups_per_round=2, prompts=Source(100)
    )
    reqs = planner.plan(0).requests(group_size=4, params=SamplingParams())
    assert {(r.group_size, r.keep, r.kept) for r in reqs} == {(6, 4, 4)}


def test_plain_rounds_when_disabled():
    planner = RoundPlanner(TailConfig(), groups_per_round=4, prompts=Source(6, epochs=1))
    plan = planner.plan(0)
    assert (plan.kind, [p.uid for p in plan.prompts], plan.target) == ("plain", [0, 1, 2, 3], 4)
    planner.finish(plan, [3, 2, 1, 0])
    plan = planner.plan(1)
    assert (plan.kind, plan.target) == ("flush", 2)  # a finite source's last partial round


def test_bad_use_is_refused_with_a_clear_error():
    with pytest.raises(ValueError, match="eta must be"):
        TailConfig(eta=0.9)
    with pytest.raises(ValueError, match="epoch_end"):
        TailConfig(epoch_end="drop")
    planner = RoundPlanner(TailConfig(enabled=True), groups_per_round=2, prompts=Source(100))
    plan = planner.plan(0)
    with pytest.raises(RuntimeError, match="unfinished"):
        planner.plan(1)
    with pytest.raises(RuntimeError, match="between rounds"):
        planner.state_dict()
    with pytest.raises(ValueError, match="expected exactly 2"):
        planner.finish(plan, [plan.prompts[0].uid])
    with pytest.raises(ValueError, match="unknown"):
        planner.finish(plan, [plan.prompts[0].uid, 999])
    stale = dataclasses.replace(plan)
    with pytest.raises(ValueError, match="not the open plan"):
        planner.finish(stale, [p.uid for p in plan.prompts[:2]])
    with pytest.raises(ValueError, match="keys"):
        planner.load_state_dict({"queue": []})
    cut = RoundCut(2)
    assert [cut.offer(k) for k in "abc"] == [True, True, False] and cut.full


def test_round_cuts_emit_the_first_target_and_name_the_rest_to_abort():
    from rl.round_planner import RoundCuts
    from rl.types import Completion, Group, Request

    def group(uid, round=0):
        r = Request(uid=uid, round=round, index=uid, prompt=(1,))
        c = Completion(
            uid=uid,
            round=round,
            sample=0,
            prompt=(1,),
            tokens=(2,),
            logprobs=(0.0,),
            versions=(0,),
            finish_reason="stop",
            reward=1.0,
        )
        return Group(request=r, completions=(c,))

    cuts = RoundCuts()
    requests = [group(u).request for u in range(4)]
    cuts.add(RoundCut(2), requests)
    with pytest.raises(ValueError, match="already has a cut"):
        cuts.add(RoundCut(1), requests)
    with pytest.raises(ValueError, match="one round"):
        cuts.add(RoundCut(1), [group(0, 1).request, group(1, 2).request])
    out, abort, refused = cuts.apply([group(2), group(9, round=5)])
    assert [g.request.uid for g in out] == [2, 9] and abort == [] and refused == 0
    out, abort, refused = cuts.apply([group(0), group(3)])  # 0 fills the cut, 3 is refused
    assert [g.request.uid for g in out] == [0] and refused == 1
    assert abort == [r.key for r in requests]
    out, abort, refused = cuts.apply([group(1)])  # the round's cut is gone: nothing to apply
    assert [g.request.uid for g in out] == [1] and abort == [] and refused == 0


def test_a_prompts_own_cap_lowers_its_requests_only():
    caps = [None, 3, 50]  # no cap, below the round's 8, above it
    prompts = iter(Prompt(uid=i, tokens=(1, 2), max_new_tokens=c) for i, c in enumerate(caps * 10))
    plan = RoundPlanner(TailConfig(), groups_per_round=3, prompts=prompts).plan(0)
    reqs = plan.requests(group_size=2, params=SamplingParams(max_new_tokens=8, temperature=0.7))
    assert [r.params.max_new_tokens for r in reqs] == [8, 3, 8]
    assert {r.params.temperature for r in reqs} == {0.7}  # the rest of the round's params kept
