"""Elastic devices benchmark: long-tail migration (JigsawRL) vs the static replica split.

    python -m launch.bench_elastic [--json /tmp/elastic.json] [--replicas 2,4 --repeats 3]

One process, sampler replicas on fake CPU devices (this module asks XLA for 8 when jax is not yet
imported), a tiny float32 model. Section `migration`: for each replica count n, one long-tailed
round of 4n groups of G samples, routed round-robin (the static split): groups 0..n-1 (one per
replica) run --long_tokens tokens, the others --short_tokens, so when the short ones are done every
replica holds one long group. Warm-up passes (one with every request migrating at every step, so
every engine has compiled its export and import; one per setting) precede the timed runs. Measured
with migration off (the static split) and with the `tail`
policy (--fraction): the round's time (submission to its last group), the replica-seconds busy (per
replica, the round start to the end of its last sequence, summed: what consolidation frees for
other work) and the migrations made, median of --repeats.
Both runs must produce the same tokens (checked: migration does not change what is sampled).

On 2 shared CPU cores the replicas are threads competing for the same cores, so these are
correctness-grade figures: consolidation pays here mostly by running fewer generate calls, not by
freeing a GPU. The paper-scale comparison is the simulator's (python -m launch.simulate
--migration tail).

Section `borrowing` (BiDiRL): the tiny-model workload (configs/base.py:smoke shapes, the addition
task) in `sync` mode through the composition root, a learner of 2 fake devices and a sampler of 2,
with config.elastic.borrowing "off" (the static split) and "learner" (the learner's data-parallel
mesh extends over the sampler's 2 devices once the rollout has drained, and returns before the
publish). The switch-cost prior and the margin are 0, so the learner borrows every round: the figure
is what a move costs or saves here, not the policy's judgement (which the simulator exercises at
GPU scale: launch.simulate --borrowing). Per setting one warm-up round (compiles; not timed), then
--rounds timed rounds: rollout-to-train-end, learner compute, the measured switch (there and back)
and the ratio to the static split. Both settings must sample the same tokens (checked). Correctness-
grade as well: the fake devices share the 2 cores.

Sections `ray_migration`, `ray_lending` and `ray_borrowing` run the same comparisons under the Ray runtime (a
local cluster of --ray_cpus CPUs). ray_migration: the long-tailed round above through n replica
actors (rl.runtime.ray_replica.SamplerReplica, one fake CPU device each, the smoke model with the
engine shape above) behind the ReplicaRouter, migration off vs `tail`, where a move's decode state
crosses processes through the object store (rl.runtime.ray_migration); round time, replica-seconds
busy, moves and MB, tokens checked identical. ray_lending: the borrowing workload with
config.runtime="ray" and borrowing "off" vs "sampler" (the learner worker hosts 2 extra replicas on
its 2 devices while it waits for the round's groups). ray_borrowing: borrowing "off" vs "learner"
under Ray, the learner's mesh extending over the replica actor's 2 devices in another process (the
replica is a process of the learner worker's jax.distributed job: the state crosses through the
object store and back through a gather, the micro-steps reduce across processes over gloo). All
correctness-grade: a Ray run's processes share the same 2 cores.

Every timed round runs under launch.bench_util's CompileWatch: an XLA compile in this process while
timing (the warm-ups must compile every shape) fails the program after its tables (compiles timed:
0; under Ray the learner worker's counted programs are added, a replica actor's engine compiles are
not seen). Each section's objects are released before the next (bench_util.release). Spread:
round_s min-max over the --repeats runs (migration), r2t min / median / max over the timed rounds of
the ratio to the static split's same round (borrowing: both settings train the same prompts).

One function per section: add a section as a function returning its JSON block and name it in
--sections.
"""

from __future__ import annotations

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import hashlib  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import ray  # noqa: E402
from absl import app, flags  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

from configs import base  # noqa: E402
from launch import bench_env, bench_util  # noqa: E402
from rl.admission import FCFS  # noqa: E402
from rl.elastic.migration import MigrationConfig, make_migration_policy  # noqa: E402
from rl.models import create_model, get_preset  # noqa: E402
from rl.runtime.compose import Setup, build_checked_model  # noqa: E402
from rl.runtime.factory import build_driver  # noqa: E402
from rl.runtime.ray_cluster import connect, worker_env  # noqa: E402
from rl.runtime.ray_process import local_mesh, worker_payload  # noqa: E402
from rl.runtime.ray_queue import QueueActor, QueueClient  # noqa: E402
from rl.runtime.ray_replica import SamplerReplica  # noqa: E402
from rl.runtime.ray_router import ReplicaRouter  # noqa: E402
from rl.runtime.replicas import ReplicaSampler  # noqa: E402
from rl.timeline import SLOT_PREFIX, Timeline  # noqa: E402
from rl.types import Group, Request, SamplingParams  # noqa: E402
from sampler.engine import Engine, EngineConfig  # noqa: E402

