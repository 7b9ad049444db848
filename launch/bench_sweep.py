"""Pipeline multiplexing on CPU: N tiny pipelines as one sweep on a pool of sampler replicas, vs the
same pipelines back to back (each alone on the whole pool), in one run.

    python -m launch.bench_sweep [--pipelines 3 --rounds 8 --migration off --json PATH]

Each pipeline is configs/base.py:smoke with its own seed (the sweep `seed=0,1,...`): the addition
task, no SFT, a held-out evaluation every round, the sampler on `--pipelines + 1` replicas of one
fake CPU device each, colocated with the learner on device 0. Back to back runs `rl.run.train` on
each pipeline in turn; multiplexed runs `rl.sweep.run_sweep` (what launch.sweep runs: the pipelines
in threads, replicas moving between them, rl/runtime/pool.py). A warm-up run of one pipeline fills
XLA's persistent compile cache first, so both modes load their programs rather than compile them.
The modes alternate over --repeats; the table gives each mode's median wall time (all pipelines
done, start-up included), the pipelines' summed RL and start-up seconds, the groups trained per
wall second, and the spread (min / median / max) of the paired back-to-back / multiplexed ratio.

Exactness: every pipeline's final parameters are bitwise its back-to-back run's (a digest per
pipeline, checked; the program exits 1 otherwise), and no program compiles after any pipeline's
start (its compile budget, rl/compiles.py).

A correctness-grade figure on a small CPU machine: the pipelines' programs share the machine's
cores, so a replica one pipeline leaves idle computes on cores another pipeline's programs already
use, and the overlap gains only the gaps where every pipeline waits on Python, rewards or
evaluation. On a GPU pool each replica is its own device and the gain is the simulator's
(`python -m launch.simulate --multiplex 2,3,4`).
"""

from __future__ import annotations

import os

# before jax (bench_env imports it): one learner device and up to 8 replica devices
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

from launch import bench_env  # noqa: E402

# isort: split

import hashlib  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

from configs import base  # noqa: E402
from launch import bench_util  # noqa: E402
from rl.logs import log_to_file, quiet_console  # noqa: E402
from rl.run import train  # noqa: E402
from rl.sweep import expand, run_sweep  # noqa: E402

