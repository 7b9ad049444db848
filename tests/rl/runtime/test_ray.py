"""The Ray runtime equals the threaded one bitwise; a dead replica or learner loses nothing."""

import jax
import numpy as np
import pytest

from configs import base
from rl.runtime.compose import build_driver

ROUNDS = 3


def tiny_config(runtime="threads", replicas=1, **ray_fields):
    config = base.get_config("smoke")
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


@pytest.mark.parametrize("replicas", [1, 2])
def test_ray_equals_threads_bitwise(ray_cluster, threads_run, replicas):
    results, params, runtime = run_rounds(tiny_config("ray", replicas))
    assert tokens_of(results) == tokens_of(threads_run[0])
    assert_same_params(params, threads_run[1])
    assert [r.version for r in results] == [0, 1, 2]
    if replicas == 2:  # round-robin: both replicas sampled, each in its own timeline lanes
        assert sorted(runtime.router.routed.values()) == [6, 6]
        for r in results:
            assert r.metrics["replica0_sequences"] + r.metrics["replica1_sequences"] == 16
            assert r.metrics["replica0_slot_occupancy"] > 0
            assert r.metrics["replica1_tokens_per_s"] > 0


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


def test_killed_replica_stops_the_run_when_configured(ray_cluster):
    with pytest.raises(RuntimeError, match="sampler replica 1 died.*on_replica_failure='stop'"):
        run_rounds(
            tiny_config("ray", 2, on_replica_failure="stop"),
            driver_hook=kill_replica_after_submit(round=1, replica=1),
        )


def test_killed_learner_stops_the_run_and_resume_reproduces(ray_cluster, threads_run, tmp_path):
    import threading

    import ray

    from learner.checkpoint import saved_steps
    from rl.run import train
    from rl.runtime.ray_runtime import LearnerDied, actor_name

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
    summary = train(config, stdout=False)  # resumes from the newest intact checkpoint
    assert 1 <= summary["first_round"] <= killed_at
    assert_same_params(summary["state"].params, threads_run[1])


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
