"""What the CPU benchmark programs share: two host devices and XLA's persistent compile cache.

Import it before jax: it asks XLA for 2 host devices (a learner and a sampler device) unless
XLA_FLAGS already sets a count, and defaults JAX_PLATFORMS to cpu.
"""

from __future__ import annotations

import os
import tempfile

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
    ).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

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
