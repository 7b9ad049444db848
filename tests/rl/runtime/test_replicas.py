"""Sampler replicas in one process (rl/runtime/replicas.py): routing, migration, elasticity.

Exactness: per-request randomness does not depend on the slot or the replica, so two replicas,
with or without migrating running sequences between them at every step, give the tokens and
log-probs of one engine, bitwise (float32, CPU, tiny model).
"""

import random

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh

from configs import base
from rl.admission import FCFS
from rl.elastic.migration import MigrationConfig, Move, check_moves, make_migration_policy
from rl.models import create_model, get_preset
from rl.round_planner import RoundCut
from rl.runtime.compose import Setup
from rl.runtime.factory import build_driver
from rl.runtime.replicas import ReplicaSampler
from rl.tasks.data import load_task
from rl.timeline import Timeline
from rl.types import Request, SamplingParams
from sampler.engine import Engine, EngineConfig

CFG = EngineConfig(max_slots=4, max_length=64, max_prefill_length=16, steps_per_call=2)


@pytest.fixture(scope="module")
def model():
    return create_model(get_preset("tiny", init_std=0.3), seed=0)


@pytest.fixture(scope="module")
def engines(model):
    """Engines on devices 0, 1, 2, built (and compiled) once for the module."""
    out = {}

    def on(device):
        if device not in out:
            mesh = Mesh(np.array([jax.devices()[device]]).reshape(1, 1), ("data", "tp"))
            out[device] = Engine(model, CFG, mesh=mesh)
        return out[device]

    return on


def requests(n=5, seed=0, lengths=None):
    rng = np.random.default_rng(seed)
    out = []
    for uid in range(n if lengths is None else len(lengths)):
        prompt = tuple(int(t) for t in rng.integers(0, 256, size=int(rng.integers(3, 12))))
        new = int(rng.integers(4, 40)) if lengths is None else lengths[uid]
        params = SamplingParams(temperature=1.0, max_new_tokens=new)
        out.append(Request(uid=uid, prompt=prompt, group_size=2, params=params))
    return out


def sample(
    model,
    engine_on,
    devices,
    policy="off",
    routing="round_robin",
    seed=0,
    fraction=0.25,
    lengths=None,
):
    engines = [engine_on(d) for d in devices]
    groups, timeline = [], Timeline()
    sampler = ReplicaSampler(
        engines,
        make_admission=FCFS,
        reward_fn=lambda r, c: 0.0,
        emit=groups.append,
        routing=routing,
        migration=make_migration_policy(  # the mechanism, forced on
            MigrationConfig(policy=policy, max_running_fraction=fraction), consumer=True
        ),
        timeline=timeline,
    )
    sampler.set_params(engines[0].load_params(model), 0)
    sampler.submit(requests(seed=seed, lengths=lengths))
    sampler.run_until_idle(max_steps=500)
    out = {
        g.request.key: [(c.tokens, c.logprobs, c.versions) for c in g.completions] for g in groups
    }
    assert len(out) == len(groups)  # each group once
    return out, sampler, timeline


@pytest.mark.slow  # ~20 s cold; the forced-migration equality below stays quick
@pytest.mark.parametrize("seed", [0, 1])
def test_replicas_and_migration_do_not_change_tokens(model, engines, seed):
    one, _, _ = sample(model, engines, [0], seed=seed)
    two, _, _ = sample(model, engines, [1, 2], seed=seed)
    moved, sampler, timeline = sample(model, engines, [1, 2], policy="always", seed=seed)
    assert one == two == moved
    stats = sampler.stats
    assert stats.migrations > 0 and stats.migrated_bytes > 0
    assert stats.groups_emitted == len(one) and sampler.busy_slots() == sampler.pending() == 0
    spans = timeline.spans("sampler/")
    moves = [s for s in spans if s.name == "migrate"]
    assert len(moves) == stats.migrations
    assert {s.args["replica"] for s in spans if s.lane.startswith("sampler/slot")} == {0, 1}
    finals = [s for s in spans if s.lane.startswith("sampler/slot") and not s.args.get("migrated")]
    assert len(finals) == 2 * len(one)  # one final span per sequence
    tokens = sum(len(t) for g in one.values() for t, _, _ in g)
    assert sum(s.args["tokens"] for s in spans if s.lane.startswith("sampler/slot")) == tokens


