"""The Ray runtime equals the threaded one bitwise; a dead replica or learner loses nothing."""

import json

import jax
import numpy as np
import pytest

from configs import base
from rl.losses import LOSS_OPTIONS, POLICY_LOSSES, PpoClipOptions, register_policy_loss
from rl.metrics_writer import MetricsWriter
from rl.rewards import REWARDS, register_reward
from rl.run import warm_start
from rl.runtime.compose import Setup
from rl.runtime.factory import build_driver, make_runtime
from rl.tasks.data import load_task

ROUNDS = 3


def tiny_config(runtime="threads", replicas=1, routing="round_robin", **ray_fields):
    config = base.get_config("smoke")
    config.mesh.sampler_routing = routing
    config.sft.max_steps = 0
    config.driver.mode, config.driver.batching = "cgp", "ordered"
    config.driver.groups_per_round = 4
    config.runtime = runtime
    config.mesh.sampler_replicas = replicas
    for k, v in ray_fields.items():
        config.ray[k] = v
    return config


def run_rounds(config, rounds=ROUNDS, driver_hook=None):
    """The composition root's runtime and Driver, run for `rounds` rounds."""
    runtime, driver = build_driver(config, rounds=rounds)
    try:
        if driver_hook is not None:
            driver_hook(runtime, driver)
        try:
            results = [driver.run_round(r) for r in range(rounds)]
        finally:
            driver.close()
        return results, jax.device_get(runtime.learner.state.params), runtime
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


@pytest.fixture(scope="module")
def threads_run():
    results, params, _ = run_rounds(tiny_config("threads"))
    return results, params


# The quick tier keeps one Ray bitwise run (1 replica, weights pulled by transfer); 2 replicas
# and the object store's weights run in the slow tier.
@pytest.mark.parametrize(
    "replicas,weights",
    [
        (1, "auto"),
        pytest.param(2, "auto", marks=pytest.mark.slow),
        pytest.param(2, "object_store", marks=pytest.mark.slow),
    ],
)
def test_ray_equals_threads_bitwise(ray_cluster, threads_run, replicas, weights):
    results, params, runtime = run_rounds(tiny_config("ray", replicas, weights=weights))
    assert tokens_of(results) == tokens_of(threads_run[0])
    assert_same_params(params, threads_run[1])
    assert [r.version for r in results] == [0, 1, 2]
    # auto: the replicas pulled every publish from the learner worker's devices
    assert runtime.weights == ("transfer" if weights == "auto" else "object_store")
    moved = sum(r.metrics["publish_mb"] for r in results) * 2**20
    assert moved > 0
    stored = runtime.weight_sync.object_store_bytes  # the rounds' publishes and the first one
    assert stored == 0 if weights == "auto" else stored >= moved
    if replicas == 2:  # round-robin: both replicas sampled, each in its own timeline lanes
        assert sorted(runtime.router.routed.values()) == [6, 6]
        for r in results:
            assert r.metrics["replica0_sequences"] + r.metrics["replica1_sequences"] == 16
            assert r.metrics["replica0_slot_occupancy"] > 0
            assert r.metrics["replica1_tokens_per_s"] > 0


@pytest.mark.slow  # a threaded and a 2-replica Ray run of 3 rounds (~40 s)
def test_a_reward_and_a_loss_registered_in_the_users_script_work_under_ray(ray_cluster):
    """Defined in a function, so no worker can import them: they reach the Ray workers by value,
    with the run's config (rl.runtime.ray_process.worker_payload), and the run equals the
    threaded one bitwise."""

    def length_reward(request, completion_text):
        return min(len(completion_text.strip()), 3) / 3.0

    def half_ppo_clip(logp_BxT, old_logp_BxT, adv_B, mask_BxT, opts):
        loss, metrics = POLICY_LOSSES["ppo_clip"](
            logp_BxT, old_logp_BxT, adv_B, mask_BxT, PpoClipOptions()
        )
        return 0.5 * loss, metrics

    register_reward("test_length_reward")(length_reward)
    register_policy_loss("test_half_ppo_clip")(half_ppo_clip)
    try:
        runs = []
        for runtime, replicas in (("threads", 1), ("ray", 2)):
            config = tiny_config(runtime, replicas)
            config.task.reward = "test_length_reward"
            config.learner.policy_loss = "test_half_ppo_clip"
            results, params, _ = run_rounds(config)
            runs.append((tokens_of(results), params, [r.metrics["reward_mean"] for r in results]))
        (tokens, params, rewards), (ray_tokens, ray_params, ray_rewards) = runs
        assert ray_tokens == tokens and ray_rewards == rewards
        assert_same_params(ray_params, params)
        assert any(0 < r < 1 for r in rewards)  # the registered reward scored them
    finally:
        for registry in (REWARDS, POLICY_LOSSES, LOSS_OPTIONS):
            registry.pop("test_length_reward", None)
            registry.pop("test_half_ppo_clip", None)


