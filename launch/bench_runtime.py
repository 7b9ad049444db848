"""Runtimes: rollout-to-train-end of sync vs cgp (ordered, fifo), threads next to Ray, one run.

    python -m launch.bench_runtime [--rounds 3 --groups 16 --json /tmp/bench_runtime.json]

The same tiny-model workload (configs/base.py:smoke shapes, the addition task, R groups of G
samples per round, U groups per update) through the composition root (rl.runtime.compose) with
config.runtime = "threads" (one process: the sampler thread and the learner loop share the cores)
and "ray" (a local cluster: the learner worker and one sampler replica in separate processes,
pinned to separate cores with os.sched_setaffinity when the machine has two or more). Per runtime
and mode: one warm-up round (compiles; not timed), then --rounds timed rounds; the table gives the
means of rl.metrics.round_metrics and the speedup against sync of the same runtime, with the
spread of that speedup over the timed rounds (min / median / max of the per-round ratios: round r of
every mode trains the same prompts). Every runtime/mode pair samples the same tokens (checked: a
digest of the trained groups' tokens). The runtime compiles every learner and engine program before
round 0 (rl/compiles.py). A compile during a timed round fails the program after its
table (compiles timed: XLA compiles in this process plus the programs the learner and the engines
count, which under Ray run in the learner worker and the replicas). Each runtime is closed and
released before the next.
"""

from __future__ import annotations

import os

from launch import bench_env  # before jax: two CPU devices

# isort: split

import hashlib  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

from configs import base  # noqa: E402
from launch import bench_util  # noqa: E402
from rl.runtime.factory import build_driver  # noqa: E402

MODES = {
    "sync": ("sync", "ordered"),
    "cgp+ordered": ("cgp", "ordered"),
    "cgp+fifo": ("cgp", "fifo"),
}
RUNTIMES = ("threads", "ray")
KEYS = ("rollout_to_train_end_s", "first_dispatch_s", "trainer_wait_ratio", "rollout_s")