@pytest.mark.slow  # ~14 s cold; the forced-migration equality stays quick
def test_tail_consolidates_and_frees_a_replica(model, engines):
    # round-robin: each replica gets a long and a short group; the two long tails consolidate
    lengths = [40, 40, 4, 4]
    ref, _, _ = sample(model, engines, [0], lengths=lengths)
    got, sampler, timeline = sample(
        model, engines, [1, 2], policy="tail", fraction=0.5, lengths=lengths
    )
    assert got == ref
    assert sampler.stats.migrations >= 1
    assert sampler.idle_replicas() == [0, 1]
    # after each move the source replica ran nothing more of that round's tail
    for move in timeline.spans("sampler/"):
        if move.name == "migrate":
            later = [
                s
                for s in timeline.spans("sampler/slot")
                if s.args["replica"] == move.args["src"] and s.start > move.end
            ]
            assert later == []


def test_a_replica_that_frees_up_takes_the_requests_queued_on_another(model, engines):
    """Round-robin routing puts 4 long groups on replica 0 (2 fit its 4 slots; 2 wait) and 4
    short ones on replica 1, which is done long before: it takes replica 0's queued requests
    (work stealing at its step boundary, their routing moving with them), as a replica freed by
    migration does, and the tokens stay one engine's."""
    lengths = [40, 4] * 4  # uid i -> lengths[i]: even uids (replica 0's) long
    ref, _, _ = sample(model, engines, [0], lengths=lengths)
    got, sampler, timeline = sample(model, engines, [1, 2], lengths=lengths)
    assert got == ref
    on_1 = {s.args["uid"] for s in timeline.spans("sampler/slot") if s.args["replica"] == 1}
    assert on_1 & {0, 2, 4, 6}  # long requests routed to replica 0 ran on replica 1


@pytest.mark.slow  # ~16 s cold; the lent-replica take-back test stays quick
def test_add_and_remove_replicas_between_steps(model, engines):
    first = [engines(1)]
    groups = []
    sampler = ReplicaSampler(
        first, make_admission=FCFS, reward_fn=lambda r, c: 0.0, emit=groups.append
    )
    sampler.set_params(first[0].load_params(model), 0)
    reqs = requests(6)
    sampler.submit(reqs[:3])
    sampler.step()
    i = sampler.add_replica(engines(2))
    assert i == 1 and sampler.replica_slots == (4, 4)
    sampler.submit(reqs[3:])
    sampler.step()
    sampler.remove_replica(1)  # its requests are re-sampled on replica 0
    sampler.run_until_idle(max_steps=500)
    assert sorted(g.request.key for g in groups) == sorted(r.key for r in reqs)
    ref, _, _ = sample(model, engines, [0], seed=0)
    got = {
        g.request.key: [(c.tokens, c.logprobs, c.versions) for c in g.completions] for g in groups
    }
    assert {k: got[k] for k in ref} == ref
    with pytest.raises(ValueError, match="No live sampler replica 1"):
        sampler.remove_replica(1)
    with pytest.raises(ValueError, match="is the last one"):
        sampler.remove_replica(0)
    with pytest.raises(ValueError, match="at least one engine; received none"):
        ReplicaSampler([], make_admission=FCFS, reward_fn=lambda r, c: 0.0, emit=groups.append)


def test_a_lent_replica_takes_queued_work_and_is_taken_back_mid_rollout(model, engines):
    """Async borrowing's replica: it joins mid-rollout taking requests queued on the others, is
    taken back with samples half decoded, and they resume on replica 0 (re-prefilled): every
    group is delivered once, with the tokens one engine gives."""
    reqs = requests(8, lengths=[24] * 8)
    groups = []
    sampler = ReplicaSampler(
        [engines(0)], make_admission=FCFS, reward_fn=lambda r, c: 0.0, emit=groups.append
    )
    sampler.set_params(engines(0).load_params(model), 0)
    sampler.submit(reqs)  # 2 of 8 requests run (4 slots); 6 wait
    sampler.step()
    i = sampler.add_replica(engines(1), take_queued=True)
    assert sampler.routed[i] == 0 and sampler.routing.load[i] == 2  # moved, not routed anew
    for _ in range(3):
        sampler.step()
    assert sampler.loops[i].busy_slots() == 4
    sampler.take_back(i)
    assert sorted(sampler.loops) == [0] and sampler.stats.evicted_sequences == 4
    sampler.run_until_idle(max_steps=500)
    assert sorted(g.request.key for g in groups) == sorted(r.key for r in reqs)
    assert sampler.stats.resumed_sequences == 4
    alone = []
    ref = ReplicaSampler(
        [engines(2)], make_admission=FCFS, reward_fn=lambda r, c: 0.0, emit=alone.append
    )
    ref.set_params(engines(2).load_params(model), 0)
    ref.submit(reqs)
    ref.run_until_idle(max_steps=500)
    want = {g.request.key: g for g in alone}
    for g in groups:
        for c, w in zip(g.completions, want[g.request.key].completions, strict=True):
            assert c.tokens == w.tokens and c.versions == w.versions
            np.testing.assert_allclose(c.logprobs, w.logprobs, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="is the last one"):
        sampler.take_back(0)


