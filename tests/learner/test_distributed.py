"""A learner of 2 processes (one jax.distributed job on CPU) trains as the 1-process learner."""

import json
import os
import socket
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

from configs.base import get_config
from learner.distributed import (
    ENV,
    DistributedConfig,
    coordinator_address_here,
    distributed_config_from,
    initialize,
    make_learner_mesh,
)
from learner.mesh import MeshConfig

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
WORKER = os.path.join(HERE, "distributed_worker.py")
TOL = 1e-6  # float32 parameters; why not 0: see the test


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_two_processes(workdir: str) -> list[tuple[subprocess.Popen, Any]]:
    """Starts the 2 processes of one learner job, 4 CPU devices each; logs in workdir."""
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": ROOT,
    }
    # No compilation cache: both processes then do the same work at the same pace (a cache hit in
    # one only would let it reach a collective far ahead, and gloo gives the other 30 s to join).
    for name in (*ENV.values(), "JAX_COMPILATION_CACHE_DIR", "JAX_SHARE_BINARY_BETWEEN_HOSTS"):
        env.pop(name, None)
    port = _free_port()
    procs = []
    for rank in range(2):
        log = open(os.path.join(workdir, f"process{rank}.log"), "w")
        cmd = [sys.executable, WORKER, f"--process_id={rank}", "--num_processes=2"]
        cmd += [f"--port={port}", f"--workdir={workdir}"]
        procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    return procs


def _wait(procs: list[tuple[subprocess.Popen, Any]], workdir: str) -> None:
    """Waits for both processes (killing them past the timeout); fails with their logs' tails."""
    try:
        for proc, _ in procs:
            proc.wait(timeout=240)
    except subprocess.TimeoutExpired:
        pass
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    bad = [(rank, p.returncode) for rank, (p, _) in enumerate(procs) if p.returncode != 0]
    if bad:
        tails = []
        for rank, code in bad:
            with open(os.path.join(workdir, f"process{rank}.log")) as f:
                lines = [x for x in f if not x.startswith("[Gloo]")]
            tails.append(f"process {rank} exited {code}:\n" + "".join(lines[-25:]))
        pytest.fail("\n".join(tails))


@pytest.mark.slow
def test_two_process_learner_equals_one_process_learner(tmp_path):
    two, one = tmp_path / "two", tmp_path / "one"
    two.mkdir()
    one.mkdir()
    _wait(_start_two_processes(str(two)), str(two))  # alone: nothing slows one of them down
    # The reference: this process (8 devices, tests/conftest.py), the same (fsdp 4, tp 2) mesh,
    # the same program.
    sys.path.insert(0, HERE)
    from distributed_worker import train

    single = train(make_learner_mesh(MeshConfig(learner_tp=2)), str(one))
    with open(two / "info.json") as f:
        info = json.load(f)
    assert info == {
        "process_count": 2,
        "devices": 8,
        "local_devices": 4,
        "mesh": {"fsdp": 4, "tp": 2},
        "mesh_processes": [0, 1],
        "other_job_refused": True,  # initialize() again as another process of the job
    }
    multi = dict(np.load(two / "result.npz"))
    assert sorted(multi) == sorted(single)
    final = [k for k in multi if k.startswith("['params']")]
    assert final and all("saved" + k in multi and "restored" + k in multi for k in final)
    # Not bitwise: the gradient reductions over fsdp sum the 4 shards in another order when 2 of
    # them are in each process (gloo between the processes, XLA's own sum inside each) than in
    # one process, so float32 sums differ in the last bits (measured: at most 3e-8 over the
    # parameters, optimizer state and losses after 3 updates; eps=1 keeps Adam from amplifying
    # them). TOL is 8 ulps at 1.0 (the norm scales); the last update moves the parameters by up
    # to 7e-4, so a lost process's rows or a missed update shows.
    diff = {k: float(np.max(np.abs(multi[k] - single[k]), initial=0.0)) for k in single}
    print(f"max |2 processes - 1 process|: {max(diff.values()):.3g} ({max(diff, key=diff.get)})")
    for name in sorted(single):
        np.testing.assert_allclose(multi[name], single[name], atol=TOL, rtol=0, err_msg=name)
    # The checkpoint 2 processes wrote restores what was saved, bit for bit, optimizer included.
    for name in (k for k in multi if k.startswith("saved")):
        np.testing.assert_array_equal(multi["restored" + name[5:]], multi[name], err_msg=name)
    # The last update moved the parameters by far more than TOL: the comparison can tell.
    moved = max(float(np.max(np.abs(multi[k] - multi["saved" + k]))) for k in final)
    print(f"the last update moved the parameters by up to {moved:.3g}")
    assert moved > 100 * TOL
    with open(two / "ckpt" / "2" / "checksums.json") as f:
        assert json.load(f)["files"]  # written once orbax finished, by process 0
    # The damaged step 3: process 0 moved it aside, and both processes restored step 2.
    np.testing.assert_array_equal(multi["damaged_steps"], [3])
    assert (two / "ckpt" / "damaged" / "3").is_dir() and not (two / "ckpt" / "3").exists()