_JSON = flags.DEFINE_string("json", "", "Write the results here as JSON; empty: don't.")
_SECTIONS = flags.DEFINE_list(
    "sections",
    ["migration", "borrowing"],
    "Sections to run: migration, borrowing, ray_migration, ray_lending.",
)
_RAY_CPUS = flags.DEFINE_integer("ray_cpus", 2, "ray_*: CPUs of the local Ray cluster.")
_REPLICAS = flags.DEFINE_list("replicas", ["2", "4"], "Replica counts (one fake device each).")
_GROUP_SIZE = flags.DEFINE_integer("group_size", 4, "Samples per group (G).")
_SLOTS = flags.DEFINE_integer("slots", 8, "Slots per replica.")
_LONG = flags.DEFINE_integer("long_tokens", 320, "Response length of the long groups.")
_SHORT = flags.DEFINE_integer("short_tokens", 32, "Response length of the other groups.")
_FRACTION = flags.DEFINE_float("fraction", 0.5, "tail policy: running <= this * all slots.")
_STEPS = flags.DEFINE_integer("steps_per_call", 4, "Decode steps fused into one generate call.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed runs of each setting; the median counts.")
_SEED = flags.DEFINE_integer("seed", 0, "Seeds the prompts and the model init.")
WATCH = bench_util.CompileWatch()  # XLA compiles; those inside timed runs fail the program


def _round(n: int) -> list[Request]:
    rng = np.random.default_rng(_SEED.value)
    out = []
    for uid in range(4 * n):
        prompt = tuple(int(t) for t in rng.integers(0, 256, size=int(rng.integers(8, 16))))
        new = _LONG.value if uid < n else _SHORT.value
        params = SamplingParams(temperature=1.0, max_new_tokens=new)
        out.append(Request(uid=uid, prompt=prompt, group_size=_GROUP_SIZE.value, params=params))
    return out


def _sample(engines: list[Engine], params: Any, requests: list[Request], policy: str) -> dict:
    """One round through threaded replicas; its time, replica-seconds busy, moves and tokens."""
    groups: list[Group] = []
    done = threading.Event()

    def emit(g: Group) -> None:
        groups.append(g)
        if len(groups) == len(requests):
            done.set()

    timeline = Timeline()
    cfg = MigrationConfig(policy=policy, max_running_fraction=_FRACTION.value)
    sampler = ReplicaSampler(
        engines,
        make_admission=FCFS,
        reward_fn=lambda r, c: 0.0,
        emit=emit,
        migration=make_migration_policy(cfg, consumer=True),  # the mechanism, forced on
        timeline=timeline,
    )
    sampler.set_params(params, 0)
    sampler.start()
    t0 = time.monotonic()
    sampler.submit(requests)
    try:
        if not done.wait(600):
            raise TimeoutError(f"The round did not finish in 600 s ({len(groups)} groups done).")
    finally:
        sampler.close()
    t1 = time.monotonic()
    ends: dict[int, float] = {}
    for s in timeline.spans(SLOT_PREFIX):
        ends[s.args["replica"]] = max(ends.get(s.args["replica"], t0), s.end)
    stats = sampler.stats
    return dict(
        round_s=t1 - t0,
        replica_s=sum(e - t0 for e in ends.values()),
        migrations=stats.migrations,
        migrated_mb=stats.migrated_bytes / 1e6,
        tokens={g.request.key: [c.tokens for c in g.completions] for g in groups},
    )


MIGRATION_HEADER = (
    f"  {'replicas':>8}{'policy':>8}{'round s':>9}{'min-max':>11}{'vs static':>10}"
    f"{'replica-s':>10}{'vs static':>10}{'moves':>7}{'MB moved':>9}"
)