TAIL_ROUNDS = 3  # short, short, long (the 4 prompts the short rounds cut)


def tail_config(runtime="threads", replicas=1):
    """Tail batching: short rounds launch 6 prompts and train the first 4 complete groups, each
    of the first 4 of 5 samples to finish (response over-provisioning, decided on the replica)."""
    config = tiny_config(runtime, replicas)
    config.driver.tail.enabled, config.driver.tail.eta = True, 1.5
    config.driver.tail.response_eta = 1.25
    return config


def record_submits(submitted):
    """A driver hook: records every request uid the router is given, and the driver."""

    def hook(runtime, driver):
        submit = runtime.router.submit

        def recording(requests, cut=None):
            requests = list(requests)
            submitted["uids"] += [r.uid for r in requests]
            submit(requests, cut)

        runtime.router.submit = recording
        submitted["driver"] = driver

    return hook


@pytest.fixture(scope="module")
def threads_tail_run():
    results, params, _ = run_rounds(tail_config("threads"), rounds=TAIL_ROUNDS)
    return results, params


@pytest.mark.slow
@pytest.mark.parametrize("replicas", [1, 2])
def test_tail_batching_cuts_rounds_across_replicas(ray_cluster, threads_tail_run, replicas):
    submitted = {"uids": []}
    results, params, runtime = run_rounds(
        tail_config("ray", replicas), rounds=TAIL_ROUNDS, driver_hook=record_submits(submitted)
    )
    assert [r.kind for r in results] == ["short", "short", "long"]
    assert [len(r.groups) for r in results] == [4] * TAIL_ROUNDS
    assert {len(g.completions) for r in results for g in r.groups} == {4}
    if replicas == 1:  # the cut sees the replica's completion order: the threaded run's cut
        assert tokens_of(results) == tokens_of(threads_tail_run[0])
        assert_same_params(params, threads_tail_run[1])
    # Every launched prompt is trained once or waits in the long queue: none lost, none doubled.
    trained = [g.request.uid for r in results for g in r.groups]
    queued = [p.uid for p in submitted["driver"].planner.long_queue]
    assert len(set(trained)) == len(trained) and not set(trained) & set(queued)
    assert set(trained) | set(queued) == set(submitted["uids"])
    assert queued == []  # the long round trained every cut prompt
    assert sum(runtime.router.routed.values()) == 6 + 6 + 4
    if replicas == 2:
        assert min(runtime.router.routed.values()) > 0
    assert runtime.router.routing.outstanding == {}  # the cut prompts were aborted, not re-sampled


def kill_replica_after_submit(round, replica):
    """A driver hook: kills `replica` right after the router submitted `round`'s requests."""
    import ray

    def hook(runtime, driver):
        router = runtime.router
        submit = router.submit

        def submit_then_kill(requests, cut=None):
            requests = list(requests)
            submit(requests, cut)
            if requests and requests[0].round == round and replica in router.alive:
                ray.kill(router.replicas[replica])

        router.submit = submit_then_kill

    return hook


@pytest.mark.slow
def test_killed_replica_is_resampled_on_the_other(ray_cluster, threads_run):
    results, params, runtime = run_rounds(
        tiny_config("ray", 2, routing="least_loaded"),
        driver_hook=kill_replica_after_submit(round=1, replica=1),
    )
    router = runtime.router
    assert router.alive == [0]
    assert router.resampled > 0  # replica 1 had unfinished groups of round 1
    # least-loaded: rounds 0 and 1 alternate over the two; the re-sampled groups and round 2
    # go to replica 0
    assert router.routed[1] == 4 and router.routed[0] == 4 + router.resampled + 4
    # The same groups, tokens and parameters as an undisturbed run; none lost, none doubled.
    assert tokens_of(results) == tokens_of(threads_run[0])
    assert_same_params(params, threads_run[1])


