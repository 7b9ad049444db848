"""Test setup: 8 fake CPU devices (set before jax is imported) and strict numpy semantics.

Both are set in the environment too, so the processes the tests start (`launch.train` runs, Ray
workers, the kill and multi-host tests) run under the same rules as this one.
"""

import logging
import os
import tempfile

import pytest

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["JAX_NUMPY_RANK_PROMOTION"] = "raise"  # (CONVENTIONS §9)

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


# One local Ray cluster (2 CPUs) for the whole pytest session: its startup is paid once.
@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    # The workers' JAX matches this process's (tests/conftest.py): CPU, 8 fake devices, strict
    # rank promotion (set above), the same compilation cache. rl.runtime.ray_cluster.worker_env
    # passes JAX_* and XLA_* variables on to them.
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ.setdefault(
        "JAX_COMPILATION_CACHE_DIR",
        os.environ.get(
            "ROLLOUTPIPE_JAX_CACHE", os.path.join(tempfile.gettempdir(), "rolloutpipe-jax-cache")
        ),
    )
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0.2"
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        logging_level=logging.WARNING,
        namespace="rolloutpipe-tests",
    )
    yield ray
    ray.shutdown()
