"""What the benchmark programs share around their timed parts: XLA compiles counted by label, the
process's memory maps, releasing what a mode built, the spread over repeats, and the loud failure
when a timed part compiled.

    watch = CompileWatch()                   # counts every XLA compile in this process
    with watch:
        warm_up()                            # booked to "untimed"
        for _ in range(repeats):
            with watch.timed():              # booked to "timed": must stay 0
                seconds.append(run())
    print(spread_text(spread(seconds)))      # "1.203 / 1.250 / 1.410" (min / median / max)
    fail_if_compiled("launch.bench_x", watch.compiles_timed, watch.timed_names())

jax traces and compiles a program the first time it meets a new shape; a compile inside a timed
part times the compiler, not the program. Every XLA compile passes jax's backend-compile event
(jax._src.dispatch.BACKEND_COMPILE_EVENT; a persistent-cache load too), whichever thread runs it, so
`CompileWatch` sees the library's counted programs (rl/compiles.py) and any other jitted or eager
op alike. Each compiled program also maps its code into the process: a benchmark that keeps every
mode's objects alive grows past vm.max_map_count (65530) and LLVM aborts ("Unable to allocate
section memory"); `release` after each mode keeps `memory_maps()` bounded.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import statistics
import threading
from collections.abc import Iterable, Iterator
from typing import Any

import jax

# Recorded around every XLA compile (and persistent-cache load): jax._src.dispatch.
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
TIMED = "timed"
UNTIMED = "untimed"


class CompileWatch:
    """XLA programs compiled in this process, by label: each compile is booked to the label
    current when it happens (`booked`, `timed`), in any thread. Use as a context manager: it
    listens to jax's compile events between enter and exit."""

    def __init__(self) -> None:
        self.label = UNTIMED
        self._lock = threading.Lock()
        self.counts: collections.Counter[str] = collections.Counter()
        self.seconds: collections.Counter[str] = collections.Counter()
        self.names: dict[str, collections.Counter[str]] = collections.defaultdict(
            collections.Counter
        )

    def __call__(self, event: str, duration: float, **kwargs: Any) -> None:
        if event != BACKEND_COMPILE_EVENT:
            return
        with self._lock:
            self.counts[self.label] += 1
            self.seconds[self.label] += duration
            self.names[self.label][str(kwargs.get("fun_name", "?"))] += 1

    def __enter__(self) -> CompileWatch:
        jax.monitoring.register_event_duration_secs_listener(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        jax.monitoring.unregister_event_duration_listener(self)

    @contextlib.contextmanager
    def booked(self, label: str) -> Iterator[None]:
        """Compiles inside the block go to `label` (the previous label after it)."""
        previous, self.label = self.label, label
        try:
            yield
        finally:
            self.label = previous

    def timed(self) -> contextlib.AbstractContextManager[None]:
        """A timed region: every compile in it counts against the benchmark."""
        return self.booked(TIMED)

    @property
    def compiles_timed(self) -> int:
        """Programs compiled inside timed regions (a trustworthy benchmark: 0)."""
        with self._lock:
            return self.counts[TIMED]

    def timed_names(self) -> dict[str, int]:
        """The programs compiled inside timed regions, by jitted function name."""
        with self._lock:
            return dict(self.names[TIMED])

    def report(self) -> dict[str, Any]:
        """The JSON block: compiles and their seconds by label, the timed ones by name."""
        with self._lock:
            return {
                "compiles": dict(self.counts),
                "compile_s": {k: float(v) for k, v in self.seconds.items()},
                "compiles_timed": self.counts[TIMED],
                "compiled_while_timed": dict(self.names[TIMED]),
            }


def memory_maps() -> int:
    """Lines of /proc/self/maps: the memory maps this process holds (0 where there is none)."""
    try:
        with open("/proc/self/maps", encoding="ascii", errors="replace") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


def release() -> int:
    """Frees what the dropped objects held (their compiled programs' code among it): a garbage
    collection and jax.clear_caches(). Drop every reference (close drivers and runtimes first).
    Returns memory_maps() after."""
    gc.collect()
    jax.clear_caches()
    gc.collect()
    return memory_maps()


def spread(values: Iterable[float]) -> dict[str, float]:
    """min / median / max (and n) of repeated measurements."""
    xs = [float(x) for x in values]
    if not xs:
        return {"min": float("nan"), "median": float("nan"), "max": float("nan"), "n": 0}
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs), "n": len(xs)}


def spread_text(s: dict[str, float], fmt: str = ".3f") -> str:
    """A spread as "min / median / max"."""
    return " / ".join(format(s[k], fmt) for k in ("min", "median", "max"))


def fail_if_compiled(program: str, compiles_timed: int, names: dict[str, int] | None = None):
    """Exits non-zero (SystemExit with a message naming `program` and the count) if anything
    compiled inside a timed region; call it after the table and the JSON are written."""
    if compiles_timed:
        which = f": {dict(sorted(names.items()))}" if names else ""
        raise SystemExit(
            f"{program}: {compiles_timed} XLA programs compiled inside timed regions{which}; "
            "expected 0 (the warm-up must compile every shape the timed part runs, or the figures "
            "time the compiler)."
        )


def counts_diff(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    """Programs compiled between two compile_counts() snapshots (rl/compiles.py), nonzero ones."""
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


def range_text(s: dict[str, float], fmt: str = ".2f") -> str:
    """A spread as "min-max"."""
    return f"{s['min']:{fmt}}-{s['max']:{fmt}}"