@pytest.mark.slow
def test_killed_replica_stops_the_run_when_configured(ray_cluster):
    with pytest.raises(RuntimeError, match="sampler replica 1 died.*on_replica_failure='stop'"):
        run_rounds(
            tiny_config("ray", 2, on_replica_failure="stop"),
            driver_hook=kill_replica_after_submit(round=1, replica=1),
        )


@pytest.mark.slow
def test_killed_learner_stops_the_run_and_resume_reproduces(ray_cluster, threads_run, tmp_path):
    import threading

    import ray

    from learner.checkpoint import saved_steps
    from rl.run import train
    from rl.runtime.ray_cluster import actor_name
    from rl.runtime.ray_learner_client import LearnerDied

    config = tiny_config("ray", 1)
    config.workdir = str(tmp_path / "run")
    config.rounds, config.checkpoint_every, config.resume = ROUNDS, 1, True
    config.eval.every_rounds = 0
    ckpt = tmp_path / "run" / "ckpt"
    stop = threading.Event()

    def kill_after_first_checkpoint():
        while not stop.is_set():
            if ckpt.is_dir() and saved_steps(str(ckpt)):
                ray.kill(ray.get_actor(actor_name(config, "learner")))
                return
            stop.wait(0.01)

    killer = threading.Thread(target=kill_after_first_checkpoint)
    killer.start()
    try:
        with pytest.raises(LearnerDied, match="learner worker died.*resume"):
            train(config, stdout=False)
    finally:
        stop.set()
        killer.join()
    killed_at = max(saved_steps(str(ckpt)))
    assert 1 <= killed_at < ROUNDS
    # resumes from the newest intact checkpoint; from round 0 if the kill came before the first
    # step's checksums were written (the step is then damaged)
    summary = train(config, stdout=False)
    assert 0 <= summary["first_round"] <= killed_at
    assert_same_params(summary["state"].params, threads_run[1])
    for role in ("queue", "learner", "replica0"):  # every actor the run started ended with it
        with pytest.raises(ValueError, match="Failed to look up actor"):
            ray.get_actor(actor_name(config, role))


@pytest.mark.slow
def test_launch_train_joins_a_cluster_and_keeps_ray_logs_off_the_console(ray_cluster, tmp_path):
    import os
    import subprocess
    import sys

    address = ray_cluster.get_runtime_context().gcs_address
    workdir = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "launch.train",
        "--config=configs/smoke.py",
        "--config.runtime=ray",
        f"--config.ray.address={address}",
        "--config.mesh.sampler_replicas=2",
        "--config.sft.max_steps=0",
        "--config.rounds=1",
        "--config.eval.every_rounds=0",
        f"--config.workdir={workdir}",
    ]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    out = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    console = out.stdout + out.stderr
    assert "[train] step 0 | round 0" in console and "pipeline" in console
    for line in console.replace(str(tmp_path), "<tmp>").splitlines():
        # no Ray logging, no forwarded worker output
        assert "(pid=" not in line and " -- " not in line and "ray" not in line.lower(), line
    assert (workdir / "summary.json").is_file()


@pytest.mark.slow
def test_a_learner_of_two_worker_processes_trains_as_one(ray_cluster, threads_run):
    # ray.learner_workers=2: two learner actors form one jax.distributed job (gloo on CPU), the
    # mesh over both processes' 8 fake devices (fsdp 8 x tp 2); every call goes to both, rank 0 answers.
    config = tiny_config("ray", learner_workers=2)
    config.mesh.learner_devices = 0  # a multi-process learner uses every device of its job
    config.mesh.learner_tp = 2  # fsdp 8: micro_batch_rows 8 splits over it
    results, params, _ = run_rounds(config)
    # The sampled tokens depend on the published weights: the same tokens means every publish
    # (a gather over both processes) gave the replica the 1-process learner's weights to the
    # bit that matters; the parameters agree within float32 reduction order (the fsdp sums add
    # the shards of two processes in another order: learner/distributed.py).
    assert tokens_of(results) == tokens_of(threads_run[0])
    for x, y in zip(jax.tree.leaves(params), jax.tree.leaves(threads_run[1]), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-6, rtol=0)
    assert [r.version for r in results] == [0, 1, 2]