def test_distributed_config_from_config_and_environment():
    assert distributed_config_from(None, env={}) == DistributedConfig()
    base = get_config().learner.distributed
    assert distributed_config_from(base, env={}) == DistributedConfig()
    env = {
        "JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234",
        "JAX_NUM_PROCESSES": "4",
        "JAX_PROCESS_ID": "3",
    }
    got = distributed_config_from(base, env=env)
    assert (got.coordinator_address, got.num_processes, got.process_id) == ("10.0.0.1:1234", 4, 3)
    explicit = {**base, "num_processes": 2, "process_id": 0, "coordinator_address": "h:9"}
    got = distributed_config_from(explicit, env=env)  # set fields win over the environment
    assert (got.coordinator_address, got.num_processes, got.process_id) == ("h:9", 2, 0)
    assert got.multi_process


def test_bad_distributed_config_gets_clear_errors():
    with pytest.raises(
        ValueError, match=r"process_id=2; expected an integer in \[0, num_processes=2\)"
    ):
        DistributedConfig(coordinator_address="h:1", num_processes=2, process_id=2)
    with pytest.raises(
        ValueError, match="coordinator_address='' with num_processes=2; expected 'host:port'"
    ):
        DistributedConfig(num_processes=2, process_id=1)
    with pytest.raises(ValueError, match="coordinator_address='host' .* expected 'host:port'"):
        DistributedConfig(coordinator_address="host", num_processes=2)
    with pytest.raises(ValueError, match="num_processes=0; expected >= 1"):
        DistributedConfig(num_processes=0)
    with pytest.raises(
        ValueError, match=r"num_processes='2'; expected an integer \(received str\)"
    ):
        DistributedConfig(num_processes="2")
    with pytest.raises(ValueError, match=r"\$JAX_NUM_PROCESSES='two'; expected an integer"):
        distributed_config_from({}, env={"JAX_NUM_PROCESSES": "two"})
    with pytest.raises(
        ValueError, match=r"config.learner.distributed has unknown fields \['num_hosts'\]"
    ):
        distributed_config_from({"num_hosts": 2}, env={})
    # jax already ran in this process (its backends are up): joining a job now is refused.
    import jax

    jax.devices()
    cfg = DistributedConfig(coordinator_address=f"127.0.0.1:{_free_port()}", num_processes=2)
    with pytest.raises(RuntimeError, match="could not join .* before any other jax work"):
        initialize(cfg)
    initialize(DistributedConfig())  # one process: nothing to join


def test_coordinator_address_here_is_a_free_port_on_this_host():
    host, port = coordinator_address_here("127.0.0.1").rsplit(":", 1)
    with socket.socket() as s:
        s.bind((host, int(port)))  # free
    cfg = DistributedConfig(coordinator_address=coordinator_address_here(), num_processes=2)
    assert int(cfg.coordinator_address.rsplit(":", 1)[1]) > 0


def test_learner_mesh_spans_all_devices_and_checks_tp():
    import jax

    mesh = make_learner_mesh(MeshConfig(learner_tp=2))
    assert dict(mesh.shape) == {"fsdp": 4, "tp": 2}
    assert list(mesh.devices.flat) == sorted(jax.devices(), key=lambda d: d.id)
    assert dict(make_learner_mesh(MeshConfig(learner_devices=4)).shape) == {"fsdp": 4, "tp": 1}
    with pytest.raises(
        ValueError, match=r"learner_devices=16, but the learner's job has 8 devices"
    ):
        make_learner_mesh(MeshConfig(learner_devices=16))
    with pytest.raises(ValueError, match="learner_tp=3 does not divide the learner's 8 devices"):
        make_learner_mesh(MeshConfig(learner_tp=3))


def test_run_config_check_names_bad_distributed_fields():
    from rl.config_check import ConfigError, check_config

    config = get_config("smoke")
    group = config.learner.distributed
    group.coordinator_address, group.num_processes, group.process_id = "10.0.0.1:1234", 2, 1
    with pytest.raises(ConfigError, match=r"num_processes=2 \(a multi-process learner\) with "):
        check_config(config)  # the threads runtime is one process
    group.process_id = 2
    with pytest.raises(ConfigError, match=r"process_id=2; expected an integer in \[0, "):
        check_config(config)