def _compare(n: int, runs: dict[str, list[dict]]) -> dict[str, dict[str, Any]]:
    """Medians of each policy's runs and their ratios to "off", printed as rows of the table;
    raises unless every setting sampled the same tokens."""
    rows: dict[str, dict[str, Any]] = {}
    for policy, rs in runs.items():
        keys = ("round_s", "replica_s", "migrations", "migrated_mb")
        rows[policy] = {k: statistics.median(r[k] for r in rs) for k in keys}
        rows[policy]["round_s_range"] = [
            min(r["round_s"] for r in rs),
            max(r["round_s"] for r in rs),
        ]
    if any(rs[0]["tokens"] != runs["off"][0]["tokens"] for rs in runs.values()):
        raise AssertionError(f"{n} replicas: migration changed the sampled tokens.")
    for policy, r in rows.items():
        r["round_vs_static"] = r["round_s"] / rows["off"]["round_s"]
        r["replica_s_vs_static"] = r["replica_s"] / rows["off"]["replica_s"]
        lo, hi = r["round_s_range"]
        print(
            f"  {n:>8}{policy:>8}{r['round_s']:>9.3f}{f'{lo:.2f}-{hi:.2f}':>11}"
            f"{r['round_vs_static']:>9.2f}x{r['replica_s']:>10.3f}{r['replica_s_vs_static']:>9.2f}x"
            f"{r['migrations']:>7.0f}{r['migrated_mb']:>9.2f}"
        )
    return rows


def migration_section() -> dict[str, Any]:
    """Static split vs long-tail migration, per replica count (the module docstring)."""
    model = create_model(get_preset("tiny", init_std=0.3), seed=_SEED.value)
    cfg = EngineConfig(
        max_slots=_SLOTS.value,
        max_length=32 + _LONG.value,
        max_prefill_length=16,
        steps_per_call=_STEPS.value,
    )
    out: dict[str, Any] = {}
    print(
        f"migration: G={_GROUP_SIZE.value}, {_SLOTS.value} slots per replica, 4n groups (n long "
        f"of {_LONG.value} tokens, 3n of {_SHORT.value}), tail policy at {_FRACTION.value:.0%} "
        f"of slots; median of {_REPEATS.value}"
    )
    print(MIGRATION_HEADER)
    counts = [int(n) for n in _REPLICAS.value]
    if max(counts) > len(jax.devices()) or min(counts) < 2:
        raise ValueError(
            f"--replicas {counts}: expected counts >= 2, at most the {len(jax.devices())} devices."
        )
    # One engine per device, shared by the settings (each compiles once).
    pool = [
        Engine(model, cfg, mesh=Mesh(np.array([d]).reshape(1, 1), ("data", "tp")))
        for d in jax.devices()[: max(counts)]
    ]
    params = pool[0].load_params(model)
    for n in counts:
        engines = pool[:n]
        requests = _round(n)
        _sample(engines, params, requests, "always")  # warm-up: every engine's export/import
        runs = {}
        for policy in ("off", "tail"):
            _sample(engines, params, requests, policy)  # warm-up: compiles
            with WATCH.timed():
                runs[policy] = [
                    _sample(engines, params, requests, policy) for _ in range(_REPEATS.value)
                ]
        rows = _compare(n, runs)
        out[f"replicas{n}"] = rows
    print(
        "  round s: submission to the last group; replica-s: per replica, the round start to the "
        "end of its last sequence, summed; vs static: over migration off; the same tokens in "
        "both (checked). Correctness-grade "
        "figures: the replicas share 2 CPU cores."
    )
    return out


KEYS = ("rollout_to_train_end_s", "trainer_compute_s", "rollout_s")