@pytest.mark.parametrize("policy", ["off", "always"])
def test_a_full_round_cut_aborts_the_rest_on_every_replica(model, engines, policy):
    """Stepped in order, 2 replicas (round-robin: uids 0, 2, 4 on one, 1, 3, 5 on the other): the
    3 short groups fill the cut; the 3 long ones, running on either replica (or moved at every
    step), are aborted there at once and forgotten; the kept groups' tokens are one engine's."""
    lengths = [4, 4, 40, 40, 4, 40]
    ref, _, _ = sample(model, engines, [0], lengths=lengths)
    groups = []
    sampler = ReplicaSampler(
        [engines(1), engines(2)],
        make_admission=FCFS,
        reward_fn=lambda r, c: 0.0,
        emit=groups.append,
        migration=make_migration_policy(MigrationConfig(policy=policy)),
    )
    sampler.set_params(engines(1).load_params(model), 0)
    reqs = requests(lengths=lengths)
    cut = RoundCut(3)
    sampler.submit(reqs, cut)
    sampler.run_until_idle(max_steps=100)
    got = {
        g.request.key: [(c.tokens, c.logprobs, c.versions) for c in g.completions] for g in groups
    }
    assert sorted(got) == sorted(cut.kept) == [(0, 0), (0, 1), (0, 4)]
    assert got == {k: ref[k] for k in got}
    stats = sampler.stats
    assert (stats.groups_emitted, stats.groups_aborted, stats.groups_cut) == (3, 3, 0)
    assert sampler.routing.outstanding == {} and sampler.busy_slots() == 0
    assert (stats.migrations > 0) == (policy == "always")


def test_a_recalled_replica_is_emptied_into_the_others_and_released(model, engines):
    """A multiplexed pool's recall (on-demand `tail`): replica 1 stops taking work, its queue
    goes to replica 0 and its running group moves there once replica 0 has the slots; it is then
    idle and released. Tokens stay one engine's; `keep` undoes a recall."""
    lengths = [30, 30, 4, 30]  # round-robin: uids 0, 2 on replica 0; 1, 3 on replica 1
    ref, _, _ = sample(model, engines, [0], lengths=lengths)
    groups, timeline = [], Timeline()
    sampler = ReplicaSampler(
        [engines(1), engines(2)],
        make_admission=FCFS,
        reward_fn=lambda r, c: 0.0,
        emit=groups.append,
        migration=make_migration_policy(
            MigrationConfig(policy="tail", on_demand=True), consumer=True
        ),
        timeline=timeline,
    )
    sampler.set_params(engines(1).load_params(model), 0)
    reqs = requests(lengths=lengths)
    sampler.submit(reqs[:3])
    sampler.step()
    assert sampler.recall(1) and sampler.leaving == {1}
    assert not sampler.recall(1) and not sampler.recall(0)  # once; and one replica stays
    sampler.submit(reqs[3:])  # routed to replica 0 only
    assert sampler.routed[1] == 1 and sampler.routing.owner(reqs[3].key) == 0
    sampler.run_until_idle(max_steps=200)
    got = {
        g.request.key: [(c.tokens, c.logprobs, c.versions) for c in g.completions] for g in groups
    }
    assert got == ref
    moves = [s for s in timeline.spans("sampler/") if s.name == "migrate"]
    assert [(m.args["uid"], m.args["src"], m.args["dst"]) for m in moves] == [(1, 1, 0)]
    assert sampler.release_idle(1) and sampler.leaving == frozenset()
    assert sorted(sampler.loops) == [0]
    sampler.add_replica(engines(2))  # replica 2
    assert sampler.recall(2)
    sampler.keep(2)
    assert sampler.leaving == frozenset() and sampler.routing.alive == [0, 2]


