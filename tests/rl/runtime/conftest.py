"""One local Ray cluster (2 CPUs) for the whole pytest session: its startup is paid once."""

import logging
import os
import tempfile

import pytest


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    # The workers' JAX matches this process's (tests/conftest.py): CPU, 8 fake devices, strict
    # rank promotion, the same compilation cache. rl.runtime.ray_runtime.worker_env passes JAX_*
    # and XLA_* variables on to them.
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ.setdefault(
        "JAX_COMPILATION_CACHE_DIR",
        os.environ.get(
            "ROLLOUTPIPE_JAX_CACHE", os.path.join(tempfile.gettempdir(), "rolloutpipe-jax-cache")
        ),
    )
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0.2"
    os.environ["JAX_NUMPY_RANK_PROMOTION"] = "raise"
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        logging_level=logging.WARNING,
        namespace="rolloutpipe-tests",
    )
    yield ray
    ray.shutdown()
