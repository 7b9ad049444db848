"""A sweep: several pipelines from one config, run at once on one pool of devices.

    configs = expand(config, "learner.optimizer.lr=1e-4,3e-4;seed=0,1")   # [(name, config)]
    results = run_sweep(configs)   # what launch.sweep runs; also from a Colab cell

Each pipeline is the base config with the swept fields set and its own workdir,
`<config.workdir>/<name>`, and runs as `rl.run.train` runs it alone: SFT warm start, evaluations,
checkpoints and resume included. The pipelines run in threads of this process and share the
sampler replicas through a `ReplicaPool` (rl/runtime/pool.py: each pipeline's tokens and parameters
are bitwise its solo run's); under config.runtime='ray' the replicas are the pool's host actors
(rl/runtime/ray_host.py), started here before the pipelines. A pipeline that fails stops alone,
its error kept with its name.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import ml_collections

from rl.config_check import ConfigError, check_config
from rl.elastic.multiplex import MultiplexPolicy
from rl.run import train
from rl.runtime.factory import share_pool
from rl.runtime.pool import MemberStats, ReplicaPool
from rl.runtime.ray_config import check_pooled

_TRUE, _FALSE = ("true", "1", "yes"), ("false", "0", "no")


def _field(config: ml_collections.ConfigDict, key: str) -> tuple[Any, str]:
    """(the ConfigDict holding `key`'s last part, that part); raises naming an unknown key."""
    *path, last = key.split(".")
    node = config
    for i, part in enumerate(path):
        if not isinstance(node, ml_collections.ConfigDict) or part not in node:
            raise ValueError(f"--sweep.values: no config field {'.'.join(path[: i + 1])!r}.")
        node = node[part]
    if not isinstance(node, ml_collections.ConfigDict) or last not in node:
        raise ValueError(f"--sweep.values: no config field {key!r}.")
    if isinstance(node[last], ml_collections.ConfigDict):
        raise ValueError(f"--sweep.values: {key!r} is a section; expected a field in it.")
    return node, last


def _parse(text: str, like: Any, key: str) -> Any:
    """`text` as a value of `like`'s type (the field's current value)."""
    try:
        if isinstance(like, bool):
            if text.lower() not in _TRUE + _FALSE:
                raise ValueError(f"expected one of {_TRUE + _FALSE}")
            return text.lower() in _TRUE
        if isinstance(like, int):
            return int(text)
        if isinstance(like, float):
            return float(text)
        if isinstance(like, str):
            return text
    except ValueError as e:
        raise ValueError(
            f"--sweep.values: {key}={text!r}: expected type {type(like).__name__} ({e})."
        ) from None
    raise ValueError(
        f"--sweep.values: {key} is a {type(like).__name__}; a sweep sets bool, int, float and "
        "str fields."
    )


def expand(
    config: ml_collections.ConfigDict, values: str
) -> list[tuple[str, ml_collections.ConfigDict]]:
    """The pipelines of a sweep: `values` is `key=v1,v2,...`, several keys separated by ';'
    giving their product. Each pipeline is named `key=v[,key=v...]` and writes to
    `<config.workdir>/<name>`.

    Raises:
      ValueError: malformed values, an unknown or non-scalar field, a value of the wrong type,
        a swept mesh or workdir field (the pipelines share the pool's devices and the root), or
        fewer than two pipelines.
    """
    axes = []
    for part in [p.strip() for p in values.split(";") if p.strip()]:
        key, sep, listed = part.partition("=")
        key = key.strip()
        options = [v.strip() for v in listed.split(",")]
        if not sep or not key or not all(options):
            raise ValueError(
                f"--sweep.values: {part!r}; expected key=v1,v2,... (keys separated by ';')."
            )
        if key.split(".")[0] in ("mesh", "workdir", "runtime"):
            raise ValueError(
                f"--sweep.values: {key!r}: the pipelines share one pool of devices and one "
                "workdir root; expected a field outside mesh, workdir and runtime."
            )
        node, last = _field(config, key)
        axes.append([(key, _parse(v, node[last], key)) for v in options])
    if not axes:
        raise ValueError("--sweep.values is empty; expected key=v1,v2,...")
    out = []
    for combo in itertools.product(*axes):
        name = ",".join(f"{k}={v}" for k, v in combo)
        c = copy.deepcopy(config)
        for key, v in combo:
            node, last = _field(c, key)
            node[last] = v
        c.workdir = os.path.join(config.workdir, name)
        out.append((name, c))
    if len(out) < 2:
        raise ValueError(f"--sweep.values={values!r} gives {len(out)} pipeline; expected >= 2.")
    return out


@dataclasses.dataclass
class PipelineResult:
    """One pipeline of a sweep: its summary (rl.run.train's) or the error that stopped it."""

    name: str
    summary: dict[str, Any] | None
    error: BaseException | None
    wall_s: float
    share: float  # its share of the pool's replica-seconds over the sweep
    stats: MemberStats


def run_sweep(
    configs: Sequence[tuple[str, ml_collections.ConfigDict]],
    *,
    policy: MultiplexPolicy | None = None,
    stop: threading.Event | None = None,
    on_start: Callable[[str], None] | None = None,
) -> list[PipelineResult]:
    """Runs the pipelines at once on one ReplicaPool (module docstring); every config is checked
    first, so a bad one stops the sweep before anything starts.

    Args:
      configs: (name, config) per pipeline (`expand`); they share config.mesh.
      policy: the pool's (default rl/elastic/multiplex.py's look-ahead policy).
      stop: set it to end every pipeline at its next safe point (launch.sweep: SIGTERM).
      on_start: called with each pipeline's name as its thread starts.
    """
    names = [n for n, _ in configs]
    meshes = {str(c.mesh.to_dict()) for _, c in configs}
    if len(meshes) != 1:
        raise ValueError("The sweep's pipelines have different config.mesh sections; expected one.")
    for name, c in configs:
        try:
            check_config(c)
        except ConfigError as e:  # (one line per field, each naming the pipeline)
            raise ConfigError([f"pipeline {name}: {p}" for p in e.problems]) from None
        except ValueError as e:
            raise ValueError(f"pipeline {name}: {e}") from None
        if c.get("runtime", "threads") == "ray":
            try:
                check_pooled(c)
            except ValueError as e:
                raise ValueError(f"pipeline {name}: {e}") from None
        if c.elastic.borrowing != "off":
            raise ValueError(
                f"pipeline {name}: config.elastic.borrowing={c.elastic.borrowing!r}; a sweep's "
                "pool moves the replicas itself: expected 'off'."
            )
    replicas = configs[0][1].mesh.sampler_replicas
    if replicas < len(configs):
        raise ValueError(
            f"{len(configs)} pipelines need a sampler replica each; config.mesh.sampler_replicas "
            f"is {replicas}: set --config.mesh.sampler_replicas={len(configs)} or more."
        )
    pool = ReplicaPool(names, replicas=replicas, policy=policy)
    results: list[Any] = [None] * len(configs)
    start = time.perf_counter()

    def run(i: int) -> None:
        t = time.perf_counter()
        summary, error = None, None
        try:
            summary = train(configs[i][1], stdout=False, stop=stop, pool=pool.member(i))
        except Exception as e:  # noqa: BLE001 (kept with its pipeline's name, reported)
            error = e
        results[i] = (summary, error, time.perf_counter() - t)

    threads = []
    try:
        share_pool(configs[0][1], pool)
        for i, name in enumerate(names):
            threads.append(threading.Thread(target=run, args=(i,), name=f"pipeline {name}"))
            threads[-1].start()
            if on_start is not None:
                on_start(name)
        for t in threads:
            t.join()
    finally:
        pool.close()
    shares = pool.shares(time.perf_counter() - start)
    return [
        PipelineResult(name, s, e, w, shares[i], pool.stats[i])
        for i, (name, (s, e, w)) in enumerate(zip(names, results, strict=True))
    ]


def result_rows(results: Sequence[PipelineResult]) -> list[tuple[str, ...]]:
    """The final table: a header, then one row per pipeline."""
    rows = [
        (
            "pipeline",
            "status",
            "acc before",
            "acc after",
            "wall s",
            "pool share",
            "moves",
            "learner s (wait)",
        )
    ]
    pct = lambda s, k: f"{s[k]:.1%}" if s and isinstance(s.get(k), float) else "-"
    for r in results:
        s = r.summary or {}
        if r.error is not None:
            status = f"failed: {type(r.error).__name__}"
        elif s.get("stopped_at") is not None:
            status = (
                f"stopped at round {s['stopped_at']}" if s["stopped_at"] else "stopped in its SFT"
            )
        elif "mode" not in s:
            status = "finished earlier"
        else:
            status = "done"
        notes = [f"{r.stats.recalls} recalled"] if r.stats.recalls else []
        notes += [f"{r.stats.failed_joins} failed to join"] if r.stats.failed_joins else []
        moves = f"+{r.stats.moves_in}/-{r.stats.moves_out}" + (
            f" ({', '.join(notes)})" if notes else ""
        )
        rows.append(
            (
                r.name,
                status,
                pct(s, "heldout_acc_before"),
                pct(s, "heldout_acc_after"),
                f"{r.wall_s:.1f}",
                f"{r.share:.0%}",
                moves,
                f"{r.stats.learner_s:.1f} ({r.stats.learner_wait_s:.1f})",
            )
        )
    return rows
