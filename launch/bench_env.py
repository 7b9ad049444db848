"""What the CPU benchmark programs share: two host devices, XLA's persistent compile cache, and
the tiny-model workload's config (`tiny_config`), which the composition root builds.

Import it before jax: it asks XLA for 2 host devices (a learner and a sampler device) unless
XLA_FLAGS already sets a count, and defaults JAX_PLATFORMS to cpu.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
    ).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from configs import base  # noqa: E402  (after the device count: it imports jax)

DEFAULT_CACHE = os.environ.get(
    "ROLLOUTPIPE_JAX_CACHE", os.path.join(tempfile.gettempdir(), "rolloutpipe-jax-cache")
)
CACHE_HELP = "XLA persistent compilation cache directory; empty: off."


def use_compilation_cache(path: str) -> None:
    """Turns on XLA's persistent compilation cache in `path` (nothing if empty)."""
    if not path:
        return
    import jax

    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def tiny_config(
    *,
    seed: int,
    lr: float,
    micro_batch_rows: int,
    slots: int,
    max_length: int,
    max_prefill: int,
    steps_per_call: int,
) -> Any:
    """launch.bench_pipeline's and launch.profile's model and devices as a config for
    rl.runtime.compose: the "tiny" preset (init_std 0.3, float32), the learner on CPU device 0 and
    the sampler on device 1, an AdamW at constant `lr`, an engine of `slots` slots."""
    config = base.get_config("smoke")
    config.seed = seed
    config.model.init_std = 0.3  # a peaked policy: responses of a few tokens differ by prompt
    config.mesh.colocated = False  # disjoint meshes: learner on device 0, sampler on device 1
    config.learner.optimizer.lr = lr
    config.learner.micro_batch_rows = micro_batch_rows
    config.engine.max_slots = slots
    config.engine.max_length = max_length
    config.engine.max_prefill_length = max_prefill
    config.engine.steps_per_call = steps_per_call
    return config
