"""Pipelines sharing a pool of sampler replicas (rl/runtime/pool.py): each pipeline of a
multiplexed run trains bitwise what it trains alone, however its replicas move; a failing pipeline
stops alone, the others finish, and every replica is vacant at the end."""

import threading

import jax
import numpy as np
import pytest

from configs import smoke
from rl.elastic.multiplex import MultiplexConfig, MultiplexPolicy
from rl.rewards import REWARDS, register_reward
from rl.run import train
from rl.runtime.pool import ReplicaPool

REPLICAS = 3


@pytest.fixture(scope="module", autouse=True)
def parity_reward():
    """Rewards with variance (an untrained model never gets an addition right): updates move."""
    REWARDS.pop("test_pool_parity", None)
    register_reward("test_pool_parity")(lambda request, text: float(len(text) % 2))
    yield
    REWARDS.pop("test_pool_parity", None)


def config(workdir, seed, mode="cgp"):
    c = smoke.get_config()
    c.workdir, c.seed, c.rounds = str(workdir), seed, 3
    c.sft.max_steps = 0
    c.task.reward = "test_pool_parity"
    c.mesh.sampler_replicas = REPLICAS
    c.driver.mode = mode
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


def leaves(state):
    out = []
    for x in jax.tree.leaves(state):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        out.append(np.asarray(x))
    return out


def multiplexed(configs, policy=None):
    """The configs' runs at once, one thread each, on one pool; (summaries or errors, pool)."""
    pool = ReplicaPool([str(i) for i in range(len(configs))], replicas=REPLICAS, policy=policy)
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


@pytest.mark.parametrize("mode", ["cgp", pytest.param("sync", marks=pytest.mark.slow)])
def test_each_multiplexed_pipeline_trains_bitwise_its_solo_run(tmp_path, mode):
    seeds = (0, 1)
    runs, pool = multiplexed(
        [config(tmp_path / f"mux{s}", s, mode) for s in seeds], policy=Restless(len(seeds))
    )
    assert pool.error is None
    assert all(not isinstance(r, BaseException) for r in runs), runs
    assert sum(s.moves_in for s in pool.stats) > 0  # replicas did switch pipelines
    assert all(h is None for h in pool.holder)  # every replica vacant once the runs ended
    for seed, mux in zip(seeds, runs, strict=True):
        solo = train(config(tmp_path / f"solo{seed}", seed, mode), stdout=False)
        for a, b in zip(leaves(solo["state"]), leaves(mux["state"]), strict=True):
            np.testing.assert_array_equal(a, b)
        assert [r["reward_mean"] for r in solo["rounds"]] == [
            r["reward_mean"] for r in mux["rounds"]
        ]
        assert solo["rounds"][-1]["grad_norm"] > 0  # the parameters did move


def test_a_failing_pipeline_stops_alone_and_the_others_finish(tmp_path):
    ok, broken = config(tmp_path / "ok", 0), config(tmp_path / "broken", 1)
    broken.learner.optimizer.lr = 1e30  # the first update's parameters give a NaN loss
    runs, pool = multiplexed([ok, broken], policy=Restless(2))
    assert isinstance(runs[1], FloatingPointError), runs[1]
    assert not isinstance(runs[0], BaseException) and len(runs[0]["rounds"]) == 3
    assert pool.error is None and all(h is None for h in pool.holder)
