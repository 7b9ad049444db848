"""A compile budget: jitted programs compiled ahead at start, counted, timed, and warned about after.

jax traces a jitted function once per new abstract signature (shapes, dtypes, static arguments),
and compiles each trace once, so counting traces counts compiled programs; jax's own per-function
cache counter is private. A run draws every program's shapes from a small set fixed by its config
and compiles them before its first round (`precompile`: `jit.lower(...).compile()` on abstract
arguments, the executable kept and called for arguments of that signature); `start()` then marks
the end of start-up, and any later compile is counted under `after_start` and warned about once per
program, naming the program and the shapes that were new.

    compiles = CompileCounter()
    step = compiles.jit("step", fn, donate_argnums=(0,))
    step.precompile(jax.ShapeDtypeStruct((8, 64), jnp.float32, sharding=s))  # ahead, at start
    compiles.start()
    step(x)                 # the precompiled executable: nothing compiles
    compiles.counts()       # {"step": 1}
    compiles.seconds()      # {"step": 0.41}: time spent tracing and compiling it
"""

from __future__ import annotations

import collections
import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import jax

log = logging.getLogger(__name__)


def signature(
    args: tuple[Any, ...], kwargs: dict[str, Any], static: tuple[Any, ...] = ()
) -> tuple[Any, ...]:
    """What selects a compiled program: the arguments' tree structure, each leaf's shape/dtype, and
    the values of the static arguments.

    Leaves without a shape (Python scalars) count by type, as jax traces them (weakly typed).
    """
    leaves, tree = jax.tree.flatten((args, kwargs))
    return (
        tree,
        tuple(
            (tuple(x.shape), str(x.dtype)) if hasattr(x, "shape") else type(x).__name__
            for x in leaves
        ),
        static,
    )


def describe(sig: tuple[Any, ...]) -> str:
    """A signature's shapes, short: "(+40 leaves) f32[8,64] i32[8] static (3,)": the last 8 leaves
    (the data; parameters and states come first) and the static arguments' values."""
    parts = []
    for leaf in sig[1][-8:]:
        if isinstance(leaf, str):
            parts.append(leaf)
        else:
            shape, dtype = leaf
            parts.append(f"{dtype}[{','.join(map(str, shape))}]")
    more = len(sig[1]) - 8
    text = (f"(+{more} leaves) " if more > 0 else "") + " ".join(parts)
    return text + (f" static {sig[2]}" if sig[2] else "")


