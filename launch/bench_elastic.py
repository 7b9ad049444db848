"""Elastic devices on fake CPU devices, one process: borrowing on vs off (the static split).

    python -m launch.bench_elastic [--rounds 3 --groups 8 --json /tmp/bench_elastic.json]

Borrowing section: the tiny-model workload (configs/base.py:smoke shapes, the addition task) in
`sync` mode on 4 host devices, a learner of 2 and a sampler of 2, through the composition root, with
config.elastic.borrowing "off" (the static split) and "learner" (the learner's data-parallel mesh
extends over the sampler's 2 devices once the rollout has drained, and returns before the publish).
The switch-cost prior and the margin are 0, so the learner borrows every round: the figure is what a
move costs or saves here, not the policy's judgement (which the simulator exercises at GPU scale:
launch.simulate --borrowing). Per setting: one warm-up round (compiles; not timed), then --rounds
timed rounds; rollout-to-train-end, learner compute, the measured switch (there and back) and the
ratio to the static split. Both settings sample the same tokens (checked). On 2 shared cores the
4 fake devices share the cores, so these are correctness-grade figures, not a speed claim.
"""

from __future__ import annotations

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    ).strip()

from launch import bench_env  # noqa: E402  (before jax: CPU platform; the count is set above)

# isort: split

import hashlib  # noqa: E402
import json  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

from configs import base  # noqa: E402
from rl.runtime.compose import build_driver  # noqa: E402

KEYS = ("rollout_to_train_end_s", "trainer_compute_s", "rollout_s", "borrow_learner_measured_s")

_ROUNDS = flags.DEFINE_integer("rounds", 3, "Timed rounds per setting (after 1 warm-up).")
_GROUPS = flags.DEFINE_integer("groups", 8, "R: groups per round.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 32, "Response length cap.")
_JSON = flags.DEFINE_string("json", "", "Write the figures here as JSON.")
_CACHE = flags.DEFINE_string("compilation_cache", bench_env.DEFAULT_CACHE, bench_env.CACHE_HELP)


def borrowing_config(borrowing: str, *, groups: int, max_new_tokens: int) -> Any:
    """The benchmark's run config: learner 2 + sampler 2 devices, sync, borrowing as given."""
    config = base.get_config("smoke")
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


def borrowing_section(rounds: int, groups: int, max_new_tokens: int) -> dict[str, Any]:
    """Rollout-to-train-end with borrowing off and on (see the module docstring)."""
    out: dict[str, Any] = {}
    for setting in ("off", "learner"):
        config = borrowing_config(setting, groups=groups, max_new_tokens=max_new_tokens)
        runtime, driver = build_driver(config, rounds=rounds + 1)
        try:
            results = [driver.run_round(r) for r in range(rounds + 1)]
        finally:
            driver.close()
            runtime.close()
        timed = [r.metrics for r in results[1:]]
        row = {k: float(np.mean([m.get(k, np.nan) for m in timed])) for k in KEYS}
        row["borrowed_rounds"] = float(sum(m.get("borrow_learner", 0.0) for m in timed))
        digest = hashlib.sha256(
            repr([[c.tokens for g in r.groups for c in g.completions] for r in results]).encode()
        ).hexdigest()[:12]
        row["tokens_digest"] = digest
        out[setting] = row
    if out["off"]["tokens_digest"] != out["learner"]["tokens_digest"]:
        raise RuntimeError("Borrowing changed the sampled tokens; expected the same tokens.")
    base_r2t = out["off"]["rollout_to_train_end_s"]
    for row in out.values():
        row["r2t_vs_static"] = row["rollout_to_train_end_s"] / base_r2t
    return out


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    bench_env.use_compilation_cache(_CACHE.value)
    rows = borrowing_section(_ROUNDS.value, _GROUPS.value, _MAX_NEW.value)
    print(
        f"borrowing (sync, R={_GROUPS.value}, learner 2 + sampler 2 fake CPU devices, "
        f"{_ROUNDS.value} timed rounds; correctness-grade on shared cores)"
    )
    print(
        f"  {'setting':<10}{'r2t s':>8}{'vs static':>10}{'train s':>9}{'switch s':>9}{'moves':>7}"
    )
    for name, r in rows.items():
        print(
            f"  {name:<10}{r['rollout_to_train_end_s']:>8.3f}{r['r2t_vs_static']:>9.2f}x"
            f"{r['trainer_compute_s']:>9.3f}{r['borrow_learner_measured_s']:>9.3f}"
            f"{r['borrowed_rounds']:>7.0f}"
        )
    print(f"  same tokens in both settings: {rows['off']['tokens_digest']}")
    if _JSON.value:
        with open(_JSON.value, "w", encoding="utf-8") as f:
            json.dump(dict(borrowing=rows), f, indent=2)
        print(f"wrote {_JSON.value}")


if __name__ == "__main__":
    app.run(main)
