"""Pipelines sharing a pool of sampler replicas (rl/runtime/pool.py): each pipeline of a
multiplexed run trains bitwise what it trains alone, however its replicas move; under random
lengths and random scheduler decisions (moves and recalls) every request of every pipeline finishes
once, with its own pipeline's weights, and no slot, replica or stopped replica's memory is kept; a
waiting queue recalls a replica whose rollout migrates off it; a failing pipeline stops alone, the
others finish, and every replica is vacant at the end; a replica that cannot join a pipeline is
retired and the pool goes on without it."""

import gc
import random
import threading
import time
import weakref

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh

from configs import smoke
from rl.admission import FCFS
from rl.elastic.migration import MigrationConfig, make_migration_policy
from rl.elastic.multiplex import MultiplexConfig, MultiplexPolicy
from rl.models import create_model, get_preset
from rl.rewards import REWARDS, register_reward
from rl.run import train
from rl.runtime.pool import ReplicaPool
from rl.runtime.replicas import ReplicaSampler
from rl.types import Request, SamplingParams
from sampler.engine import Engine, EngineConfig
from tests.host_arrays import assert_bitwise_equal

REPLICAS = 3


@pytest.fixture(scope="module", autouse=True)
def parity_reward():
    """Rewards with variance (an untrained model never gets an addition right): updates move."""
    REWARDS.pop("test_pool_parity", None)
    register_reward("test_pool_parity")(lambda request, text: float(len(text) % 2))
    yield
    REWARDS.pop("test_pool_parity", None)


def config(workdir, seed, mode="cgp", replicas=REPLICAS, migration="off"):
    c = smoke.get_config()
    c.elastic.migration = migration  # in a pool `tail` is on demand; alone it is off
    c.workdir, c.seed, c.rounds = str(workdir), seed, 3
    c.sft.max_steps = 0
    c.task.reward = "test_pool_parity"
    c.mesh.sampler_replicas = replicas
    c.driver.mode, c.driver.batching, c.driver.max_staleness = mode, "ordered", 0
    return c


class Restless(MultiplexPolicy):
    """Sends every idle replica to the next pipeline, demand or not: replicas switch pipelines
    as often as they can, mid-round included."""

    def __init__(self, pipelines):
        super().__init__(MultiplexConfig(), switch_s=0.0)
        self.pipelines = pipelines

    def replica_for(self, views, owner):
        """The next pipeline after `owner` that is sampling (a vacant replica's owner is last)."""
        live = [i for i in range(self.pipelines) if i != owner and views[i].replicas]
        return min(live, key=lambda i: (i - owner) % len(views), default=None)


