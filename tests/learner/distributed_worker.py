"""One process of a multi-process learner, for tests/learner/test_distributed.py.

    python tests/learner/distributed_worker.py --process_id=0 --num_processes=2 --port=P \
        --workdir=DIR     # with XLA_FLAGS=--xla_force_host_platform_device_count=4

Every process runs `train` on the same fixed groups; process 0 writes the parameters, the
checkpointed state and its restored copy, gathered to host, to DIR/result.npz. The test runs
`train` itself in one process of 8 devices (the same mesh shape) and compares.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(os.path.dirname(HERE)), HERE]  # the repo root; test_learner

START = time.perf_counter()
UPDATES = 3
SAVE_AFTER = 2  # the checkpoint holds the state after this many updates


def _log(what: str) -> None:  # phases and times, in the process logs the test prints on failure
    print(f"{time.perf_counter() - START:6.1f}s {what}", flush=True)


def _flat(tree: Any, prefix: str) -> dict[str, np.ndarray]:
    import jax

    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {f"{prefix}{jax.tree_util.keystr(p)}": np.asarray(x) for p, x in leaves}


def train(mesh: Any, workdir: str) -> dict[str, Any]:
    """Trains the tiny model UPDATES updates, checkpointing after SAVE_AFTER and at the end.

    The last checkpoint is then damaged (its checksums removed, by process 0), so restoring
    falls back to SAVE_AFTER's.

    Returns:
      Host arrays (the same in every process) by tree path: "['params']..." (the final
      parameters), "saved['params']..." and "saved['opt']..." (parameters and optimizer state when
      checkpointed), "restored[...]..." (what the checkpoint gives back), "losses" and
      "damaged_steps" (the steps process 0's restore moved aside).
    """
    import jax
    from test_learner import make_groups

    from learner.checkpoint import Checkpointer
    from learner.config import LearnerConfig, OptimizerConfig
    from learner.distributed import gather_to_host
    from learner.learner import Learner
    from rl.models import create_model, get_preset

    # eps=1 keeps Adam Lipschitz in the gradient (test_learner.WELL_CONDITIONED): a float32
    # rounding difference in a near-zero gradient entry stays a rounding difference.
    # old_logprobs="sampler": every update runs the same two programs (fewer compiles than the
    # snapshot's second accumulate program; the test is about the processes, not the loss).
    cfg = LearnerConfig(
        optimizer=OptimizerConfig(lr=0.1, eps=1.0), micro_batch_rows=8, old_logprobs="sampler"
    )
    _log("imported")
    learner = Learner(create_model(get_preset("tiny"), seed=2), cfg, mesh=mesh)
    _log("learner built")
    ckpt = Checkpointer(os.path.join(workdir, "ckpt"))
    out: dict[str, Any] = {}
    losses = []
    learner.begin_round(updates=UPDATES)
    for update in range(UPDATES):
        learner.add_groups(make_groups(3, seed=update))  # 12 rows: a micro-batch and a remainder
        losses.append(learner.update()["loss"])
        _log(f"update {update + 1}")
        if update + 1 == SAVE_AFTER:
            ckpt.save(SAVE_AFTER, learner.state, {"updates": SAVE_AFTER})
            saved = gather_to_host({"params": learner.params, "opt": learner.state.opt_state})
            out.update(_flat(saved, "saved"))
    ckpt.save(UPDATES, learner.state, {"updates": UPDATES})
    ckpt.wait()  # every process: step UPDATES is written, its checksums too
    _log("checkpoints saved")
    if jax.process_index() == 0:  # as if the last save was killed before its checksums
        os.remove(os.path.join(ckpt.directory, str(UPDATES), "checksums.json"))
    # Process 0 finds the newest step damaged, moves it aside; every process restores the older.
    restored, meta = ckpt.restore(abstract_state=learner.state, shardings=learner.shardings)
    out["damaged_steps"] = np.asarray([s for s, _ in ckpt.damaged], np.int32)  # process 0's
    if meta != {"updates": SAVE_AFTER} or int(restored.step) != SAVE_AFTER:
        raise AssertionError(f"restored meta {meta}, step {int(restored.step)}")
    out.update(
        _flat(gather_to_host({"params": restored.params, "opt": restored.opt_state}), "restored")
    )
    problem = ckpt.verify(SAVE_AFTER)
    if problem is not None:
        raise AssertionError(f"checkpoint {SAVE_AFTER} does not verify: {problem}")
    ckpt.close()
    _log("checkpoint restored")
    out.update(_flat(gather_to_host({"params": learner.params}), ""))
    out["losses"] = np.asarray(losses)
    _log("parameters gathered")
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--process_id", type=int, required=True)
    parser.add_argument("--num_processes", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--workdir", required=True)
    args = parser.parse_args()

    from configs.base import get_config
    from learner.distributed import init_learner_group

    config = get_config("smoke")
    config.mesh.learner_devices = 0  # all of the job's devices
    config.mesh.learner_tp = 2
    config.learner.distributed.coordinator_address = f"127.0.0.1:{args.port}"
    config.learner.distributed.num_processes = args.num_processes
    config.learner.distributed.process_id = args.process_id
    config.learner.distributed.initialization_timeout_s = 60
    mesh = init_learner_group(config)
    _log("joined the job")

    import jax

    from learner.distributed import DistributedConfig, initialize

    same = DistributedConfig(
        coordinator_address=f"127.0.0.1:{args.port}",
        num_processes=args.num_processes,
        process_id=args.process_id,
    )
    initialize(same)  # again, the same job: a no-op
    other = (args.process_id + 1) % args.num_processes
    try:
        initialize(dataclasses.replace(same, process_id=other))
    except RuntimeError as e:
        refused = f"expected process {other} of {args.num_processes}" in str(e)
    else:
        refused = False

    out = train(mesh, args.workdir)
    if jax.process_index() == 0:
        np.savez(os.path.join(args.workdir, "result.npz"), **out)
        info = {
            "process_count": jax.process_count(),
            "devices": len(jax.devices()),
            "local_devices": len(jax.local_devices()),
            "mesh": dict(mesh.shape),
            "mesh_processes": sorted({d.process_index for d in mesh.devices.flat}),
            "other_job_refused": refused,
        }
        with open(os.path.join(args.workdir, "info.json"), "w") as f:
            json.dump(info, f)


if __name__ == "__main__":
    main()
