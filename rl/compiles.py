"""Counting the programs jitted functions compile, through public API only.

jax traces a jitted function once per new abstract signature (shapes, dtypes, static arguments),
and compiles each trace once, so counting traces counts compiled programs; jax's own per-function
cache counter is private. Benchmarks and tests use the counts to see that a steady state compiles
nothing new.

    compiles = CompileCounter()
    step = compiles.jit("step", fn, donate_argnums=(0,))
    ...
    compiles.counts()  # {"step": 1}
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable
from typing import Any

import jax


class CompileCounter:
    """jax.jit that counts each function's traces (= compiled programs) under a name."""

    def __init__(self) -> None:
        self._counts: collections.Counter[str] = collections.Counter()

    def jit(self, name: str, fn: Callable[..., Any], **jit_kwargs: Any) -> Any:
        """jax.jit(fn, **jit_kwargs), its traces counted under `name` (starting at 0)."""
        self._counts[name] += 0

        @functools.wraps(fn)
        def traced(*args: Any, **kwargs: Any) -> Any:
            self._counts[name] += 1  # runs only while jax traces: once per new signature
            return fn(*args, **kwargs)

        return jax.jit(traced, **jit_kwargs)

    def counts(self) -> dict[str, int]:
        """Programs compiled so far, by name."""
        return dict(self._counts)
