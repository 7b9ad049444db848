"""Weight publishing: learner params -> sampler mesh, with a version number and its time measured.

`WeightSync` is the interface a multi-host transport (jax.experimental.transfer, a Ray object
store) implements; `DevicePutSync` is the single-process one: a cross-mesh `jax.device_put`.
A learner of several processes (learner/distributed.py) has no sampler devices in its job: every
process calls `learner.distributed.gather_to_host(params)` (a collective) and process 0 hands the
numpy arrays to such a transport.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Protocol

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from rl.models.config import DTYPES
from rl.models.sharding import Rules, current_rules, tree_shardings


@dataclasses.dataclass(frozen=True)
class Published:
    params: Any  # on the sampler's devices, in the sampler's dtype
    version: int
    seconds: float  # wall time of the transfer, until the arrays are ready


class WeightSync(Protocol):
    def publish(self, params: Any, version: int) -> Published:
        """Makes `params` available to the sampler as policy `version`."""


class DevicePutSync:
    """Cross-mesh device_put in one process, casting floating params to the sampler's dtype.

    `params_like`: an nnx State (arrays or ShapeDtypeStructs) whose Variables carry logical axes.
    """

    def __init__(
        self,
        params_like: Any,
        sampler_mesh: Mesh,
        *,
        dtype: str = "",
        rules: Rules | None = None,
    ):
        if dtype and dtype not in DTYPES:
            raise ValueError(
                f"DevicePutSync dtype={dtype!r}; expected one of {tuple(DTYPES)} or ''."
            )
        self.dtype = DTYPES[dtype] if dtype else None
        self.shardings = tree_shardings(
            params_like, sampler_mesh, current_rules() if rules is None else rules
        )

    def publish(self, params: Any, version: int) -> Published:
        start = time.perf_counter()
        if self.dtype is not None:
            params = jax.tree.map(
                lambda x: x.astype(self.dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                params,
            )
        # Always a copy: colocated, the sampler must not share buffers the learner will donate.
        out = jax.device_put(params, self.shardings, may_alias=False)
        jax.block_until_ready(out)
        return Published(params=out, version=version, seconds=time.perf_counter() - start)
