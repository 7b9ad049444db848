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
# Many tests build the same tiny programs through fresh closures (a new Learner, a new Engine):
# XLA's persistent cache, keyed by the compiled program, turns those recompiles into lookups. It is
# bounded (least recently used entries go first; the LRU cache keeps an access time per entry,
# hence a directory of its own) and reported at the end of the session. Set in the environment
# before jax is imported, so this process and every process a test starts (launch.train runs, the
# benchmarks, Ray workers, the kill tests) share it.
CACHE_DIR = os.environ.setdefault(
    "ROLLOUTPIPE_JAX_CACHE", os.path.join(tempfile.gettempdir(), "rolloutpipe-xla-cache")
)
CACHE_MAX_BYTES = 512 * 2**20
os.environ.update(
    JAX_COMPILATION_CACHE_DIR=CACHE_DIR,
    JAX_COMPILATION_CACHE_MAX_SIZE=str(CACHE_MAX_BYTES),
    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0.2",
    JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
)

import jax  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")


def _cache_usage() -> tuple[int, int]:
    """(entries, bytes) in the persistent compilation cache."""
    if not os.path.isdir(CACHE_DIR):
        return 0, 0
    files = [e for e in os.scandir(CACHE_DIR) if e.is_file()]
    return len(files), sum(e.stat().st_size for e in files)


_CACHE_AT_START = _cache_usage()


def pytest_terminal_summary(terminalreporter):
    entries, size = _cache_usage()
    terminalreporter.write_line(
        f"compilation cache {CACHE_DIR}: {entries} files, {size / 2**20:.1f} MiB "
        f"(at the start {_CACHE_AT_START[0]} files, {_CACHE_AT_START[1] / 2**20:.1f} MiB; "
        f"bound {CACHE_MAX_BYTES / 2**20:.0f} MiB; ROLLOUTPIPE_JAX_CACHE sets the directory)"
    )


def pytest_collection_modifyitems(items):
    """Under pytest-xdist (pytest.ini: -n 2 --dist loadgroup) every test of the Ray cluster runs
    on one worker, so the session starts one cluster, not one per worker."""
    for item in items:
        if "ray_cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("ray"))


# One local Ray cluster (2 CPUs) for the whole pytest session: its startup is paid once.
@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    # The workers' JAX matches this process's (tests/conftest.py): CPU, 8 fake devices, strict
    # rank promotion, the same compilation cache (all set in the environment above);
    # rl.runtime.ray_cluster.worker_env passes JAX_* and XLA_* variables on to them.
    os.environ["JAX_PLATFORMS"] = "cpu"
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        logging_level=logging.WARNING,
        namespace="rolloutpipe-tests",
    )
    yield ray
    ray.shutdown()
