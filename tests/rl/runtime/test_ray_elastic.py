"""Elastic devices under the Ray runtime: long-tail migration between replica actors (through the
object store) and the sampler borrowing the learner worker's devices leave the run's tokens and
parameters those of the threaded runtime, bitwise; under async a lent replica taken back
mid-rollout loses and doubles nothing; the migrator's stale and faulty paths lose no request and
leak no slot; a replica that joins gets the latest weights before any request, or is never
routed to."""

import threading
import time

import jax
import numpy as np
import pytest
import ray

from configs import base
from rl.elastic.migration import Always, ReplicaView, RunningView
from rl.runtime.compose import Setup
from rl.runtime.factory import build_driver
from rl.runtime.mesh_plan import plan_mesh
from rl.runtime.ray_router import ReplicaRouter
from rl.runtime.ray_runtime import RayRuntime
from rl.timeline import Timeline
from rl.types import Request, SamplingParams
from sampler.loop import SamplerStats
from sampler.runs import Run
from sampler.transfer import run_to_host


def run(config, rounds=2):
    runtime, driver = build_driver(config, rounds=rounds)
    try:
        try:
            results = [driver.run_round(r) for r in range(rounds)]
        finally:
            driver.close()
        return results, jax.device_get(runtime.learner.state.params), runtime, driver
    finally:
        runtime.close()


def tokens_of(results):
    return [
        [(g.request.uid, c.sample, c.tokens, c.logprobs) for g in r.groups for c in g.completions]
        for r in results
    ]