_ROUNDS = flags.DEFINE_integer(
    "rounds", 3, "borrowing: timed rounds per setting (after 1 warm-up)."
)
_GROUPS = flags.DEFINE_integer("groups", 8, "borrowing: R, groups per round.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 32, "borrowing: response length cap.")
_CACHE = flags.DEFINE_string("compilation_cache", bench_env.DEFAULT_CACHE, bench_env.CACHE_HELP)


def borrowing_config(
    borrowing: str, *, groups: int, max_new_tokens: int, runtime: str = "threads"
) -> Any:
    """The benchmark's run config: learner 2 + sampler 2 devices, sync, borrowing as given."""
    config = base.get_config("smoke")
    config.runtime = runtime
    config.ray.num_cpus = _RAY_CPUS.value
    config.sft.max_steps = 0
    config.driver.mode, config.driver.batching = "sync", "ordered"
    config.driver.groups_per_round = groups
    config.sampling.max_new_tokens = max_new_tokens
    config.engine.max_length = max_new_tokens + 32
    config.engine.max_prefill_length = 32
    config.engine.max_slots = 16
    config.mesh.colocated = False
    config.mesh.learner_devices, config.mesh.sampler_devices = 2, 2
    config.elastic.borrowing = borrowing
    config.elastic.stage_model = "preset:qwen3-1.7b:h100"  # weighed against a 0 s prior: moves
    config.elastic.switch_cost_s, config.elastic.margin = 0.0, 0.0
    return config


def borrowing_runs(
    rounds: int,
    groups: int,
    max_new_tokens: int,
    *,
    runtime: str = "threads",
    direction: str = "learner",
) -> dict[str, Any]:
    """Rollout-to-train-end with borrowing off and on in `direction` (the module docstring)."""
    out: dict[str, Any] = {}
    for setting in ("off", direction):
        config = borrowing_config(
            setting, groups=groups, max_new_tokens=max_new_tokens, runtime=runtime
        )
        built, driver = build_driver(config, rounds=rounds + 1)
        try:
            results = [driver.run_round(0)]  # warm-up: compiles
            counted = -programs(built)
            with WATCH.timed():
                results += [driver.run_round(r) for r in range(1, rounds + 1)]
            counted += programs(built)
        finally:
            driver.close()
            built.close()
        del built, driver
        bench_util.release()
        timed = [r.metrics for r in results[1:]]
        row = {k: float(np.mean([m.get(k, np.nan) for m in timed])) for k in KEYS}
        row["switch_s"] = float(
            np.mean([m.get(f"borrow_{direction}_measured_s", np.nan) for m in timed])
        )
        row["borrowed_rounds"] = float(sum(m.get(f"borrow_{direction}", 0.0) for m in timed))
        digest = hashlib.sha256(
            repr([[c.tokens for g in r.groups for c in g.completions] for r in results]).encode()
        ).hexdigest()[:12]
        row["tokens_digest"] = digest
        row["per_round_r2t_s"] = [m["rollout_to_train_end_s"] for m in timed]
        row["learner_compiles_timed"] = counted  # the runtime's counters (Ray: its workers')
        out[setting] = row
    if out["off"]["tokens_digest"] != out[direction]["tokens_digest"]:
        raise RuntimeError("Borrowing changed the sampled tokens; expected the same tokens.")
    base_r2t = out["off"]["rollout_to_train_end_s"]
    for row in out.values():
        row["r2t_vs_static"] = row["rollout_to_train_end_s"] / base_r2t
        row["r2t_vs_static_per_round"] = bench_util.spread(
            a / b
            for a, b in zip(row["per_round_r2t_s"], out["off"]["per_round_r2t_s"], strict=True)
        )
    return out


def programs(runtime: Any) -> int:
    """Programs the runtime's counted jitted steps compiled so far (rl/compiles.py)."""
    return int(sum(v["programs"] for v in runtime.compile_stats().values()))


def borrowing_section(runtime: str = "threads", direction: str = "learner") -> dict[str, Any]:
    """The borrowing section: borrowing_runs with the flags' sizes, printed as a table."""
    bench_env.use_compilation_cache(_CACHE.value)
    rows = borrowing_runs(
        _ROUNDS.value, _GROUPS.value, _MAX_NEW.value, runtime=runtime, direction=direction
    )
    print(
        f"borrowing {direction} ({runtime} runtime, sync, R={_GROUPS.value}, learner 2 + sampler 2 "
        f"fake CPU devices, {_ROUNDS.value} timed rounds; correctness-grade on shared cores)"
    )
    print(
        f"  {'setting':<10}{'r2t s':>8}{'vs static':>10}{'per round min/med/max':>23}{'train s':>9}"
        f"{'switch s':>9}{'moves':>7}"
    )
    for name, r in rows.items():
        per_round = bench_util.spread_text(r["r2t_vs_static_per_round"], ".2f")
        print(
            f"  {name:<10}{r['rollout_to_train_end_s']:>8.3f}{r['r2t_vs_static']:>9.2f}x"
            f"{per_round:>23}{r['trainer_compute_s']:>9.3f}{r['switch_s']:>9.3f}"
            f"{r['borrowed_rounds']:>7.0f}"
        )
    print(f"  same tokens in both settings: {rows['off']['tokens_digest']}")
    return rows


def _ray_round(actors: list[Any], queue: Any, params: Any, requests: list[Request], migration: Any):
    """One round through replica actors behind a ReplicaRouter (fresh loops, the same engines);
    as _sample."""
    ray.get([a.renew.remote() for a in actors])
    router = ReplicaRouter(
        actors,
        routing="round_robin",
        on_failure="stop",
        timeline=Timeline(),
        queue=queue,
        migration=migration,
        migration_poll_s=0.005,
    )
    router.set_params(params, 0)
    client = QueueClient(queue, router.accept)
    router.start()
    t0 = time.monotonic()
    router.submit(requests)
    groups = [client.get(timeout=600) for _ in requests]
    t1 = time.monotonic()
    stats = router.stats  # merges the replicas' slot spans into router.timeline
    router.close()
    ends: dict[int, float] = {}
    for s in router.timeline.spans(SLOT_PREFIX):
        ends[s.args["replica"]] = max(ends.get(s.args["replica"], t0), s.end)
    return dict(
        round_s=t1 - t0,
        replica_s=sum(e - t0 for e in ends.values()),
        migrations=stats.migrations,
        migrated_mb=stats.migrated_bytes / 1e6,
        tokens={g.request.key: [c.tokens for c in g.completions] for g in groups},
    )


def ray_migration_section() -> dict[str, Any]:
    """Static split vs long-tail migration across Ray replica actors (the module docstring)."""
    bench_env.use_compilation_cache(_CACHE.value)
    config = base.get_config("smoke")
    config.engine.max_slots, config.engine.max_length = _SLOTS.value, 32 + _LONG.value
    config.engine.steps_per_call = _STEPS.value
    config.ray.num_cpus = _RAY_CPUS.value
    owns = connect(config.ray)
    setup = Setup.from_config(config)
    model = build_checked_model(config, setup, local_mesh(config, "sampler"))
    params = ray.put(jax.device_get(nnx.split(model)[1]))
    policy = make_migration_policy(
        MigrationConfig(policy="tail", max_running_fraction=_FRACTION.value), consumer=True
    )
    print(
        f"ray_migration: replica actors, G={_GROUP_SIZE.value}, {_SLOTS.value} slots each, 4n "
        f"groups (n of {_LONG.value} tokens, 3n of {_SHORT.value}); median of {_REPEATS.value}"
    )
    print(MIGRATION_HEADER)
    out: dict[str, Any] = {}
    try:
        for n in (int(r) for r in _REPLICAS.value):
            queue = QueueActor.options(num_cpus=0, max_concurrency=4 + 2 * n).remote(4 * n)
            env = worker_env()
            actors = [
                SamplerReplica.options(num_cpus=0, runtime_env=env).remote(
                    worker_payload(config), queue
                )
                for _ in range(n)
            ]
            requests = _round(n)
            always = make_migration_policy(MigrationConfig(policy="always"))
            _ray_round(actors, queue, params, requests, always)  # warm-up: export/import
            runs = {}
            for name, migration in (("off", None), ("tail", policy)):
                _ray_round(actors, queue, params, requests, migration)  # warm-up
                with WATCH.timed():
                    runs[name] = [
                        _ray_round(actors, queue, params, requests, migration)
                        for _ in range(_REPEATS.value)
                    ]
            rows = _compare(n, runs)
            for actor in (*actors, queue):
                ray.kill(actor)
            out[f"replicas{n}"] = rows
    finally:
        if owns:
            ray.shutdown()
    print("  same tokens with and without migration (checked); correctness-grade on 2 cores.")
    return out


SECTIONS = {
    "migration": migration_section,
    "borrowing": borrowing_section,
    "ray_migration": ray_migration_section,
    "ray_lending": lambda: borrowing_section("ray", "sampler"),
    "ray_borrowing": lambda: borrowing_section("ray", "learner"),
}


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    unknown = [s for s in _SECTIONS.value if s not in SECTIONS]
    if unknown:
        raise app.UsageError(f"--sections {unknown}; expected names from {sorted(SECTIONS)}.")
    out: dict[str, Any] = {}
    with WATCH:
        for name in _SECTIONS.value:
            out[name] = SECTIONS[name]()
            out[name]["memory_maps_released"] = bench_util.release()
    learner = sum(
        row["learner_compiles_timed"]
        for name in _SECTIONS.value
        if "borrowing" in name or "lending" in name
        for row in out[name].values()
        if isinstance(row, dict)
    )
    out["compiles_timed"] = WATCH.compiles_timed + learner
    print(
        f"compiles timed: {out['compiles_timed']} (this process's XLA compiles while timing, plus "
        f"the learners' counted programs); memory maps {bench_util.memory_maps()}"
    )
    if _JSON.value:
        with open(_JSON.value, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=2)
        print(f"wrote {_JSON.value}")
    bench_util.fail_if_compiled("launch.bench_elastic", out["compiles_timed"], WATCH.timed_names())


if __name__ == "__main__":
    app.run(main)
