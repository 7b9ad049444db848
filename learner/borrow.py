"""Borrowing devices: the learner's arrays moved onto a mesh extended over another side's devices.

While the sampler drains, the learner may train on the sampler's devices too (BiDiRL,
rl.elastic.borrowing): `extended_mesh` is the data-parallel mesh over the learner's devices then
the borrowed ones (fsdp over all of them, tp kept), and the learner's arrays (TrainState,
accumulator, behaviour and reference params, the untrained LoRA base) move there and back whole,
as one tuple:

    arrays = move(arrays, extended)               # one process: a device_put, donating
    arrays = from_host(snapshot.arrays, extended) # across processes: each builds its own shards
    arrays = gather_home(arrays, extended, home)  # across processes, back: a collective

Across processes (a Ray sampler replica's devices, lent to the learner's jax.distributed job) a
device_put cannot reach the other processes' devices: each joins with the learner's
`BorrowSnapshot` (host arrays and the round's bookkeeping). learner.Learner's borrow / give_back
use these with the programs of each mesh (learner/programs.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, ClassVar

import jax
import numpy as np
from jax.sharding import Mesh

from learner.distributed import put_global
from learner.programs import Programs

# (TrainState, Accum | None, behaviour params | None, reference params | None, frozen params)
Arrays = tuple[Any, Any, Any, Any, Any]


@dataclasses.dataclass(frozen=True)
class BorrowSnapshot:
    """The learner as the processes lending it devices need it (Learner.borrow_snapshot)."""

    FIELDS: ClassVar[tuple[str, ...]] = (
        "_pending",
        "_params_shared",
        "updates_in_round",
        "groups_in_update",
        "_tokens_in_update",
        "_filtered_in_update",
    )
    arrays: Arrays  # as host arrays
    fields: dict[str, Any]  # FIELDS' values (the Learner's attributes of those names)


def extended_mesh(home: Mesh, devices: Sequence[Any]) -> Mesh:
    """The data-parallel mesh over `home`'s devices then `devices` (fsdp over all of them, tp
    kept).

    Raises:
      ValueError: `devices` is empty or shares a device with `home`, or the devices together do
        not divide into home's tp groups.
    """
    devices = list(devices)
    own = list(home.devices.flat)
    if set(map(id, devices)) & set(map(id, own)) or not devices:
        raise ValueError(
            f"borrow: expected devices disjoint from the learner's {own}; received {devices}."
        )
    tp = home.shape["tp"]
    if (len(own) + len(devices)) % tp:
        raise ValueError(
            f"borrow: {len(own)} + {len(devices)} devices do not divide into tp={tp} groups."
        )
    return Mesh(np.array(own + devices).reshape(-1, tp), ("fsdp", "tp"))


def move(arrays: Arrays, to: Programs) -> Arrays:
    """`arrays` resharded onto `to`'s mesh (one process), donating the old buffers."""
    state, acc, behavior, ref, frozen = arrays
    state = jax.device_put(state, to.shardings, donate=True)
    frozen = jax.device_put(frozen, to.frozen_shardings, donate=True)
    if acc is not None:
        acc = jax.device_put(acc, to.acc_shardings, donate=True)
    if behavior is not None:
        behavior = jax.device_put(behavior, to.shardings.params, donate=True)
    if ref is not None:
        ref = jax.device_put(ref, to.shardings.params, donate=True)
    out = (state, acc, behavior, ref, frozen)
    jax.block_until_ready(out)
    return out


def from_host(arrays: Arrays, to: Programs) -> Arrays:
    """Host `arrays` (a BorrowSnapshot's) placed on `to`'s mesh, each process its own shards."""
    state, acc, behavior, ref, frozen = arrays
    out = (
        jax.tree.map(put_global, state, to.shardings),
        None if acc is None else jax.tree.map(put_global, acc, to.acc_shardings),
        None if behavior is None else jax.tree.map(put_global, behavior, to.shardings.params),
        None if ref is None else jax.tree.map(put_global, ref, to.shardings.params),
        jax.tree.map(put_global, frozen, to.frozen_shardings),
    )
    jax.block_until_ready(out)
    return out


def gather_home(arrays: Arrays, ext: Programs, home: Programs) -> Arrays:
    """`arrays` from the extended mesh (across processes) back on `home`'s: gathered whole on
    `ext` (a collective every process joins), kept by the learner's process; a lending process
    gets None for each (the learner's arrays are not its own)."""

    def back(tree: Any, shardings: Any) -> Any:
        if tree is None:
            return None
        whole = ext.gather(tree)
        if not all(s.is_fully_addressable for s in jax.tree.leaves(shardings)):
            return None  # a lending process: the learner's arrays are not its own
        local = jax.tree.map(lambda x: x.addressable_shards[0].data, whole)
        return jax.device_put(local, shardings)

    state, acc, behavior, ref, frozen = arrays
    out = (
        back(state, home.shardings),
        back(acc, home.acc_shardings),
        back(behavior, home.shardings.params),
        back(ref, home.shardings.params),
        back(frozen, home.frozen_shardings),
    )
    jax.block_until_ready(out)
    return out
