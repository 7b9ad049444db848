"""Running slots taken out of one engine's decode state and written into another's (migration).

`export_slots` copies running slots' KV cache rows (up to their positions), positions, last tokens
and sampling state into a SlotState; `import_slots` writes it into free slots of another engine, on
any devices, where the slots go on with exactly the tokens they would have produced (a slot's
random stream is its request's and sample's). JigsawRL migration moves requests this way
(sampler/migration.py; rl/elastic/migration.py decides what moves).

The host functions (`export_plan`, `import_plan`) check the slots and pick the padded shapes; the
device functions (`export_rows`, `import_rows`) move the rows.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from sampler.cache import PER_SLOT, CacheLayout, DecodeState

# Migration exports a slot's KV rows up to a power-of-two count of this many positions.
EXPORT_BLOCK = 32


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SlotState:
    """Running slots' state taken out of an engine (`export_slots`) for another (`import_slots`).

    Rows are padded to a power of two (the padding repeats the first slot and is dropped on
    import); `count` of them are real. Cache rows stop at `length` positions (whole attention
    blocks covering every exported slot's position).
    """

    k: tuple[jax.Array, ...]  # (N, kv heads, length, head dim) per layer
    v: tuple[jax.Array, ...]
    tokens: jax.Array  # (N,) and the other per-slot DecodeState fields, as in DecodeState
    positions: jax.Array
    active: jax.Array
    last_position: jax.Array
    keys: jax.Array
    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    stop_ids: jax.Array
    count: int = dataclasses.field(metadata=dict(static=True), default=0)

    @property
    def nbytes(self) -> int:
        """Bytes of the real rows (what a migration moves)."""
        leaves = [x for x in jax.tree.leaves(self) if hasattr(x, "dtype")]
        total = sum(
            x.size * (8 if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x.itemsize)
            for x in leaves
        )
        return total * self.count // self.tokens.shape[0]


# ------------------------------------------------------------------------------------------ host


def export_plan(
    state: DecodeState, slots: list[int], layout: CacheLayout
) -> tuple[np.ndarray, int]:
    """Checks `slots` are distinct running slots of `state`; returns them padded to a power of two
    (repeating the first) and the positions to export: a power-of-two count of EXPORT_BLOCK
    positions covering every slot's written positions 0..position (few export shapes compile)."""
    if not slots or len(set(slots)) != len(slots):
        raise ValueError(f"export_slots: expected distinct slots; received {slots}.")
    if not all(0 <= x < layout.slots for x in slots):
        raise ValueError(f"export_slots: slots must be in [0, {layout.slots}); received {slots}.")
    pos, active = jax.device_get((state.positions, state.active))
    if not all(active[slots]):
        raise ValueError(f"export_slots: slots {slots} must all be running; some are not.")
    need = int(np.max(pos[slots])) + 1
    blocks = 1 << (-(-need // EXPORT_BLOCK) - 1).bit_length()
    length = min(EXPORT_BLOCK * blocks, layout.length)
    n = 1 << (len(slots) - 1).bit_length()
    return np.asarray(slots + [slots[0]] * (n - len(slots)), np.int32), length


def rungs(layout: CacheLayout, max_rows: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The row counts and position counts `export_plan` picks for up to `max_rows` slots at once:
    one export and one import program per pair."""
    pow2s = lambda top: tuple(1 << i for i in range(top.bit_length()) if 1 << i <= top)
    rows = pow2s(1 << (max_rows - 1).bit_length())
    lengths = sorted({min(EXPORT_BLOCK * b, layout.length) for b in pow2s(2 * layout.length)})
    return rows, tuple(lengths)


def import_plan(
    state: DecodeState, moved: SlotState, slots: list[int], layout: CacheLayout
) -> np.ndarray:
    """Checks `moved` fits `state` and `slots` are as many distinct free slots; returns them padded
    to `moved`'s rows with an out-of-range slot (dropped)."""
    if len(slots) != moved.count or len(set(slots)) != len(slots):
        raise ValueError(f"import_slots: expected {moved.count} distinct slots; received {slots}.")
    if not all(0 <= x < layout.slots for x in slots):
        raise ValueError(f"import_slots: slots must be in [0, {layout.slots}); received {slots}.")
    length = moved.v[0].shape[2]  # (N, K, length, H)
    if length > layout.length or len(moved.k) != len(state.cache.k):
        raise ValueError(
            f"import_slots: {len(moved.k)} layers of {length} positions do not "
            f"fit this engine's {len(state.cache.k)} layers of {layout.length}."
        )
    if jax.device_get(state.active)[slots].any():
        raise ValueError(f"import_slots: slots {slots} must be free; some are running.")
    n = moved.tokens.shape[0]
    return np.asarray(slots + [layout.slots] * (n - len(slots)), np.int32)


# ---------------------------------------------------------------------------------------- device


def export_rows(state: DecodeState, slots_N: jax.Array, length: int) -> SlotState:
    """The rows of slots_N, cache rows cut at `length` positions (`count` left 0: set it)."""
    k, v = state.cache.rows(slots_N, length)
    return SlotState(k=k, v=v, **{name: getattr(state, name)[slots_N] for name in PER_SLOT})


def import_rows(state: DecodeState, moved: SlotState, slots_N: jax.Array) -> DecodeState:
    """`state` with row i of `moved` written into slots_N[i] (out of range: dropped)."""
    return DecodeState(
        cache=state.cache.put_rows(slots_N, moved.k, moved.v),
        **{
            name: getattr(state, name).at[slots_N].set(getattr(moved, name), mode="drop")
            for name in PER_SLOT
        },
    )
