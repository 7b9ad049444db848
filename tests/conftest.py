"""Test setup: 8 fake CPU devices (set before jax is imported) and strict numpy semantics."""

import os
import tempfile

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
# Many tests build the same tiny programs through fresh closures (a new Learner, a new Engine):
# XLA's persistent cache, keyed by the compiled program, turns those recompiles into lookups.
jax.config.update(
    "jax_compilation_cache_dir",
    os.environ.get(
        "ROLLOUTPIPE_JAX_CACHE", os.path.join(tempfile.gettempdir(), "rolloutpipe-jax-cache")
    ),
)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