def multiplexed(configs, policy=None):
    """The configs' runs at once, one thread each, on one pool; (summaries or errors, pool)."""
    replicas = configs[0].mesh.sampler_replicas
    pool = ReplicaPool([str(i) for i in range(len(configs))], replicas=replicas, policy=policy)
    out = [None] * len(configs)

    def run(i):
        try:
            out[i] = train(configs[i], stdout=False, pool=pool.member(i))
        except Exception as e:  # noqa: BLE001 (reported by the test)
            out[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(configs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    pool.close()
    return out, pool


@pytest.mark.parametrize(
    "mode, pipelines, migration",
    [
        ("cgp", 2, "off"),
        pytest.param("sync", 2, "tail", marks=pytest.mark.slow),
        pytest.param("async", 2, "tail", marks=pytest.mark.slow),  # max_staleness 0
        pytest.param("cgp", 3, "off", marks=pytest.mark.slow),
    ],
)
def test_each_multiplexed_pipeline_trains_bitwise_its_solo_run(
    tmp_path, mode, pipelines, migration
):
    seeds, replicas = range(pipelines), pipelines + 1  # one replica more than the homes: it moves
    runs, pool = multiplexed(
        [config(tmp_path / f"mux{s}", s, mode, replicas, migration) for s in seeds],
        policy=Restless(pipelines),
    )
    assert pool.error is None
    assert all(not isinstance(r, BaseException) for r in runs), runs
    assert sum(s.moves_in for s in pool.stats) > 0  # replicas did switch pipelines
    assert all(h is None for h in pool.holder)  # every replica vacant once the runs ended
    for seed, mux in zip(seeds, runs, strict=True):
        solo = train(
            config(tmp_path / f"solo{seed}", seed, mode, replicas, migration), stdout=False
        )
        assert_bitwise_equal(mux["state"], solo["state"])
        assert [r["reward_mean"] for r in solo["rounds"]] == [
            r["reward_mean"] for r in mux["rounds"]
        ]
        assert solo["rounds"][-1]["grad_norm"] > 0  # the parameters did move


@pytest.mark.slow  # end-to-end: 2 learner workers, 3 replica hosts, then 2 threaded solo runs
@pytest.mark.parametrize(
    "mode, policy",
    [("cgp", "restless"), ("async", "restless"), ("cgp", "random")],  # async: max_staleness 0
)
def test_multiplexed_under_ray_each_pipeline_trains_bitwise_its_solo_run(
    ray_cluster, tmp_path, mode, policy
):
    """Under Ray the pool's replica meshes are host actors holding a replica of every pipeline
    (rl/runtime/ray_host.py), moved as in threads (random: recalled mid-rollout too); each
    pipeline trains what it trains alone (the threaded solo run: runtime=ray equals threads
    bitwise)."""
    configs = [config(tmp_path / "mux" / str(s), s, mode) for s in (0, 1)]
    for c in configs:
        c.runtime = "ray"
    runs, pool = multiplexed(configs, policy=Restless(2) if policy == "restless" else Random(0))
    assert pool.error is None
    assert all(not isinstance(r, BaseException) for r in runs), runs
    assert sum(s.moves_in for s in pool.stats) > 0  # replicas did switch pipelines
    assert all(h is None for h in pool.holder)
    for seed, mux in enumerate(runs):
        solo = train(config(tmp_path / f"solo{seed}", seed, mode), stdout=False)
        assert_bitwise_equal(mux["state"], solo["state"])
        assert [r["reward_mean"] for r in solo["rounds"]] == [
            r["reward_mean"] for r in mux["rounds"]
        ]


def test_a_failing_pipeline_stops_alone_and_the_others_finish(tmp_path):
    ok, broken = config(tmp_path / "ok", 0), config(tmp_path / "broken", 1)
    broken.learner.optimizer.lr = 1e30  # the first update's parameters give a NaN loss
    runs, pool = multiplexed([ok, broken], policy=Restless(2))
    assert isinstance(runs[1], FloatingPointError), runs[1]
    assert not isinstance(runs[0], BaseException) and len(runs[0]["rounds"]) == 3
    assert pool.error is None and all(h is None for h in pool.holder)


@pytest.mark.slow  # end-to-end under Ray: 2 learner workers, 3 replica hosts
def test_under_ray_a_failing_pipeline_stops_alone_and_the_others_finish(ray_cluster, tmp_path):
    ok, broken = config(tmp_path / "sweep" / "ok", 0), config(tmp_path / "sweep" / "broken", 1)
    broken.learner.optimizer.lr = 1e30  # the first update's parameters give a NaN loss
    for c in (ok, broken):
        c.runtime = "ray"
    runs, pool = multiplexed([ok, broken], policy=Restless(2))
    assert isinstance(runs[1], FloatingPointError), runs[1]
    assert not isinstance(runs[0], BaseException) and len(runs[0]["rounds"]) == 3
    assert pool.error is None and all(h is None for h in pool.holder)


class Random(MultiplexPolicy):
    """Sends an idle replica to a random sampling pipeline, or keeps it (None), demand or not;
    recalls a random replica (or none) whenever a queue waits."""

    def __init__(self, seed):
        super().__init__(MultiplexConfig(), switch_s=0.0)
        self.rng = random.Random(seed)  # (only the pool's thread draws)

    def replica_for(self, views, owner):
        live = [i for i in range(len(views)) if i != owner and views[i].replicas]
        return self.rng.choice([*live, None])

    def recall(self, views, seats):
        held = [s.index for s in seats if s.pipeline is not None and not s.home]
        return self.rng.choice([*held, None, None])


@pytest.fixture(scope="module")
def models():
    """Two pipelines' policies: the same shapes, different weights."""
    return [create_model(get_preset("tiny", init_std=0.3), seed=s) for s in (0, 1)]


@pytest.fixture(scope="module")
def engines(models):
    """An Engine on each of the pool's replica devices (0, 1, 2), shared by the pipelines (one
    shape of programs: the same compiled ones serve both)."""
    cfg = EngineConfig(max_slots=4, max_length=48, max_prefill_length=16, steps_per_call=2)
    return [
        Engine(models[0], cfg, mesh=Mesh(np.array([d]).reshape(1, 1), ("data", "tp")))
        for d in jax.devices()[:REPLICAS]
    ]


def workload(specs, pipeline):
    rng = np.random.default_rng(pipeline)
    return [
        Request(
            uid=uid,
            prompt=tuple(int(t) for t in rng.integers(0, 256, size=int(rng.integers(1, 9)))),
            group_size=g,
            params=SamplingParams(temperature=1.0, max_new_tokens=n),
        )
        for uid, (g, n) in enumerate(specs)
    ]


def tokens(groups):
    return {g.request.key: [(c.sample, c.tokens) for c in g.completions] for g in groups}


VERSIONS = (3, 7)  # each pipeline's weights' version


def solo_tokens(models, engines, reqs):
    """Each pipeline's requests sampled alone on one replica, in its own weights: their tokens."""
    out = []
    for p in (0, 1):
        groups = []
        alone = ReplicaSampler(
            [engines[0]], make_admission=FCFS, reward_fn=lambda r, c: 0.0, emit=groups.append
        )
        alone.set_params(engines[0].load_params(models[p]), VERSIONS[p])
        alone.submit(reqs[p])
        alone.run_until_idle(max_steps=2000)
        alone.close()
        out.append(tokens(groups))
    return out


def pooled_samplers(pool, models, engines, groups, *, migration=True):
    """Each of the two pipelines' ReplicaSampler on the replicas it claims from `pool`, in its own
    weights, emitting into groups[p], attached to the pool; `migration`: tail on demand (recalled
    replicas emptied, joined ones spread to)."""
    samplers = []
    for p in (0, 1):
        claimed = pool.claim(p)
        sampler = ReplicaSampler(
            [engines[r] for r in claimed],
            spare=[e for r, e in enumerate(engines) if r not in claimed],
            make_admission=FCFS,
            reward_fn=lambda r, c: 0.0,
            emit=groups[p].append,
            migration=make_migration_policy(
                MigrationConfig(policy="tail", on_demand=True), consumer=True
            )
            if migration
            else None,
        )
        sampler.set_params(engines[0].load_params(models[p]), VERSIONS[p])
        pool.attach(p, sampler, engines, claimed)
        samplers.append(sampler)
    return samplers


@settings(max_examples=8, deadline=None)
@given(
    specs=st.lists(
        st.lists(st.tuples(st.integers(1, 3), st.integers(1, 30)), min_size=1, max_size=8),
        min_size=2,
        max_size=2,
    ),
    seed=st.integers(0, 2**16),
)
def test_random_moves_finish_every_request_once_in_its_own_weights_and_keep_nothing(
    models, engines, specs, seed
):
    reqs = [workload(specs[p], p) for p in (0, 1)]
    solo = solo_tokens(models, engines, reqs)

    pool = ReplicaPool(["a", "b"], replicas=REPLICAS, policy=Random(seed))
    groups, seen = ([], []), []
    samplers = pooled_samplers(pool, models, engines, groups)
    try:
        for p, sampler in enumerate(samplers):
            sampler.start()
            sampler.submit(reqs[p])
        deadline = time.monotonic() + 120
        while any(len(groups[p]) < len(reqs[p]) for p in (0, 1)):
            assert time.monotonic() < deadline, [len(g) for g in groups]
            for sampler in samplers:
                assert sampler.error is None
                seen += [weakref.ref(loop) for loop in list(sampler.loops.values())]
            time.sleep(0.002)
        pool.close()  # no more moves: what follows looks at a still pool
        for p, sampler in enumerate(samplers):
            assert tokens(groups[p]) == solo[p]  # once each, the tokens of its own weights alone
            assert len(groups[p]) == len(reqs[p])
            assert {v for g in groups[p] for c in g.completions for v in c.versions} == {
                VERSIONS[p]
            }
            held = {r for r in range(REPLICAS) if pool.holder[r] == p}
            live = sampler.loops.values()
            assert {engines.index(loop.engine) for loop in live} == held  # no replica lost
            for loop in live:  # no slot leaked or left reserved
                view = loop.view()
                assert view.free == view.slots and not view.running
        assert pool.error is None
        gc.collect()  # a replica that moved away keeps no KV cache or weights behind
        live = {id(loop) for sampler in samplers for loop in sampler.loops.values()}
        assert all(ref() is None or id(ref()) in live for ref in seen)
    finally:
        pool.close()  # (idempotent)
        for p, sampler in enumerate(samplers):
            sampler.close()
            pool.leave(p)
    assert all(h is None for h in pool.holder)


class Last(MultiplexPolicy):
    """The learner goes to the highest-numbered pipeline waiting."""

    def __init__(self):
        super().__init__(MultiplexConfig(), switch_s=0.0)

    def learner_for(self, views, last):
        ready = [i for i, v in enumerate(views) if v.waiting_since < float("inf")]
        return max(ready, default=None)


def test_pipelines_take_turns_on_the_learner_in_the_policys_order():
    pool = ReplicaPool(["a", "b", "c"], replicas=3, policy=Last())
    order, inside, entered = [], [], threading.Event()
    release = threading.Event()

    def operation(p):
        with pool.learner_turn(p, "update"):
            inside.append(p)
            assert len(inside) == 1, inside  # one operation at a time on the learner's devices
            order.append(p)
            if p == 0:
                entered.set()
                release.wait(10)
            inside.remove(p)

    first = threading.Thread(target=operation, args=(0,))
    first.start()
    assert entered.wait(10)
    waiting = [threading.Thread(target=operation, args=(p,)) for p in (1, 2)]
    for t in waiting:
        t.start()
    deadline = time.monotonic() + 10
    while pool.learner_queue() != [1, 2]:  # both queued behind pipeline 0
        assert time.monotonic() < deadline
        time.sleep(0.001)
    release.set()
    for t in [first, *waiting]:
        t.join(10)
    pool.close()
    assert order == [0, 2, 1]  # the policy's pick first, not the first come
    assert pool.stats[1].learner_wait_s > pool.stats[2].learner_wait_s > 0
    assert all(s.learner_s > 0 for s in pool.stats)


def test_a_waiting_queue_recalls_a_replica_whose_rollout_moves_off_it(models, engines):
    """Pipeline 0 holds replicas 0 and 2, a long group running on each; pipeline 1's queue waits
    on its one replica. The pool recalls replica 2: pipeline 0's on-demand `tail` moves its
    group to replica 0, and the emptied replica goes to pipeline 1. Each pipeline's tokens are
    its solo run's. The samplers are stepped here, pipeline 1's only once the move is done, so
    its queue waits whatever the machine's speed."""
    reqs = [workload([(2, 40), (2, 40)], 0), workload([(2, 30)] * 6, 1)]
    solo = solo_tokens(models, engines, reqs)
    pool = ReplicaPool(["a", "b"], replicas=REPLICAS)
    groups = ([], [])
    samplers = pooled_samplers(pool, models, engines, groups)
    assert pool.holder == [0, 1, 0]

    def until(done, step=lambda: None):
        deadline = time.monotonic() + 60
        while not done():
            assert time.monotonic() < deadline and pool.error is None
            step()
            time.sleep(0.005)

    try:
        samplers[0].submit(reqs[0])
        samplers[0].step()  # one group running on each of its replicas
        samplers[1].submit(reqs[1])  # 12 sequences for its 4 slots: its queue waits
        until(lambda: samplers[0].leaving == {1})  # replica 2 is pipeline 0's replica 1
        until(lambda: pool.holder[2] == 1, samplers[0].step)
        for sampler in samplers:
            sampler.run_until_idle(max_steps=2000)
        pool.close()
        assert [tokens(g) for g in groups] == solo
        assert pool.stats[0].recalls == 1 and samplers[0].stats.migrations == 1
        assert pool.stats[0].moves_out == 1 and pool.stats[1].moves_in == 1
        assert pool.holder == [0, 1, 1] and pool.error is None
    finally:
        pool.close()
        for p, sampler in enumerate(samplers):
            sampler.close()
            pool.leave(p)


class ToSecond(MultiplexPolicy):
    """Sends every idle replica to pipeline 1."""

    def __init__(self):
        super().__init__(MultiplexConfig(), switch_s=0.0)

    def replica_for(self, views, owner):
        return 1 if owner != 1 else None

    def recall(self, views, seats):
        return None


def test_a_replica_that_cannot_join_is_retired_and_the_pool_goes_on(models, engines):
    """Replica 2 starts with pipeline 0 and is sent to pipeline 1, whose sampler cannot start it
    (as when its weights do not fit): the pool retires it, logs why, counts it against pipeline
    1, never offers it again, and every request of both pipelines still finishes with its solo
    tokens."""
    reqs = [workload([(2, 12)] * 3, 0), workload([(2, 12)] * 4, 1)]
    solo = solo_tokens(models, engines, reqs)
    pool = ReplicaPool(["a", "b"], replicas=REPLICAS, policy=ToSecond())
    groups, tries = ([], []), []
    samplers = pooled_samplers(pool, models, engines, groups, migration=False)
    assert pool.holder == [0, 1, 0]
    real = samplers[1].add_replica  # (the pool looks the method up at each move)

    def cannot_start_replica_2(engine, **kw):
        tries.append(engines.index(engine))
        if engine is engines[2]:
            raise ValueError("replica 2: the weights do not fit")
        return real(engine, **kw)

    samplers[1].add_replica = cannot_start_replica_2
    try:
        for p, sampler in enumerate(samplers):
            sampler.start()
            sampler.submit(reqs[p])
        deadline = time.monotonic() + 120
        while any(len(groups[p]) < len(reqs[p]) for p in (0, 1)) or 2 not in pool.retired:
            assert time.monotonic() < deadline, ([len(g) for g in groups], pool.retired)
            assert all(s.error is None for s in samplers) and pool.error is None
            time.sleep(0.005)
        time.sleep(20 * 0.005)  # more ticks: the retired replica is not offered again
        pool.close()
        assert [tokens(g) for g in groups] == solo
        assert tries == [2] and list(pool.retired) == [2]
        assert "the weights do not fit" in str(pool.retired[2])
        assert pool.stats[1].failed_joins == 1 and pool.stats[0].moves_out == 1
        assert pool.holder == [0, 1, None] and pool.error is None
        assert engines[2] not in [loop.engine for s in samplers for loop in s.loops.values()]
    finally:
        pool.close()
        for p, sampler in enumerate(samplers):
            sampler.close()
            pool.leave(p)