_PIPELINES = flags.DEFINE_integer("pipelines", 3, "Pipelines (seeds 0..N-1); at most 7.")
_ROUNDS = flags.DEFINE_integer("rounds", 8, "RL rounds per pipeline.")
_GROUPS = flags.DEFINE_integer("groups", 16, "Groups per round.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 24, "Response length cap.")
_MIGRATION = flags.DEFINE_enum(
    "migration",
    "off",
    ["off", "tail"],
    "config.elastic.migration: in the sweep `tail` runs on demand (recalled replicas emptied, "
    "joining ones spread to; each pipeline loads its export/import programs at start); alone "
    "it is off. Off, a recalled replica drains.",
)
_REPEATS = flags.DEFINE_integer("repeats", 3, "Back to back and multiplexed, alternating.")
_WORKDIR = flags.DEFINE_string("workdir", "", "Where the runs write; empty: a temporary directory.")
_JSON = flags.DEFINE_string("json", "", "Write the figures here as JSON.")
_CACHE = flags.DEFINE_string("compilation_cache", bench_env.DEFAULT_CACHE, bench_env.CACHE_HELP)


def base_config(workdir: str) -> Any:
    config = base.get_config("smoke")
    config.workdir = workdir
    config.rounds = _ROUNDS.value
    config.sft.max_steps = 0
    config.mesh.sampler_replicas = _PIPELINES.value + 1  # one to move besides the homes
    config.driver.groups_per_round = _GROUPS.value
    config.sampling.max_new_tokens = _MAX_NEW.value
    config.engine.max_length = 32 + _MAX_NEW.value
    config.elastic.migration = _MIGRATION.value
    return config


def pipelines(workdir: str) -> list[tuple[str, Any]]:
    seeds = ",".join(str(s) for s in range(_PIPELINES.value))
    return expand(base_config(workdir), f"seed={seeds}")


def digest(state: Any) -> str:
    leaves = jax.tree.leaves(state)
    data = [
        np.asarray(
            jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x
        )
        for x in leaves
    ]
    return hashlib.sha256(b"".join(x.tobytes() for x in data)).hexdigest()[:16]


def late_compiles(summary: dict[str, Any]) -> int:
    return int(sum(v["after_start"] for v in summary["compiles"].values()))


def mode_row(summaries: list[dict[str, Any]], wall: float) -> dict[str, Any]:
    groups = sum(len(s["rounds"]) for s in summaries) * _GROUPS.value
    return {
        "wall_s": wall,
        "rl_s": sum(s["rl_s"] for s in summaries),
        "setup_s": sum(s["setup_s"] for s in summaries),
        "eval_s": sum(s["eval_s"] for s in summaries),
        "groups_per_s": groups / wall,
        "compiles_after_start": sum(late_compiles(s) for s in summaries),
        "digests": [digest(s["state"]) for s in summaries],
        "heldout_acc_after": [s["heldout_acc_after"] for s in summaries],
    }


def back_to_back(workdir: str) -> dict[str, Any]:
    start = time.perf_counter()
    alone = [config for _, config in pipelines(workdir)]
    for config in alone:
        config.elastic.migration = "off"  # (what `tail` is alone, without its warning)
    summaries = [train(config, stdout=False) for config in alone]
    return mode_row(summaries, time.perf_counter() - start)


def multiplexed(workdir: str) -> dict[str, Any]:
    start = time.perf_counter()
    results = run_sweep(pipelines(workdir))
    wall = time.perf_counter() - start
    failed = [(r.name, r.error) for r in results if r.error is not None]
    if failed:
        raise RuntimeError(f"launch.bench_sweep: pipelines failed in the sweep: {failed}")
    row = mode_row([r.summary for r in results], wall)
    return {
        **row,
        "pool_share": [r.share for r in results],
        "moves_in": [r.stats.moves_in for r in results],
        "recalls": [r.stats.recalls for r in results],
        "migrations": [sum(x.get("migrations", 0) for x in r.summary["rounds"]) for r in results],
    }


def main(argv: list[str]) -> None:
    del argv
    if not 2 <= _PIPELINES.value <= len(jax.devices()) - 1:
        raise app.UsageError(
            f"--pipelines={_PIPELINES.value}; expected 2..{len(jax.devices()) - 1} (one replica "
            f"device each and one more, of {len(jax.devices())})."
        )
    bench_env.use_compilation_cache(_CACHE.value)
    root = _WORKDIR.value or tempfile.mkdtemp(prefix="bench_sweep_")
    quiet_console()  # the runs' library logging (orbax, JAX) goes to a file, not over the table
    print(f"library logging: {log_to_file(os.path.join(root, 'bench_sweep.log'))}")
    warm = base_config(os.path.join(root, "warmup"))
    warm.rounds = 1
    train(warm, stdout=False)  # fills the persistent cache: both modes load, neither compiles
    runs: dict[str, list[dict[str, Any]]] = {"back to back": [], "multiplexed": []}
    for i in range(_REPEATS.value):  # the modes alternate: a slow spell of the machine hits both
        runs["back to back"].append(back_to_back(os.path.join(root, f"{i}", "back_to_back")))
        runs["multiplexed"].append(multiplexed(os.path.join(root, f"{i}", "multiplexed")))
    pairs = list(zip(runs["back to back"], runs["multiplexed"], strict=True))
    ratios = bench_util.spread(b["wall_s"] / m["wall_s"] for b, m in pairs)
    same = all(m["digests"] == b["digests"] for b, m in pairs)
    late = sum(r["compiles_after_start"] for rows in runs.values() for r in rows)
    med = lambda rows, k: bench_util.spread(r[k] for r in rows)["median"]  # noqa: E731
    header = ("mode", "wall s", "rl s", "setup s", "eval s", "groups/s", "vs back to back")
    rows = [header]
    for name, rs in runs.items():
        vs = "1.00x" if name == "back to back" else bench_util.spread_text(ratios, ".2f") + " x"
        rows.append(
            (
                name,
                *(f"{med(rs, k):.1f}" for k in ("wall_s", "rl_s", "setup_s", "eval_s")),
                f"{med(rs, 'groups_per_s'):.2f}",
                vs,
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    print(
        f"{_PIPELINES.value} pipelines (seeds), {_ROUNDS.value} rounds of {_GROUPS.value} groups, "
        f"{_PIPELINES.value + 1} sampler replicas ({jax.devices()[0].platform}, "
        f"{os.cpu_count()} cores); medians of {_REPEATS.value} repeats, the ratio's spread "
        "min / median / max over the paired repeats"
    )
    for row in rows:
        print("  ".join(x.ljust(w) for x, w in zip(row, widths, strict=True)))
    m = runs["multiplexed"][-1]
    print(
        "pool share (last repeat) "
        + ", ".join(f"{s:.0%}" for s in m["pool_share"])
        + "; replicas received "
        + ", ".join(str(n) for n in m["moves_in"])
        + "; recalled from "
        + ", ".join(str(n) for n in m["recalls"])
        + "; requests migrated "
        + ", ".join(str(n) for n in m["migrations"])
        + f" (--migration {_MIGRATION.value})"
    )
    print(f"each pipeline's parameters bitwise its back-to-back run's: {same}")
    print(f"compiles after start: {late}")
    if _JSON.value:
        with open(_JSON.value, "w") as f:
            out = {"runs": runs, "speedup_vs_back_to_back": ratios}
            json.dump({**out, "same_params": same, "compiles_after_start": late}, f, indent=2)
    if not same or late:
        sys.exit(1)


if __name__ == "__main__":
    app.run(main)