def assert_same_params(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def max_diff(a, b):
    """The largest absolute difference between two parameter trees."""
    return max(
        float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def migration_config(runtime, replicas, migration="off"):
    """cgp + ordered, sequences of 40 tokens (2 per generate call): time to move while they run."""
    config = base.get_config("smoke")
    config.sft.max_steps = 0
    config.driver.mode, config.driver.batching = "cgp", "ordered"
    config.runtime = runtime
    config.mesh.sampler_replicas = replicas
    config.engine.max_slots = 16  # room on each replica for the other's groups: moves happen
    config.engine.max_length = 64
    config.engine.steps_per_call = 2
    config.sampling.max_new_tokens = 40
    config.elastic.migration = migration
    config.ray.migration_poll_s = 0.002
    return config


@pytest.mark.slow  # end-to-end: a threaded run and a Ray run of 2 replicas
def test_ray_migration_at_every_chance_equals_threads_bitwise(ray_cluster):
    one, p_one, _, _ = run(migration_config("threads", 1))
    two, p_two, runtime, _ = run(migration_config("ray", 2, "always"))
    assert tokens_of(two) == tokens_of(one)
    assert_same_params(p_two, p_one)
    moves = sum(r.metrics["migrations"] for r in two)
    assert moves > 0 and moves == runtime.router.migrator.moves
    assert all((r.metrics["migrated_bytes"] > 0) == (r.metrics["migrations"] > 0) for r in two)
    assert all(r.metrics["sequences"] == one[0].metrics["sequences"] for r in two)
    assert runtime.router.stats.migrations == moves  # the sources counted every handoff


@pytest.mark.slow  # end-to-end: a threaded run and a Ray run of 2 replicas, 1 round
def test_ray_a_replica_taken_back_while_its_group_waits_on_the_queue_samples_nothing_twice(
    ray_cluster,
):
    """A replica is taken back when a group it emitted sits on the queue, not yet taken off by
    the driver: the group is delivered from there, its request not sampled again (once it was,
    and the second copy was dropped on delivery). The run's tokens are the one-replica run's."""
    one, _, _, _ = run(migration_config("threads", 1), rounds=1)
    runtime, driver = build_driver(migration_config("ray", 2), rounds=1)
    router, taken = runtime.router, []
    accept = driver.queue.accept

    def take_back_then_accept(group):
        if not taken:  # the first group off the queue: its replica still owns the request
            taken.append(router.routing.owner(group.request.key))
            router.take_back(taken[0])
        return accept(group)

    driver.queue.accept = take_back_then_accept
    try:
        try:
            two = [driver.run_round(0)]
        finally:
            driver.close()
        stats = router.stats
    finally:
        runtime.close()
    assert taken[0] in (0, 1) and router.alive == [1 - taken[0]]
    assert tokens_of(two) == tokens_of(one)
    assert stats.groups_emitted == len(two[0].groups) and stats.groups_cut == 0


def lend_config(runtime, borrowing):
    """sync; a learner of 4 devices and 2 sampler replicas of 2; any predicted gain moves."""
    config = base.get_config("smoke")
    config.sft.max_steps = 0
    config.driver.mode, config.driver.batching = "sync", "ordered"
    config.runtime = runtime
    config.mesh.colocated = False
    config.mesh.learner_devices = 4
    config.mesh.sampler_devices, config.mesh.sampler_replicas = 2, 2
    config.elastic.borrowing = borrowing
    config.elastic.stage_model = "preset:qwen3-1.7b:h100"
    config.elastic.switch_cost_s = 0.0
    config.elastic.margin = 0.0
    return config


@pytest.mark.slow  # end-to-end: a threaded run and a Ray run
def test_ray_sampler_borrows_the_learner_workers_devices_and_the_run_is_unchanged(ray_cluster):
    static, p_static, _, _ = run(lend_config("threads", "off"))
    lent, p_lent, runtime, driver = run(lend_config("ray", "sampler"))
    assert tokens_of(lent) == tokens_of(static)
    assert_same_params(p_lent, p_static)  # the learner never moved
    for r in lent:
        assert r.metrics["borrow_sampler"] == 1.0 and r.metrics["borrow_sampler_measured_s"] > 0
    spans = driver.timeline.spans("elastic")
    assert [s.args["replicas"] for s in spans] == [2, 2]  # 4 learner devices / 2 per replica
    assert runtime.router.alive == [0, 1]  # the lent replicas (2, 3, then 4, 5) left each round
    lanes = {s.args["replica"] for s in driver.timeline.spans("sampler/slot")}
    # Lent replicas decoded (which of them got work before a rollout drained is timing: CI once
    # saw replica 4 join and leave idle); no lane beyond the 6 replicas.
    assert {0, 1} <= lanes <= {0, 1, 2, 3, 4, 5} and lanes & {2, 3, 4, 5}


def async_lend_config(runtime, borrowing):
    """async s = 3, U = 2, 8 groups a round of up to 40 tokens: a window of 32 samples, more
    than the 2 replicas' slots, so requests queue while the learner waits for its next batch."""
    c = lend_config(runtime, borrowing)
    c.driver.mode, c.driver.max_staleness = "async", 3
    c.driver.groups_per_round, c.driver.groups_per_update = 8, 2
    c.sampling.max_new_tokens = 40
    c.engine.max_length = 64
    return c


TOL = 1e-5  # float32; the gradient reduced across 3 processes' 8 devices instead of over 4


@pytest.mark.slow  # end-to-end: a threaded run and a Ray run of 2 lending replicas, 3 rounds
def test_ray_learner_borrows_the_replicas_devices_until_a_lender_dies(ray_cluster):
    """The learner borrows in rounds 0 and 1 (switching back before each publish); replica 1 dies
    once round 2 is routed: its requests are re-sampled and the learner stops borrowing, the run
    goes on. Throughout, the static split's tokens and (within TOL) parameters."""
    static, p_static, _, _ = run(lend_config("threads", "off"), rounds=3)
    runtime, driver = build_driver(lend_config("ray", "learner"), rounds=3)
    try:
        router = runtime.router
        submit = router.submit

        def submit_then_kill(requests, cut=None):
            requests = list(requests)
            submit(requests, cut)
            if requests and requests[0].round == 2 and 1 in router.alive:
                ray.kill(router.replicas[1])

        router.submit = submit_then_kill
        try:
            results = [driver.run_round(r) for r in range(3)]
        finally:
            driver.close()
        params = jax.device_get(runtime.learner.state.params)
    finally:
        runtime.close()
    assert tokens_of(results) == tokens_of(static)  # rounds 1, 2 sampled given-back weights
    assert max_diff(params, p_static) <= TOL
    assert [r.metrics["borrow_learner"] for r in results] == [1.0, 1.0, 0.0]
    for r in results[:2]:  # the move made and its switch measured
        assert r.metrics["borrow_learner_gain_s"] > 0 and r.metrics["borrow_learner_measured_s"] > 0
    assert router.alive == [0] and router.resampled > 0
    assert not runtime.learner.borrowing
    spans = driver.timeline.spans("learner")
    assert [s.name for s in spans].count("give_back") == 2
    assert [s.args["devices"] for s in spans if s.name == "borrow"] == [4, 4]  # 2 replicas x 2


@pytest.mark.slow  # end-to-end: a threaded run and a Ray run
def test_ray_async_learner_borrows_the_drained_replicas_and_the_run_is_unchanged(ray_cluster):
    """async with s = 0: the sampler has drained when each update trains, so the learner borrows
    the replicas' devices for every update and gives them back before its publish; the tokens
    and (within TOL) parameters of the threaded run without borrowing."""

    def config(runtime, borrowing):
        c = lend_config(runtime, borrowing)
        c.driver.mode, c.driver.max_staleness, c.driver.groups_per_update = "async", 0, 2
        return c

    static, p_static, _, _ = run(config("threads", "off"))
    borrowed, p_borrowed, runtime, driver = run(config("ray", "learner"))
    assert tokens_of(borrowed) == tokens_of(static)
    assert max_diff(p_borrowed, p_static) <= TOL
    names = [s.name for s in driver.timeline.spans("learner")]
    updates = sum(len(r.groups) for r in borrowed) // 2
    assert names.count("borrow") == names.count("give_back") == updates
    assert not runtime.learner.borrowing and max(r.metrics["lag_max"] for r in borrowed) == 0


@pytest.mark.slow  # end-to-end: a Ray run, 3 rounds
def test_ray_async_lends_the_learner_workers_devices_and_takes_them_back_mid_rollout(ray_cluster):
    """BiDiRL's setting under Ray: the learner worker's devices decode while the learner waits
    for its next batch (the lent replicas take requests queued on the others) and are taken
    back once the batch is complete, what ran there resuming on the replica actors, re-prefilled
    with its tokens so far: every group is trained once, every token within the bound, versions
    in order along each sequence (tests/rl/runtime/test_lending.py's threaded invariants)."""

    rounds = 3
    static, _, _, _ = run(async_lend_config("threads", "off"), rounds)
    lent, _, runtime, driver = run(async_lend_config("ray", "sampler"), rounds)
    keys = lambda results: sorted(g.request.key for r in results for g in r.groups)
    assert keys(lent) == keys(static) and len(keys(lent)) == 8 * rounds
    assert len(driver.timeline.spans("elastic")) >= 1  # lent at least once
    assert runtime.router.alive == [0, 1]  # the lent replicas went back
    stats = driver.sampler.stats  # (the replicas' last counters: the run is closed)
    assert stats.resumed_sequences == stats.evicted_sequences  # every one taken back resumed
    assert stats.groups_emitted == 8 * rounds
    versions = [c.versions for r in lent for g in r.groups for c in g.completions]
    assert all(list(v) == sorted(v) for v in versions)
    assert max(r.metrics["lag_max"] for r in lent) <= 3
    lent_lanes = [s for s in driver.timeline.spans("sampler/slot") if s.args["replica"] >= 2]
    assert sum(s.args["tokens"] for s in lent_lanes) > 0  # the lent replicas decoded


@pytest.mark.slow  # end-to-end: a Ray run, 3 rounds
def test_ray_async_borrows_in_both_directions_within_the_bound(ray_cluster):
    """Both directions under Ray (tests/rl/runtime/test_lending.py's threaded case): the learner
    worker's devices decode while the learner waits for its next batch and go back once it is
    complete, and the learner borrows the replicas' devices once the bound has drained them (the
    run's last updates): every group trained once, within the bound, versions in order."""

    rounds = 3
    both, _, runtime, driver = run(async_lend_config("ray", "both"), rounds)
    keys = sorted(g.request.key for r in both for g in r.groups)
    assert len(keys) == len(set(keys)) == 8 * rounds
    versions = [c.versions for r in both for g in r.groups for c in g.completions]
    assert all(list(v) == sorted(v) for v in versions)
    assert max(r.metrics["lag_max"] for r in both) <= 3
    names = [s.name for s in driver.timeline.spans("learner")]
    assert names.count("borrow") == names.count("give_back") >= 1  # the drained last updates
    assert not runtime.learner.borrowing
    assert len(driver.timeline.spans("elastic")) >= 1  # the sampler borrowed at least once
    assert runtime.router.alive == [0, 1]  # lent replicas went back
    stats = driver.sampler.stats
    assert stats.resumed_sequences == stats.evicted_sequences
    assert stats.groups_emitted == 8 * rounds


@pytest.mark.slow
def test_planner_picks_the_open_split_and_the_ray_workers_are_built_on_it(ray_cluster):
    config = lend_config("ray", "off")
    config.mesh.split = "plan"
    config.mesh.learner_devices = config.mesh.sampler_devices = 0
    config.mesh.sampler_replicas = 1  # open: the planner picks the replicas
    runtime = RayRuntime(config, Setup.from_config(config), total_updates=2)
    try:
        plan = runtime.mesh_plan
        assert plan == plan_mesh(config, 8)[1]  # the threads runtime's planner, on the 8 devices
        split = plan.split
        assert ray.get(runtime.learner.workers[0].devices.remote()) == split.learner_gpus
        assert len(runtime.replicas) == split.replicas
        assert runtime.config.mesh.sampler_devices == split.tp
        assert runtime.config.mesh.split == "fixed" and config.mesh.split == "plan"
    finally:
        runtime.close()


# ------------------------------------------------------------------ the migrator, step by step


class FakeReplica:
    """A replica's migration methods, scripted, behind an actor handle's `.method.remote()`."""

    def __init__(self, slots=8, running=(), answers=None, adopt=True, on_take=None):
        self.slots, self.running = slots, list(running)
        self.answers, self.adopts = dict(answers or {}), adopt
        self.on_take = on_take
        self.reserved, self.unreserved, self.asked, self.adopted, self.submitted = (
            [],
            [],
            [],
            [],
            [],
        )

    def num_slots(self):
        return self.slots

    def view(self):
        used = sum(r.sequences for r in self.running)
        return ReplicaView(slots=self.slots, free=self.slots - used, running=tuple(self.running))

    def reserve(self, n):
        self.reserved.append(n)
        return list(range(n))

    def unreserve(self, slots):
        self.unreserved.append(list(slots))

    def handoff(self, keys):
        self.asked.extend(map(tuple, keys))

    def take_handoffs(self):
        if self.on_take is not None:
            self.on_take()
        out = {k: self.answers[k] for k in self.asked if k in self.answers}
        self.asked = []
        return out

    def adopt(self, handoff, slots):
        self.adopted.append((handoff, list(slots)))
        return self.adopts

    def submit(self, requests):
        self.submitted.extend(r.key for r in requests)


class Handle:
    def __init__(self, core):
        self.core = core

    def __getattr__(self, method):
        core = self.core

        class _Method:
            def remote(self, *args):
                return ray.put(getattr(core, method)(*args))

        return _Method()


def request(uid):
    params = SamplingParams(temperature=1.0, max_new_tokens=8)
    return Request(uid=uid, prompt=(1, 2, 3), group_size=2, params=params)


def router_over(src, dst, *owned):
    """A router over replicas [src, dst] whose Routing has `owned` requests on src."""
    router = ReplicaRouter(
        [Handle(src), Handle(dst)],
        routing="round_robin",
        on_failure="resample",
        timeline=Timeline(),
        migration=Always(),
        migration_poll_s=0.001,
    )
    for r in owned:
        router.routing.outstanding[r.key] = (0, r)
        router.routing.load[0] += 1
    return router


def running(*reqs):
    return [RunningView(key=r.key, sequences=r.group_size, tokens_left=4) for r in reqs]


def test_the_migrator_moves_ownership_with_the_state_and_draws_the_move(ray_cluster):
    """One sample of the 2 the view saw finished before the handoff: its slot goes back."""
    a = request(0)
    src = FakeReplica(running=running(a), answers={a.key: [ray.put("state"), 640, 1]})
    dst = FakeReplica()
    router = router_over(src, dst, a)
    assert router.migrator.step() == 1
    assert router.routing.owner(a.key) == 1
    assert dst.reserved == [2] and dst.adopted[0][1] == [0] and dst.unreserved == [[1]]
    (span,) = router.timeline.spans("sampler/replica0/migrate")
    args = span.args
    assert (args["uid"], args["sequences"], args["bytes"], args["src"], args["dst"]) == (
        0,
        1,
        640,
        0,
        1,
    )
    assert router.migrator.stale == 0


def test_the_migrator_gives_back_slots_of_requests_that_ended_or_were_cut(ray_cluster):
    a, b = request(0), request(1)
    src = FakeReplica(
        running=running(a, b), answers={a.key: [ray.put("state"), 64, 2], b.key: None}
    )
    dst = FakeReplica(slots=16)
    router = router_over(src, dst, a, b)
    src.on_take = lambda: router.routing.deliver(a.key)  # a's round cut forgot it meanwhile
    assert router.migrator.step() == 0
    assert sorted(map(len, dst.unreserved)) == [2, 2]  # both reservations given back
    assert not dst.adopted and router.migrator.stale == 2
    assert router.routing.owner(b.key) == 0  # b still its source's (its group comes from there)


def test_a_state_lost_with_its_source_is_sampled_again(ray_cluster):
    a = request(0)
    src = FakeReplica(running=running(a), answers={a.key: [ray.put("state"), 64, 2]})
    dst = FakeReplica(adopt=False)
    router = router_over(src, dst, a)
    assert router.migrator.step() == 0
    assert router.migrator.resampled == 1
    assert a.key in src.submitted + dst.submitted  # routed afresh, owned by whoever took it
    assert router.routing.owner(a.key) in (0, 1)


class Kept(FakeReplica):
    """A replica that stays: it records what resumes on it."""

    def __init__(self):
        super().__init__()
        self.resumed, self.versions = [], []

    def resume(self, runs):
        self.resumed.extend(runs)

    def set_params(self, params, version):
        self.versions.append(version)


class Lent(FakeReplica):
    """A lent replica taken back: `evict` answers what it held."""

    def __init__(self, evicted):
        super().__init__()
        self.evicted, self.closed = evicted, False

    def evict(self):
        return self.evicted

    def start(self):
        self.closed = False

    def stats(self):
        return SamplerStats(), [], []

    def close(self):
        self.closed = True


class Held:
    """A queue actor holding the groups of requests `keys` (QueueActor.keys)."""

    def __init__(self, keys):
        self._keys = set(keys)

    def keys(self):
        return set(self._keys)


def test_a_replica_taken_back_hands_its_work_to_the_others(ray_cluster):
    """Its running request resumes on the replica that stays (with its tokens so far), its queued
    one is submitted there, its group already on the queue stays owned until delivered, and a
    request forgotten meanwhile (a full round cut) is neither resumed nor sampled again."""
    running_, queued, scoring, forgotten = request(0), request(1), request(2), request(3)
    run = Run.of(running_)
    run.samples[0].tokens.extend([5, 6])
    evicted = ([queued], [run_to_host(run), run_to_host(Run.of(forgotten))])
    kept, lent = Kept(), Lent(evicted)
    router = ReplicaRouter(
        [Handle(kept), Handle(lent)],
        routing="round_robin",
        on_failure="resample",
        timeline=Timeline(),
        queue=Handle(Held({scoring.key})),
    )
    for r in (running_, queued, scoring):
        router.routing.outstanding[r.key] = (1, r)
        router.routing.load[1] += 1
    router.take_back(1)
    assert router.alive == [0] and lent.closed and router.replica_slots == (8,)
    assert [h.run.request.key for h in kept.resumed] == [running_.key]
    assert kept.resumed[0].run.samples[0].tokens == [5, 6]
    assert kept.submitted == [queued.key]
    owners = {k: owner for k, (owner, _) in router.routing.outstanding.items()}
    assert owners == {running_.key: 0, queued.key: 0, scoring.key: 0}
    with pytest.raises(ValueError, match="is the last one"):
        router.take_back(0)


def test_a_replica_lent_again_writes_on_its_own_slot_lanes(ray_cluster):
    """Lent, taken back and lent again within one round: its slots keep their lanes, so the
    round's slot lanes never outnumber the most slots routed to at once (rl.metrics checks)."""
    lent = Handle(Lent(([], [])))
    router = ReplicaRouter(
        [Handle(Kept())], routing="round_robin", on_failure="resample", timeline=Timeline()
    )
    first = router.add_replica(lent)
    router.take_back(first)
    again = router.add_replica(lent)
    assert again != first and router.lane("sampler/slot0", again) == "sampler/slot8"
    assert router.lane("sampler/slot0", first) == router.lane("sampler/slot0", again)
    assert router.lane("sampler/slot7", 0) == "sampler/slot7"


@ray.remote(num_cpus=0)
class Doomed:
    """A replica actor that dies (ray.kill) after the router is built."""

    def num_slots(self):
        return 8


def dead(actor, timeout_s=30.0):
    """Returns once `actor` answers no more: ray.kill is asynchronous, so a call made at once
    may still be answered (CI saw it)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            ray.get(actor.num_slots.remote(), timeout=5)
        except ray.exceptions.RayActorError:
            return
        except ray.exceptions.GetTimeoutError:
            pass
        assert time.monotonic() < deadline, "the killed actor still answers"
        time.sleep(0.05)


def test_a_dead_replicas_group_on_the_queue_is_delivered_not_sampled_again(ray_cluster):
    """A replica dies with one group on the queue and one request unfinished: only the
    unfinished one is sampled again; the other stays owned and is delivered from the queue."""
    on_queue, unfinished = request(0), request(1)
    kept, doomed = Kept(), Doomed.remote()
    router = ReplicaRouter(
        [Handle(kept), doomed],
        routing="round_robin",
        on_failure="resample",
        timeline=Timeline(),
        queue=Handle(Held({on_queue.key})),
    )
    for r in (on_queue, unfinished):
        router.routing.outstanding[r.key] = (1, r)
        router.routing.load[1] += 1
    ray.kill(doomed)
    dead(doomed)
    assert router.each("num_slots") == {0: 8}  # the dead replica's call fails: it is lost
    assert router.alive == [0] and router.resampled == 1
    assert kept.submitted == [unfinished.key]
    owners = {k: owner for k, (owner, _) in router.routing.outstanding.items()}
    assert owners == {on_queue.key: 0, unfinished.key: 0}


class Unplaceable(Lent):
    """A replica whose weights cannot be placed (a pull of a version no longer staged)."""

    def set_params(self, params, version):
        raise KeyError("Weights transfer 17 is no longer staged")


def test_a_replica_that_fails_to_start_is_never_routed_to(ray_cluster):
    """The pool's add (or a lend) fails at the joining replica's weights: it is stopped, never
    routed to, and the requests go to the replicas there were."""
    kept, bad = Kept(), Unplaceable(([], []))
    router = ReplicaRouter(
        [Handle(kept)], routing="round_robin", on_failure="resample", timeline=Timeline()
    )
    router.set_params("weights", 1)
    with pytest.raises(KeyError, match="no longer staged"):
        router.add_replica(Handle(bad))
    assert router.alive == [0] and bad.closed
    router.submit([request(0), request(1)])
    assert kept.submitted == [(0, 0), (0, 1)]


class Slow(Lent):
    """A joining replica whose weights take a while to place."""

    def __init__(self):
        super().__init__(([], []))
        self.entered, self.go, self.versions = threading.Event(), threading.Event(), []

    def set_params(self, params, version):
        self.entered.set()
        assert self.go.wait(30)
        self.versions.append(version)


def test_a_publish_while_a_replica_joins_reaches_it_after_its_first_weights(ray_cluster):
    """A publish that comes while a replica joins waits for it, then reaches it too: the replica
    never samples with the weights it was given at the join once newer ones are out."""
    kept, slow = Kept(), Slow()
    router = ReplicaRouter(
        [Handle(kept)], routing="round_robin", on_failure="resample", timeline=Timeline()
    )
    router.set_params("weights1", 1)
    joining = threading.Thread(target=router.add_replica, args=(Handle(slow),))
    joining.start()
    assert slow.entered.wait(30)
    publish = threading.Thread(target=router.set_params, args=("weights2", 2))
    publish.start()
    time.sleep(0.2)  # (time for the publish to overtake the join, were it not held)
    slow.go.set()
    joining.join(30)
    publish.join(30)
    assert kept.versions == [1, 2] and slow.versions == [1, 2]