class RandomMoves:
    """Random executable migration decisions (a policy for the property test)."""

    def __init__(self, seed, p):
        self.rng, self.p = random.Random(seed), p

    def moves(self, views):
        free, out = [v.free for v in views], []
        for i, v in enumerate(views):
            for r in v.running:
                if not r.movable or self.rng.random() >= self.p:
                    continue
                dsts = [j for j in range(len(views)) if j != i and free[j] >= r.sequences]
                if dsts:
                    j = self.rng.choice(dsts)
                    free[j] -= r.sequences
                    out.append(Move(r.key, i, j))
        check_moves(views, out)
        return out


@settings(max_examples=8, deadline=None)
@given(
    specs=st.lists(
        st.tuples(st.integers(1, 3), st.integers(1, 3), st.integers(1, 24)), min_size=1, max_size=7
    ),
    seed=st.integers(0, 2**16),
    p=st.sampled_from([0.3, 1.0]),
    replicas=st.sampled_from([2, 3]),
)
def test_every_request_finishes_once_and_no_slot_leaks(model, engines, specs, seed, p, replicas):
    """Random lengths, group sizes and migration decisions: each group is emitted once, each
    sample ends once (one final slot span), tokens are those of one engine, slots all come back."""
    rng = np.random.default_rng(seed)
    reqs = [
        Request(
            uid=uid,
            prompt=tuple(int(t) for t in rng.integers(0, 256, size=int(rng.integers(1, 9)))),
            group_size=g,
            keep=min(keep, g) if keep < g else 0,
            params=SamplingParams(temperature=1.0, max_new_tokens=n),
        )
        for uid, (g, keep, n) in enumerate(specs)
    ]

    def run(devices, policy):
        groups, timeline = [], Timeline()
        sampler = ReplicaSampler(
            [engines(d) for d in devices],
            make_admission=FCFS,
            reward_fn=lambda r, c: 0.0,
            emit=groups.append,
            migration=policy,
            timeline=timeline,
        )
        sampler.set_params(engines(devices[0]).load_params(model), 0)
        sampler.submit(reqs)
        sampler.run_until_idle(max_steps=400)
        return groups, sampler, timeline

    ref, _, _ = run([0], None)
    groups, sampler, timeline = run([1, 2, 0][:replicas], RandomMoves(seed, p))
    keys = [g.request.key for g in groups]
    assert sorted(keys) == sorted(r.key for r in reqs) and len(set(keys)) == len(keys)
    tokens = lambda gs: {g.request.key: [(c.sample, c.tokens) for c in g.completions] for g in gs}
    assert tokens(groups) == tokens(ref)
    for g in groups:  # every kept sample ended once, on one replica's slot
        finals = [
            s
            for s in timeline.spans("sampler/slot")
            if s.args["uid"] == g.request.uid and not s.args.get("migrated")
        ]
        ended = sorted(s.args["sample"] for s in finals)
        kept = sorted(c.sample for c in g.completions)
        assert sorted(set(ended)) == ended and set(kept) <= set(ended)
    for loop in sampler.loops.values():  # no slot leaked or left reserved (neither is free)
        view = loop.view()
        assert view.free == view.slots and not view.running
        assert not jax.device_get(loop._state.active).any()


def run_threads(replicas, migration, rounds=2):
    config = base.get_config("smoke")
    config.sft.max_steps = 0
    config.driver.mode, config.driver.batching = "cgp", "ordered"
    config.mesh.sampler_replicas = replicas
    config.engine.max_slots = 16  # room on each replica for the other's groups: moves happen
    config.elastic.migration = migration
    runtime, driver = build_driver(config, rounds=rounds)
    try:
        try:
            results = [driver.run_round(r) for r in range(rounds)]
        finally:
            driver.close()
        if replicas > 1:  # evaluation runs on the first replica, with the published weights
            setup = Setup.from_config(config)
            heldout = load_task(setup.data, setup.tokenizer, max_prompt_tokens=16).heldout
            published = runtime.weight_sync.publish(runtime.learner.params, version=-1).params
            assert 0 <= runtime.evaluate(published, heldout, k=1)["accuracy"] <= 1
        return results, jax.device_get(runtime.learner.state.params)
    finally:
        runtime.close()