class Program:
    """One jitted function: its precompiled executables by signature, and a counted jit fallback."""

    def __init__(self, counter: CompileCounter, name: str, fn: Callable[..., Any], **jit_kwargs):
        self.name, self._counter = name, counter

        @functools.wraps(fn)
        def traced(*args: Any, **kwargs: Any) -> Any:
            counter._traced(name)  # runs only while jax traces: once per new signature
            return fn(*args, **kwargs)

        self._fn = fn
        self._jit = jax.jit(traced, **jit_kwargs)
        static = jit_kwargs.get("static_argnums", ())
        self._static = (static,) if isinstance(static, int) else tuple(static)
        self._compiled: dict[tuple[Any, ...], Any] = {}

    def _split(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, tuple[Any, ...]]:
        """The call's signature, and its dynamic arguments (what a compiled executable takes)."""
        dynamic = tuple(a for i, a in enumerate(args) if i not in self._static)
        static = tuple(args[i] for i in self._static if i < len(args))
        return signature(dynamic, kwargs, static), dynamic

    def precompile(self, *args: Any, **kwargs: Any) -> None:
        """Compiles the program for these (abstract or concrete) arguments now and keeps it.

        Arguments are jax.ShapeDtypeStruct (with the sharding the real arrays will have) or
        arrays; a later call whose arguments have the same signature runs this executable.
        """
        sig, _ = self._split(args, kwargs)
        if sig in self._compiled:
            return
        start = time.perf_counter()
        self._compiled[sig] = self._jit.lower(*args, **kwargs).compile()
        self._counter._timed(self.name, time.perf_counter() - start, sig)

    def eval_shape(self, *args: Any, **kwargs: Any) -> Any:
        """The outputs' shapes and dtypes (jax.eval_shape of the function; compiles nothing)."""
        positions = [i for i in range(len(args)) if i not in self._static]

        def dynamic_only(*dynamic: Any, **kw: Any) -> Any:
            full = list(args)
            for i, x in zip(positions, dynamic, strict=True):
                full[i] = x
            return self._fn(*full, **kw)

        return jax.eval_shape(dynamic_only, *(args[i] for i in positions), **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._compiled:
            sig, dynamic = self._split(args, kwargs)
            compiled = self._compiled.get(sig)
            if compiled is not None:
                return compiled(*dynamic, **kwargs)
        before = self._counter.counts()[self.name]
        start = time.perf_counter()
        out = self._jit(*args, **kwargs)
        if self._counter.counts()[self.name] != before:  # this call traced and compiled
            self._counter._timed(
                self.name, time.perf_counter() - start, self._split(args, kwargs)[0]
            )
        return out


class CompileCounter:
    """jax.jit that counts, times and budgets each function's compiled programs under a name."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: collections.Counter[str] = collections.Counter()
        self._seconds: collections.Counter[str] = collections.Counter()
        self._after_start: collections.Counter[str] = collections.Counter()
        self._started = False
        self._warned: set[str] = set()

    def jit(self, name: str, fn: Callable[..., Any], **jit_kwargs: Any) -> Program:
        """jax.jit(fn, **jit_kwargs) as a Program, its compiles counted under `name` (from 0)."""
        with self._lock:
            self._counts[name] += 0
        return Program(self, name, fn, **jit_kwargs)

    def start(self) -> None:
        """Start-up is over: every later compile is counted in `after_start` and warned about."""
        self._started = True

    def _traced(self, name: str) -> None:
        with self._lock:
            self._counts[name] += 1
            if self._started:
                self._after_start[name] += 1

    def _timed(self, name: str, seconds: float, sig: tuple[Any, ...]) -> None:
        with self._lock:
            self._seconds[name] += seconds
            warn = self._started and name not in self._warned
            if warn:
                self._warned.add(name)
        if warn:
            log.warning(
                "%s compiled after start (%.2f s) for new shapes %s; a run's programs should all "
                "be compiled at start (rl/compiles.py). Further compiles of it are counted, not "
                "warned about.",
                name,
                seconds,
                describe(sig),
            )

    def counts(self) -> dict[str, int]:
        """Programs compiled so far, by name."""
        with self._lock:
            return dict(self._counts)

    def seconds(self) -> dict[str, float]:
        """Seconds spent tracing and compiling, by name (precompiles and calls that compiled)."""
        with self._lock:
            return {name: float(self._seconds[name]) for name in self._counts}

    def stats(self, owner: str) -> dict[str, dict[str, float]]:
        """{"<owner>.<program>": {"programs", "seconds", "after_start"}} for every program."""
        seconds, late = self.seconds(), self.after_start()
        return {
            f"{owner}.{name}": {
                "programs": float(n),
                "seconds": seconds[name],
                "after_start": float(late[name]),
            }
            for name, n in self.counts().items()
        }

    def after_start(self) -> dict[str, int]:
        """Programs compiled after `start()`, by name (a run's budget: all zero)."""
        with self._lock:
            return {name: self._after_start[name] for name in self._counts}


def compile_stats(counters: dict[str, CompileCounter]) -> dict[str, dict[str, float]]:
    """CompileCounter.stats of several counters, by owner, in one dict."""
    return {k: v for owner, counter in counters.items() for k, v in counter.stats(owner).items()}


def round_compiles(now: dict[str, dict[str, float]], before: dict[str, dict[str, float]]):
    """Per-round metrics from two compile_stats snapshots: programs compiled and their seconds
    in between, programs compiled after start so far."""
    total = lambda stats, key: sum(v[key] for v in stats.values())
    return {
        "compiles": total(now, "programs") - total(before, "programs"),
        "compile_s": total(now, "seconds") - total(before, "seconds"),
        "compiles_after_start": total(now, "after_start"),
    }
