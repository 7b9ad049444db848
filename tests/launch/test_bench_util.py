"""launch.bench_util: compiles are booked to the timed region they happen in, a benchmark whose
timed part compiled exits non-zero naming itself and the count, spreads, and memory maps."""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from launch import bench_util


def test_compiles_are_booked_to_the_timed_region_they_happen_in_whatever_the_thread():
    f = jax.jit(lambda x: x * 3 + 1)
    with bench_util.CompileWatch() as watch:
        f(np.ones(3))  # untimed: compiles (numpy inputs: no eager op compiles)
        with watch.timed():
            f(np.ones(3))  # compiled already
        assert watch.compiles_timed == 0
        with watch.timed():
            thread = threading.Thread(target=lambda: f(np.ones(5)))  # a new shape, elsewhere
            thread.start()
            thread.join()
        f(np.ones(7))  # after the region: untimed again
    f(np.ones(9))  # the watch no longer listens
    assert watch.compiles_timed == 1
    assert watch.counts[bench_util.UNTIMED] == 2
    assert sum(watch.timed_names().values()) == 1
    report = watch.report()
    assert report["compiles_timed"] == 1 and report["compiles"][bench_util.UNTIMED] == 2


def test_a_timed_compile_fails_the_program_with_its_name_and_the_count():
    bench_util.fail_if_compiled("launch.bench_x", 0)  # nothing compiled: returns
    with pytest.raises(SystemExit) as e:
        bench_util.fail_if_compiled("launch.bench_x", 2, {"jit(step)": 2})
    message = str(e.value.code)
    assert message.startswith("launch.bench_x: 2 XLA programs compiled inside timed regions")
    assert "jit(step)" in message


def test_spread_and_its_texts():
    s = bench_util.spread([3.0, 1.0, 2.0, 10.0])
    assert s == {"min": 1.0, "median": 2.5, "max": 10.0, "n": 4}
    assert bench_util.spread_text(s, ".1f") == "1.0 / 2.5 / 10.0"
    assert bench_util.range_text(s) == "1.00-10.00"
    assert bench_util.spread([])["n"] == 0


def test_release_frees_the_memory_maps_of_dropped_programs():
    before = bench_util.memory_maps()
    assert before > 0  # Linux: /proc/self/maps
    fns = [jax.jit(lambda x, k=k: jnp.sin(x) * k) for k in range(20)]
    for f in fns:
        f(jnp.ones(4)).block_until_ready()
    held = bench_util.memory_maps()
    del fns, f
    assert bench_util.release() < held
