"""Ray weight publish: replicas pulling from the learner worker's devices vs the object store, one run.

    python -m launch.bench_publish [--replicas 2 --publishes 8 --d_model 512 --n_layers 8]

One Ray runtime (a local cluster: the learner worker and --replicas sampler replicas, each a
process) on a model of --n_layers layers of width --d_model (configs/base.py:smoke otherwise,
weights published in bfloat16). Each publish is timed from the Driver's call until every replica
has the weights placed on its devices (rl.runtime.ray_weights: RaySync.publish, then each replica's
set_params), alternating the two ways, "transfer" (each replica pulls from the learner worker's
transfer server, jax.experimental.transfer) and "object_store" (the learner worker puts host arrays
once, each replica gets and places them), after one untimed publish of each. The table gives the
median seconds per publish with its min / max, the bytes each replica receives, the bytes that went
through the object store, and the ratio of the medians (object store / transfer).
On one host's CPU both ways move bytes through the same memory; what "transfer" removes is the
object store's put and get, the numpy arrays and their pickling.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from typing import Any

import ray
from absl import app, flags

from configs import base
from launch import bench_util
from rl.runtime.compose import Setup
from rl.runtime.factory import make_runtime

_REPLICAS = flags.DEFINE_integer("replicas", 2, "Sampler replicas (processes).")
_PUBLISHES = flags.DEFINE_integer("publishes", 8, "Timed publishes per way (after 1 untimed).")
_D_MODEL = flags.DEFINE_integer("d_model", 512, "Model width.")
_LAYERS = flags.DEFINE_integer("n_layers", 8, "Model layers.")
_JSON = flags.DEFINE_string("json", "", "Write the figures here as JSON.")

WAYS = ("transfer", "object_store")


def config_of() -> Any:
    config = base.get_config("smoke")
    config.runtime = "ray"
    config.sft.max_steps = 0
    config.mesh.sampler_replicas = _REPLICAS.value
    config.ray.num_cpus = os.cpu_count() or 1
    config.ray.weights = "transfer"
    d = _D_MODEL.value
    config.model.d_model, config.model.n_layers, config.model.mlp_dim = d, _LAYERS.value, 4 * d
    config.model.n_heads, config.model.n_kv_heads, config.model.head_dim = 8, 4, d // 8
    config.sampler_dtype = "bfloat16"
    return config


def publish(runtime: Any, way: str, version: int) -> dict[str, float]:
    """One publish the `way` way, until every replica holds it; its seconds and bytes."""
    ray.get([w.use_transfer.remote(way == "transfer") for w in runtime.learner.workers])
    before = runtime.weight_sync.object_store_bytes
    start = time.perf_counter()
    published = runtime.weight_sync.publish(runtime.learner.params, version)
    ray.get([r.set_params.remote(published.params, version) for r in runtime.replicas])
    return {
        "seconds": time.perf_counter() - start,
        "learner_seconds": published.seconds,
        "bytes": published.bytes,
        "object_store_bytes": runtime.weight_sync.object_store_bytes - before,
    }


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    if _PUBLISHES.value < 1 or _REPLICAS.value < 1:
        raise app.UsageError("--publishes and --replicas must be >= 1.")
    config = config_of()
    runtime = make_runtime(config, Setup.from_config(config), total_updates=1)
    try:
        if runtime.weights != "transfer":
            raise SystemExit("The learner worker's transfer server did not start.")
        runs: dict[str, list[dict[str, float]]] = {w: [] for w in WAYS}
        version = 0
        for i in range(1 + _PUBLISHES.value):
            for way in WAYS if i % 2 == 0 else WAYS[::-1]:  # alternating which goes first
                row = publish(runtime, way, version)
                version += 1
                if i:  # the first of each way is not timed (a connection, a first placement)
                    runs[way].append(row)
    finally:
        runtime.close()
    out: dict[str, Any] = {}
    print(
        f"{'way':<14}{'s per publish (median)':>24}{'min / max':>18}{'MB each':>10}"
        f"{'object store MB':>17}"
    )
    for way in WAYS:
        s = bench_util.spread(r["seconds"] for r in runs[way])
        mb = runs[way][0]["bytes"] / 2**20
        store = sum(r["object_store_bytes"] for r in runs[way]) / len(runs[way]) / 2**20
        out[way] = {
            "seconds": s,
            "mb_per_replica": mb,
            "object_store_mb": store,
            "learner_seconds": statistics.median(r["learner_seconds"] for r in runs[way]),
        }
        print(
            f"{way:<14}{s['median']:>24.3f}{s['min']:>9.3f} / {s['max']:.3f}{mb:>10.1f}"
            f"{store:>17.1f}"
        )
    out["object_store_over_transfer"] = (
        out["object_store"]["seconds"]["median"] / out["transfer"]["seconds"]["median"]
    )
    print(
        f"object store / transfer, median seconds: {out['object_store_over_transfer']:.2f}x "
        f"({_REPLICAS.value} replicas, {_PUBLISHES.value} publishes each)"
    )
    if _JSON.value:
        with open(_JSON.value, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    app.run(main)