def sft_run(runtime_name, workdir):
    """rl.run's SFT stage (3 steps, evaluated after 2 and 3) on a runtime built by the
    composition root: the learner's params after it, and the sft metrics rows."""
    config = tiny_config(runtime_name)
    config.sft.max_steps, config.sft.eval_every, config.sft.batch_size = 3, 2, 4
    config.sft.target_accuracy = 1.0  # not reached: every step runs
    setup = Setup.from_config(config)
    data = load_task(setup.data, setup.tokenizer, max_prompt_tokens=setup.max_prompt_tokens)
    runtime = make_runtime(config, setup, total_updates=1)
    try:
        writer = MetricsWriter(str(workdir), stdout=False)

        def accuracy(params):
            published = runtime.weight_sync.publish(params, -1).params
            return runtime.evaluate(published, data.heldout)["accuracy"]

        steps, _ = warm_start(
            config, runtime.sft(data.train), runtime.learner, accuracy, writer, None
        )
        writer.close()
        rows = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
        return steps, jax.device_get(runtime.learner.state.params), rows
    finally:
        runtime.close()


@pytest.mark.slow  # a threaded and a 2-replica Ray run of 3 rounds (~40 s)
def test_a_lora_run_under_ray_equals_threads(ray_cluster):
    configs = [tiny_config(runtime, replicas) for runtime, replicas in (("threads", 1), ("ray", 2))]
    for config in configs:
        config.model.lora.rank = 4
    threads_results, threads_params, _ = run_rounds(configs[0])
    results, params, _ = run_rounds(configs[1])
    assert tokens_of(results) == tokens_of(threads_results)
    assert_same_params(params, threads_params)  # the adapters: the TrainState holds nothing else
    assert all(x.ndim in (2, 3) for x in jax.tree.leaves(params))
    # threads hands the sampler the learner's arrays (colocated) or moves the adapters; Ray puts
    # a replica pulls the whole model every publish
    assert threads_results[0].metrics["publish_mb"] < results[0].metrics["publish_mb"]


@pytest.mark.slow
def test_sft_warm_start_on_the_learner_worker_equals_threads(ray_cluster, tmp_path):
    threads = sft_run("threads", tmp_path / "threads")
    ray_ = sft_run("ray", tmp_path / "ray")
    # The same SftTrainer code on the same one-device learner mesh: bitwise the same.
    assert threads[0] == ray_[0] == 3
    assert [r["step"] for r in threads[2]] == [2, 3] and ray_[2] == threads[2]
    assert_same_params(ray_[1], threads[1])


def async_config(runtime, max_staleness):
    config = tiny_config(runtime)
    config.driver.mode, config.driver.max_staleness = "async", max_staleness
    return config


@pytest.mark.slow
@pytest.mark.parametrize("max_staleness", [0, 1])
def test_async_under_ray(ray_cluster, max_staleness):
    """In-flight weight updates through the object store: s=0 equals the threaded run bitwise;
    with s=1 when a publish reaches the replica is timing, so the invariant is asserted: every
    prompt trained once, every token drawn by a version at most s behind the update's."""
    results, params, runtime = run_rounds(async_config("ray", max_staleness), rounds=2)
    trained = [g.request.uid for r in results for g in r.groups]
    assert len(trained) == len(set(trained)) == 4 * 2
    assert runtime.learner.step == 2 * 2  # U = 2: two updates (and publishes) per round
    for r in results:
        assert [g.request.index for g in r.groups] == [0, 1, 2, 3]  # logical order
        for i, g in enumerate(r.groups):
            update = 2 * r.round + i // 2  # the version the update trains (one per update)
            for c in g.completions:
                assert len(c.versions) == len(c.tokens) and list(c.versions) == sorted(c.versions)
                assert update - max_staleness <= min(c.versions) <= max(c.versions) <= update
        assert r.metrics["lag_max"] <= max_staleness
    if max_staleness == 0:
        expected, expected_params, _ = run_rounds(async_config("threads", 0), rounds=2)
        assert tokens_of(results) == tokens_of(expected)
        assert_same_params(params, expected_params)
