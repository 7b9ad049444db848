"""Weight publishing: learner params -> sampler mesh, with a version number and its time measured.

`WeightSync` is the interface a multi-host transport (jax.experimental.transfer, a Ray object
store) implements; `DevicePutSync` is the single-process one: a cross-mesh `jax.device_put`, or,
colocated (every parameter already on the sampler's sharding in the sampler's dtype) and given the
learner (`share_with`), no copy at all: the sampler reads the learner's arrays, and the learner's
next update writes new buffers instead of donating them (`Learner.share_params`). Otherwise the
published arrays share no buffer with the learner's, which its next update donates: where the two
meshes share a device, `jax.device_put` may keep the learner's buffer as that device's shard even
with may_alias=False (a one-device array replicated onto a mesh that holds its device: colocated
sampler replicas), so the parameters are copied on the learner's devices first.
A leaf that is the same array object as in the previous publish (a LoRA run's base: only its
adapters change, rl/models/lora.py) is not moved again: the sampler keeps its copy, and a publish
moves only the leaves that changed (`Published.bytes`).
Several threads place one publish on their own devices at once (the replicas of a ReplicaSampler,
a replica joining mid-round, rl/runtime/pool.py), and jaxlib lists an array's per-device buffers
lazily without a lock: two threads listing them first get one array of twice its shards
(`safe_zip` fails in the resharding). A publish lists them before it hands the arrays over.
A learner of several processes (learner/distributed.py) has no sampler devices in its job: every
process calls `learner.distributed.gather_to_host(params)` (a collective) and process 0 hands the
numpy arrays to such a transport.
"""

from __future__ import annotations

import dataclasses
import functools
import time
import weakref
from typing import Any, Protocol

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from rl.models.config import DTYPES
from rl.models.sharding import Rules, current_rules, tree_shardings

EVALUATION = -1  # the version of a publish made for a held-out evaluation, not the sampler


@dataclasses.dataclass(frozen=True)
class Published:
    params: Any  # on the sampler's devices, in the sampler's dtype
    version: int
    seconds: float  # wall time of the transfer, until the arrays are ready
    bytes: int = 0  # what moved (leaves unchanged since the last publish stay where they are)


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
        share_with: Any = None,
    ):
        if dtype and dtype not in DTYPES:
            raise ValueError(
                f"DevicePutSync dtype={dtype!r}; expected one of {tuple(DTYPES)} or ''."
            )
        self.dtype = DTYPES[dtype] if dtype else None
        self.shardings = tree_shardings(
            params_like, sampler_mesh, current_rules() if rules is None else rules
        )
        self.share_with = share_with  # a Learner (share_params); None: always copy
        self.shared = 0  # publishes that shared the learner's arrays instead of copying
        self._devices = set(sampler_mesh.devices.flat)
        self._copy = jax.jit(functools.partial(_copy, dtype=self.dtype))
        # the last publish's leaves: (a weak reference to the learner's array, the sampler's copy)
        self._sent: list[tuple[Any, Any]] = []

    @property
    def shares_params(self) -> bool:
        """Publishing the learner's current parameters hands them over without a copy."""
        return self.share_with is not None and self._colocated(self.share_with.params)

    def _overlaps(self, params: Any) -> bool:
        """Some parameter lives on a sampler device (device_put could keep its buffer)."""
        return any(
            isinstance(x, jax.Array) and not x.sharding.device_set.isdisjoint(self._devices)
            for x in jax.tree.leaves(params)
        )

    def _colocated(self, params: Any) -> bool:
        """Every leaf already has the sampler's sharding and dtype: a copy would change nothing."""
        leaves, targets = jax.tree.leaves(params), jax.tree.leaves(self.shardings)
        if len(leaves) != len(targets):
            return False
        for x, target in zip(leaves, targets, strict=True):
            if not isinstance(x, jax.Array) or not x.sharding.is_equivalent_to(target, x.ndim):
                return False
            if self.dtype is not None and jnp.issubdtype(x.dtype, jnp.floating):
                if x.dtype != self.dtype:
                    return False
        return True

    def publish(self, params: Any, version: int) -> Published:
        start = time.perf_counter()
        learner = self.share_with
        if learner is not None and _same(params, learner.params) and self._colocated(params):
            out = _settled(learner.share_params())
            self.shared += 1
            self._sent = []  # keeps no earlier copy alive
            return Published(params=out, version=version, seconds=time.perf_counter() - start)
        leaves, treedef = jax.tree.flatten(params)
        targets = jax.tree.leaves(self.shardings)
        out = [None] * len(leaves)
        if len(self._sent) == len(leaves):  # unchanged leaves keep the sampler's copy
            for i, (x, (ref, sent)) in enumerate(zip(leaves, self._sent, strict=True)):
                if ref() is x:
                    out[i] = sent
        moved = [i for i, y in enumerate(out) if y is None]
        new = [leaves[i] for i in moved]
        if self._overlaps(new):  # new buffers where the learner's are (module docstring)
            new = self._copy(new)
        elif self.dtype is not None:
            new = [_cast(x, dtype=self.dtype) for x in new]
        # A copy: without `share_with` the learner's next update may donate its buffers.
        new = jax.device_put(new, [targets[i] for i in moved], may_alias=False)
        jax.block_until_ready(new)
        for i, y in zip(moved, new, strict=True):
            out[i] = y
        self._sent = [(weakref.ref(x), y) for x, y in zip(leaves, out, strict=True)]
        return Published(
            params=_settled(jax.tree.unflatten(treedef, out)),
            version=version,
            seconds=time.perf_counter() - start,
            bytes=sum(y.nbytes for y in new),
        )


def _same(a: Any, b: Any) -> bool:
    """The same arrays (objects, not values) in the same tree: `a` is the learner's current
    parameters (a LoRA learner's `params` is a new State of the same arrays on every call)."""
    leaves_a, tree_a = jax.tree.flatten(a)
    leaves_b, tree_b = jax.tree.flatten(b)
    return tree_a == tree_b and all(x is y for x, y in zip(leaves_a, leaves_b, strict=True))


def _settled(params: Any) -> Any:
    """`params`, each array's per-device buffers listed once here (the module docstring: threads
    placing them at once would race to list them)."""
    for x in jax.tree.leaves(params):
        if isinstance(x, jax.Array):
            x.addressable_shards  # noqa: B018 (cached by the array)
    return params


def published_shapes(params_like: Any, dtype: str = "") -> Any:
    """The shapes and dtypes a publish hands the sampler for parameters like `params_like`: floating
    leaves in `dtype` (a config.sampler_dtype; empty: their own). What an engine compiles for."""
    if dtype and dtype not in DTYPES:
        raise ValueError(
            f"published_shapes dtype={dtype!r}; expected one of {tuple(DTYPES)} or ''."
        )
    cast = functools.partial(_cast, dtype=DTYPES[dtype] if dtype else None)
    return jax.eval_shape(lambda p: jax.tree.map(cast, p), params_like)


def _cast(x: Any, *, dtype: Any) -> Any:
    """A floating parameter in the sampler's dtype (None: its own); others unchanged."""
    if dtype is None or not jnp.issubdtype(x.dtype, jnp.floating) or x.dtype == dtype:
        return x
    return x.astype(dtype)


def _copy(params: Any, *, dtype: Any) -> Any:
    """`params` cast as `_cast` does, every leaf in a new buffer (jitted: on their devices)."""
    return jax.tree.map(lambda x: jnp.copy(_cast(x, dtype=dtype)), params)
