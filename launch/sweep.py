"""Entry point: python -m launch.sweep --config=configs/X.py[:arg] --sweep.values='key=v1,v2[;key2=...]'
[--config.field=value ...].

Runs one pipeline per value (several keys: their product) at once, on one pool of devices: every
pipeline is the config with its values set, writing to `<config.workdir>/<key>=<value>`, and
sampler replicas move between the pipelines as they run (rl/sweep.py, rl/runtime/pool.py; each
pipeline trains bitwise what it would train alone). The pool is `config.mesh.sampler_replicas`
replicas, at least one per pipeline. For example, two seeds of the CPU default on three fake CPU
devices:

    XLA_FLAGS=--xla_force_host_platform_device_count=3 python -m launch.sweep \
        --config=configs/default.py --sweep.values='seed=0,1' \
        --config.mesh.sampler_replicas=3 --config.workdir=runs/sweep

With --config.runtime=ray each replica mesh is an actor holding a replica of every pipeline
(rl/runtime/ray_host.py) and each pipeline has its own learner worker.

Prints a line per pipeline round as it is logged, then a table (held-out accuracy before and after
RL, wall time, share of the pool's replica time, replicas received/given, seconds on the learner's
devices and waiting for them). A pipeline that fails stops alone: its error is printed with its
name and the sweep exits 1 once the others finish.
Library logging goes to `<config.workdir>/sweep.log`. SIGTERM stops every pipeline at its next safe
point; rerunning the same command resumes each from its checkpoint (config.resume).
"""

from __future__ import annotations

import functools
import json
import os
import sys
import threading
import traceback

from absl import app, flags
from ml_collections import config_flags

import configs
from launch.cli import one_line, parse_flags, stop_on_sigterm
from rl.config_check import ConfigError
from rl.logs import log_to_file, quiet_console, to_file_only
from rl.sweep import expand, result_rows, run_sweep

_CONFIG = config_flags.DEFINE_config_file(
    "config",
    os.path.join(os.path.dirname(configs.__file__), "default.py"),
    "The pipelines' base config.",
    lock_config=True,
)
_VALUES = flags.DEFINE_string(
    "sweep.values", "", "key=v1,v2,... per swept field; several fields separated by ';'."
)
PROGRESS_S = 2.0  # how often new metrics rows are printed


class Progress:
    """Prints each pipeline's train rows of metrics.jsonl as they are logged, prefixed with its
    name (a resumed pipeline's earlier rounds once, at the start)."""

    def __init__(self, pipelines: list[tuple[str, object]]):
        self.files = {name: os.path.join(c.workdir, "metrics.jsonl") for name, c in pipelines}
        self.rounds = {name: c.rounds for name, c in pipelines}
        self.shown = dict.fromkeys(self.files, -1)  # the last round printed
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, name="sweep-progress", daemon=True)

    def _run(self) -> None:
        while not self.done.wait(PROGRESS_S):
            self.poll()
        self.poll()

    def poll(self) -> None:
        for name, path in self.files.items():
            try:
                with open(path, encoding="utf-8") as f:
                    lines = f.read().splitlines(keepends=True)
            except OSError:
                continue
            for line in lines:
                if not line.endswith("\n"):  # being written
                    break
                row = json.loads(line)
                if row.get("prefix") != "train" or row["step"] <= self.shown[name]:
                    continue
                self.shown[name] = row["step"]
                held = row.get("heldout_acc")
                print(
                    f"[{name}] round {row['step'] + 1}/{self.rounds[name]}: reward "
                    f"{row.get('reward_mean', float('nan')):.3f}"
                    + (f", held-out {held:.1%}" if isinstance(held, float) else ""),
                    flush=True,
                )


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    quiet_console()
    try:
        config = _CONFIG.value
        config.get("workdir")  # a config file that failed to load raises on first use
        pipelines = expand(config, _VALUES.value)
    except Exception as e:  # a missing config file, bad --sweep.values
        sys.exit(f"launch.sweep: {one_line(str(e)) or type(e).__name__}")
    log = log_to_file(os.path.join(config.workdir, "sweep.log"))
    progress = Progress(pipelines)
    progress.thread.start()
    try:
        results = run_sweep(pipelines, stop=stop_on_sigterm("launch.sweep"))
    except (ConfigError, ValueError) as e:
        sys.exit(f"launch.sweep: {one_line(str(e))}")
    finally:
        progress.done.set()
        progress.thread.join()
    rows = result_rows(results)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    print("\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows))
    failed = [r for r in results if r.error is not None]
    for r in failed:
        to_file_only(f"pipeline {r.name} stopped:\n" + "".join(traceback.format_exception(r.error)))
        print(
            f"launch.sweep: pipeline {r.name} failed: {type(r.error).__name__}: "
            f"{one_line(str(r.error))} [traceback in {log}]",
            file=sys.stderr,
        )
    print(f"wrote {', '.join(c.workdir for _, c in pipelines)}; library log: {log}")
    if failed:
        sys.exit(1)


def cli() -> None:
    app.run(main, flags_parser=functools.partial(parse_flags, "launch.sweep"))


if __name__ == "__main__":
    cli()