@pytest.mark.slow  # ~27 s cold; the sampler-level forced-migration tests stay quick
def test_threads_runtime_with_forced_migration_equals_one_replica():
    """cgp + ordered: 2 replicas migrating at every step train on the tokens of 1 replica and
    reach the same parameters, bitwise (the run-level form of the exactness invariant)."""
    one, p1 = run_threads(1, "off")
    two, p2 = run_threads(2, "always")
    tokens = lambda rs: [
        [(g.request.uid, c.sample, c.tokens, c.logprobs) for g in r.groups for c in g.completions]
        for r in rs
    ]
    assert tokens(two) == tokens(one)
    for x, y in zip(jax.tree.leaves(p1), jax.tree.leaves(p2), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert sum(r.metrics["migrations"] for r in two) > 0
    assert all((r.metrics["migrated_bytes"] > 0) == (r.metrics["migrations"] > 0) for r in two)
    assert all(r.metrics["sequences"] == one[0].metrics["sequences"] for r in two)


def test_an_adoption_aborted_before_its_import_leaves_no_live_slot(model, engines):
    from sampler.loop import SamplerLoop

    groups = []
    a, b = (
        SamplerLoop(
            engines(d),
            engines(d).load_params(model),
            admission=FCFS(),
            reward_fn=lambda r, c: 0.0,
            emit=groups.append,
        )
        for d in (1, 2)
    )
    reqs = requests(2, lengths=[30, 30])
    a.submit(reqs)
    a.step()
    key = reqs[0].key
    slots = b.reserve(2)
    moved = a.handoff(key)
    b.adopt(moved, slots)
    with pytest.raises(ValueError, match=r"not a movable running request here"):
        b.handoff(key)  # adopted, not decoded here yet
    assert [r.key for r in b.abort([key])] == [key]
    a.run_until_idle(max_steps=100)
    b.run_until_idle(max_steps=100)
    assert [g.request.key for g in groups] == [reqs[1].key]
    for loop in (a, b):
        assert not jax.device_get(loop._state.active).any() and loop.view().free == 4


def test_a_handoff_through_host_memory_continues_with_the_same_tokens(model, engines):
    """sampler.transfer (what crosses processes under Ray): a request handed off mid-decode, its
    state pickled as host arrays, completes on another engine with the tokens and log-probs of an
    unmoved run, bitwise."""
    import pickle

    from sampler.loop import SamplerLoop
    from sampler.transfer import from_host, to_host

    def loop(device, out):
        engine = engines(device)
        return SamplerLoop(
            engine,
            engine.load_params(model),
            admission=FCFS(),
            reward_fn=lambda r, c: float(len(c.tokens)),
            emit=out.append,
        )

    reqs = requests(2, lengths=[30, 30])
    unmoved: list = []
    still = loop(1, unmoved)
    still.submit(reqs)
    still.run_until_idle(max_steps=100)
    moved: list = []
    a, b = loop(1, moved), loop(2, moved)
    a.submit(reqs)
    a.step()
    slots = b.reserve(2)
    host = pickle.loads(pickle.dumps(to_host(a.handoff(reqs[0].key))))
    assert isinstance(host.state.tokens, np.ndarray) and host.nbytes > 0
    b.adopt(from_host(host), slots)
    a.run_until_idle(max_steps=100)
    b.run_until_idle(max_steps=100)
    rows = lambda gs: sorted(
        (g.request.uid, c.sample, c.tokens, c.logprobs, c.versions, c.reward)
        for g in gs
        for c in g.completions
    )
    assert rows(moved) == rows(unmoved)
    assert a.handoff(reqs[0].key) is None  # no longer here: the caller gives its slots back


def run_tail(replicas, migration="off", bare_loop=False, rounds=3):
    """Tail batching (short rounds launch 6 prompts and train the first 4 complete groups, each of
    the first 4 of 5 samples to finish) for `rounds` rounds: short, short, long. `bare_loop`: the
    driver samples with the one replica's SamplerLoop itself, which cuts its rounds on its own.
    After every update, no replica's weights were donated by it (colocated smoke: replica 0 is
    on the learner's device). Returns the results, the parameters, the driver and every uid
    submitted."""
    config = base.get_config("smoke")
    config.sft.max_steps = 0
    config.driver.mode, config.driver.batching = "cgp", "ordered"
    config.driver.tail.enabled, config.driver.tail.eta = True, 1.5
    config.driver.tail.response_eta = 1.25
    config.mesh.sampler_replicas = replicas
    config.engine.max_slots = 16  # room on each replica for the other's groups: moves happen
    config.elastic.migration = migration
    runtime, driver = build_driver(config, rounds=rounds)
    try:
        loops = list(driver.sampler.loops.values())
        if bare_loop:
            (loop,) = loops
            loop.emit, driver.sampler = driver.queue.put, loop
        learner, update = runtime.learner, runtime.learner.update

        def updating():
            out = update()  # donates the learner's old buffers: no replica's weights among them
            for i, loop in enumerate(loops):
                weights = [loop._params, *(loop._pending_params or ())[:1]]
                deleted = [x for x in jax.tree.leaves(weights) if x.is_deleted()]
                assert not deleted, f"replica {i} decodes with {len(deleted)} donated arrays"
            return out

        learner.update = updating
        sampler, submitted = driver.sampler, []
        submit = sampler.submit

        def recording(requests, cut=None):
            requests = list(requests)
            submitted.extend(r.uid for r in requests)
            submit(requests, cut)

        sampler.submit = recording
        try:
            results = [driver.run_round(r) for r in range(rounds)]
        finally:
            driver.close()
        return results, jax.device_get(runtime.learner.state.params), driver, submitted
    finally:
        runtime.close()


def assert_each_prompt_trained_once_or_queued(results, driver, submitted):
    assert [r.kind for r in results] == ["short", "short", "long"]
    assert [len(r.groups) for r in results] == [4, 4, 4]
    assert {len(g.completions) for r in results for g in r.groups} == {4}
    trained = [g.request.uid for r in results for g in r.groups]
    queued = [p.uid for p in driver.planner.long_queue]
    assert len(set(trained)) == len(trained) and not set(trained) & set(queued)
    assert set(trained) | set(queued) == set(submitted) and len(submitted) == 6 + 6 + 4
    assert queued == []  # the long round trained the 4 prompts the short rounds cut
    stats = driver.sampler.stats  # each request emitted once, or aborted, or its copy cut
    assert stats.groups_emitted == len(trained)
    assert stats.groups_emitted + stats.groups_aborted + stats.groups_cut == len(submitted)
    assert driver.sampler.pending() == driver.sampler.busy_slots() == 0


@pytest.mark.slow  # a tail-batched round on a replica sampler (~12 s cold)
def test_tail_batching_with_one_replica_is_the_loops_own_cut():
    """One replica: the replica sampler trains the tokens and reaches the parameters of its
    SamplerLoop used alone (the loop's own cut), bitwise; the cut requests are forgotten."""
    results, params, driver, submitted = run_tail(1)
    alone, params_alone, driver_alone, _ = run_tail(1, bare_loop=True)
    assert_each_prompt_trained_once_or_queued(results, driver, submitted)
    tokens = lambda rs: [
        [(g.request.uid, c.sample, c.tokens, c.logprobs) for g in r.groups for c in g.completions]
        for r in rs
    ]
    assert tokens(results) == tokens(alone)
    for x, y in zip(jax.tree.leaves(params), jax.tree.leaves(params_alone), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    counts = lambda s: (s.groups_emitted, s.groups_aborted, s.groups_cut, s.samples_cut)
    assert counts(driver.sampler.stats) == counts(driver_alone.sampler.stats)  # the loop cut
    assert driver.sampler.routing.outstanding == {}


@pytest.mark.parametrize("migration", ["off", "always"])
def test_tail_batching_cuts_rounds_across_replicas(migration):
    """Two replicas (with a migration at every step: an abort reaches the request's current
    replica): every launched prompt is trained once or waits in the long queue, none lost, none
    doubled; the cut requests are aborted, not re-sampled, and nothing stays outstanding."""
    results, _, driver, submitted = run_tail(2, migration)
    assert_each_prompt_trained_once_or_queued(results, driver, submitted)
    sampler = driver.sampler
    assert min(sampler.routed.values()) > 0 and sampler.routing.outstanding == {}
    assert sum(loop.stats.groups_cut for loop in sampler.loops.values()) == 0  # cut in one place
    if migration == "always":
        assert sampler.stats.migrations > 0