_ROUNDS = flags.DEFINE_integer("rounds", 3, "Timed rounds per runtime and mode (after 1 warm-up).")
_GROUPS = flags.DEFINE_integer("groups", 16, "R: groups per round.")
_PER_UPDATE = flags.DEFINE_integer("groups_per_update", 2, "U: groups per optimizer update.")
_GROUP_SIZE = flags.DEFINE_integer("group_size", 4, "G: samples per group.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 32, "Response length cap.")
_SLOTS = flags.DEFINE_integer("slots", 16, "Engine slots of the sampler (one replica).")
_PIN = flags.DEFINE_bool("pin", True, "ray: pin the learner and the replica to separate cores.")
_RUNTIMES = flags.DEFINE_list("runtimes", list(RUNTIMES), f"Runtimes to run, from {RUNTIMES}.")
_JSON = flags.DEFINE_string("json", "", "Write the figures here as JSON.")
_CACHE = flags.DEFINE_string("compilation_cache", bench_env.DEFAULT_CACHE, bench_env.CACHE_HELP)


def config_of(runtime: str, mode: str) -> Any:
    config = base.get_config("smoke")
    config.runtime = runtime
    config.sft.max_steps = 0
    config.driver.mode, config.driver.batching = MODES[mode]
    config.driver.groups_per_round = _GROUPS.value
    config.driver.groups_per_update = _PER_UPDATE.value
    config.driver.group_size = _GROUP_SIZE.value
    config.learner.micro_batch_rows = _PER_UPDATE.value * _GROUP_SIZE.value
    config.sampling.max_new_tokens = _MAX_NEW.value
    config.engine.max_slots = _SLOTS.value
    config.engine.max_length = 16 + _MAX_NEW.value
    config.mesh.colocated = False  # threads: learner on device 0, sampler on device 1
    config.ray.num_cpus = os.cpu_count() or 1
    return config


def pin_workers(runtime: Any) -> dict[str, list[int]]:
    """The learner worker on core 0, the replica on core 1 (separate processes, separate cores)."""
    import ray

    cores = sorted(os.sched_getaffinity(0))
    if not _PIN.value or len(cores) < 2:
        return {}
    return {
        "learner": ray.get(runtime.learner.workers[0].pin.remote([cores[0]])),
        "replica0": ray.get(runtime.replicas[0].pin.remote([cores[1]])),
    }


def counted_compiles(runtime: Any) -> int:
    """Programs the runtime's learner and engines compiled so far (rl/compiles.py; under Ray, its
    workers' and replicas')."""
    return int(sum(v["programs"] for v in runtime.compile_stats().values()))


def run(runtime_name: str, mode: str, watch: bench_util.CompileWatch) -> dict[str, Any]:
    rounds = 1 + _ROUNDS.value
    timed_before = watch.compiles_timed
    runtime, driver = build_driver(config_of(runtime_name, mode), rounds=rounds)
    try:
        pinned = pin_workers(runtime) if runtime_name == "ray" else {}
        results = []
        try:
            results.append(driver.run_round(0))
            counted = counted_compiles(runtime)
            with watch.timed():
                for r in range(1, rounds):
                    results.append(driver.run_round(r))
            counted = counted_compiles(runtime) - counted
        finally:
            driver.close()
    finally:
        runtime.close()
    del runtime, driver
    maps = bench_util.release()
    timed = [r.metrics for r in results[1:]]
    digest = hashlib.sha256(
        repr([[c.tokens for g in r.groups for c in g.completions] for r in results]).encode()
    ).hexdigest()[:16]
    return {
        **{k: float(np.mean([m[k] for m in timed])) for k in KEYS},
        "warmup_round_s": results[0].metrics["rollout_to_train_end_s"],
        "per_round_r2t_s": [m["rollout_to_train_end_s"] for m in timed],
        "tokens_digest": digest,
        "pinned": pinned,
        "compiles_timed": watch.compiles_timed - timed_before + counted,
        "memory_maps_released": maps,
    }


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    if _GROUPS.value % _PER_UPDATE.value or _ROUNDS.value < 1:
        raise app.UsageError(
            f"--groups ({_GROUPS.value}) must be a multiple of --groups_per_update "
            f"({_PER_UPDATE.value}) and --rounds ({_ROUNDS.value}) >= 1."
        )
    if not _RUNTIMES.value or set(_RUNTIMES.value) - set(RUNTIMES):
        raise app.UsageError(f"--runtimes={_RUNTIMES.value}; expected some of {RUNTIMES}.")
    bench_env.use_compilation_cache(_CACHE.value)
    out: dict[str, dict[str, Any]] = {}
    start = time.perf_counter()
    if "ray" in _RUNTIMES.value:
        import logging

        import ray

        os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _CACHE.value)  # the workers' cache
        ray.init(
            num_cpus=os.cpu_count(),
            include_dashboard=False,
            log_to_driver=False,
            logging_level=logging.ERROR,
        )
    try:
        with bench_util.CompileWatch() as watch:
            for runtime_name in _RUNTIMES.value:
                for mode in MODES:
                    out[f"{runtime_name}/{mode}"] = run(runtime_name, mode, watch)
    finally:
        if "ray" in _RUNTIMES.value:
            ray.shutdown()
    digests = {r["tokens_digest"] for r in out.values()}
    print(
        f"R={_GROUPS.value} G={_GROUP_SIZE.value} U={_PER_UPDATE.value} max_new_tokens="
        f"{_MAX_NEW.value} slots={_SLOTS.value}, {_ROUNDS.value} timed rounds, "
        f"{os.cpu_count()} cores; ray pinned: {out.get('ray/sync', {}).get('pinned') or 'no'}; "
        "same tokens "
        f"everywhere: {len(digests) == 1}; {time.perf_counter() - start:.0f} s in all"
    )
    print(
        "| runtime | mode | rollout-to-train-end | speedup vs sync (same runtime) | per round min / "
        "median / max | first dispatch | trainer wait | rollout | compiles timed |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for key, r in out.items():
        runtime_name, mode = key.split("/")
        sync = out[f"{runtime_name}/sync"]
        r["speedup_vs_sync"] = sync["rollout_to_train_end_s"] / r["rollout_to_train_end_s"]
        r["speedup_vs_sync_per_round"] = bench_util.spread(
            a / b for a, b in zip(sync["per_round_r2t_s"], r["per_round_r2t_s"], strict=True)
        )
        print(
            f"| {runtime_name} | {mode} | {r['rollout_to_train_end_s']:.2f} s | "
            f"{r['speedup_vs_sync']:.2f}x | "
            f"{bench_util.spread_text(r['speedup_vs_sync_per_round'], '.2f')} | "
            f"{r['first_dispatch_s']:.2f} s | {r['trainer_wait_ratio']:.2f} | "
            f"{r['rollout_s']:.2f} s | {r['compiles_timed']} |"
        )
    compiles_timed = sum(r["compiles_timed"] for r in out.values())
    print(f"compiles timed: {compiles_timed}; memory maps {bench_util.memory_maps()}")
    if _JSON.value:
        with open(_JSON.value, "w") as f:
            json.dump(dict(runs=out, compiles_timed=compiles_timed), f, indent=2)
    bench_util.fail_if_compiled("launch.bench_runtime", compiles_timed, watch.timed_names())


if __name__ == "__main__":
    app.run(main)
