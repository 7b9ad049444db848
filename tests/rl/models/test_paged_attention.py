"""The decode attention seam: the Pallas paged kernels (ours, and JAX's TPU kernel on kv-major pools;
interpret mode on CPU) equal the gathered XLA reference, a kv-major cache holds and reads exactly
what a page-major one does, a window of gathered blocks stays the cache's through a call's writes,
and a bad name is refused (an engine decoding with each:
tests/sampler/test_paged.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import smoke
from rl.config_check import ConfigError, check_config
from rl.models.attention import attend_blocks
from rl.models.kv_cache import HeadMajorLayer, PagedKVCache, PagedLayer, WindowLayer
from rl.models.paged_attention import DECODE_ATTENTION, paged_attention
from sampler.engine import EngineConfig

TOL = 1e-5  # float32 attention outputs, absolute and relative: the kernel sums in another order
# JAX's TPU kernel in TPU interpret mode rounds its matmuls' inputs to bfloat16 (a TPU's default
# precision): queries and keys, then probabilities and values, 2^-8 relative each
TPU_TOL = 3e-2

C, M, POOL, H = 4, 4, 12, 8  # positions per page, table width, pages in the pool, head_dim
# One row per case: its position (first page, mid-page, a page's last slot, the table's last
# position) and how many of its leading pages it shares with row 0 (a group's prompt pages).
POSITIONS = (0, 2, 6, 11, 15, 9)
SHARED = (1, 1, 1, 2, 2, 0)


def _pools(n, kv, seed=0, dtype=jnp.float32):
    """Random queries, pools and a table: shared leading pages, each row's own pages after them,
    and the entries past a row's position out of range (P, or far past it)."""
    rng = np.random.default_rng(seed)
    b = len(POSITIONS)
    q = jnp.asarray(rng.normal(size=(b, n, H)), dtype)
    k = jnp.asarray(rng.normal(size=(POOL, kv, H, C)), dtype)
    v = jnp.asarray(rng.normal(size=(POOL, kv, C, H)), dtype)
    prompt = rng.permutation(POOL)[:2]
    own = iter(rng.permutation([p for p in range(POOL) if p not in prompt]).tolist() * 2)
    table = np.full((b, M), POOL, np.int32)
    for row, (pos, shared) in enumerate(zip(POSITIONS, SHARED, strict=True)):
        for j in range(pos // C + 1):
            table[row, j] = prompt[j] if j < shared else next(own)
    table[-1, POSITIONS[-1] // C + 1 :] = POOL + 1000  # far out of range, not just P
    return q, PagedLayer(k=k, v=v, table=jnp.asarray(table)), jnp.asarray(POSITIONS, jnp.int32)


def _kv_major(layer):
    """The same pages laid out kv-major: both pools (K, P, page, H)."""
    k, v = layer.k.transpose(1, 0, 3, 2), layer.v.transpose(1, 0, 2, 3)
    return PagedLayer(k=k, v=v, table=layer.table, kv_major=True)


def _same(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_a_kv_major_cache_holds_and_reads_what_a_page_major_one_does():
    q, layer, pos = _pools(4, 2, seed=5)
    major = _kv_major(layer)
    _same(major.blocks(2, 2 * C), layer.blocks(2, 2 * C))
    _same(major.blocks(3, C), layer.blocks(3, C))
    _same(major.view(), layer.view())
    rng = np.random.default_rng(6)
    new = [jnp.asarray(rng.normal(size=(len(POSITIONS), 2, H)), jnp.float32) for _ in "kv"]
    _same(major.write(*new, pos).view(), layer.write(*new, pos).view())
    # a whole cache: prefill writes, rows out and back in (migration, swapping), any slots
    one, two = (
        PagedKVCache(k=(x.k,), v=(x.v,), table=x.table, kv_major=x.kv_major) for x in (layer, major)
    )
    slots = jnp.asarray([4, 0, len(POSITIONS)], jnp.int32)  # the last is out of range: dropped
    kv = [(jnp.asarray(rng.normal(size=(3, 7, 2, H)), jnp.float32),) for _ in "kv"]
    one, two = one.put(slots, *kv), two.put(slots, *kv)
    _same(two.layer(0).view(), one.layer(0).view())
    rows = one.rows(jnp.asarray([1, 3]), 2 * C)
    _same(two.rows(jnp.asarray([1, 3]), 2 * C), rows)
    _same(
        two.put_rows(jnp.asarray([2, 5]), *rows).layer(0).view(),
        one.put_rows(jnp.asarray([2, 5]), *rows).layer(0).view(),
    )


@pytest.mark.parametrize("layout", ["dense", "paged", "kv_major"])
def test_a_window_reads_what_the_cache_holds_after_every_write(layout):
    # a generate call gathers its blocks once (sampler/decode.py): each of its steps writes to the
    # cache and the window alike and reads from the window what a gather would give. As in the
    # engine, a live row writes only into pages of its own (rows 0 and 1 share a prompt page);
    # row 3 is free (no pages), its position past the window: its writes are dropped
    rng = np.random.default_rng(7)
    table = np.full((4, M), POOL, np.int32)
    table[0, :2], table[1, :3], table[2, :2] = [0, 1], [0, 2, 3], [4, 5]
    start = jnp.asarray([5, 9, 4, 2 * 2 * C + 1], jnp.int32)
    layer = PagedLayer(
        k=jnp.asarray(rng.normal(size=(POOL, 2, H, C)), jnp.float32),
        v=jnp.asarray(rng.normal(size=(POOL, 2, C, H)), jnp.float32),
        table=jnp.asarray(table),
    )
    if layout == "dense":  # the same positions in dense rows
        layer = HeadMajorLayer(*layer.view())
    elif layout == "kv_major":
        layer = _kv_major(layer)
    n, block = 2, 2 * C
    window = WindowLayer(layer, *layer.blocks(n, block))
    q = jnp.asarray(rng.normal(size=(4, 4, H)), jnp.float32)
    attend = DECODE_ATTENTION.get("xla")
    live = slice(0, 3)  # a dense cache clamps the free row's write into its last position
    for step in range(3):
        new = [jnp.asarray(rng.normal(size=(4, 2, H)), jnp.float32) for _ in "kv"]
        at = start + jnp.asarray([step, step, step, 0])
        layer, window = layer.write(*new, at), window.write(*new, at)
        _same(window.layer, layer)
        _same([x[live] for x in window.blocks(n, block)], [x[live] for x in layer.blocks(n, block)])
        _same(
            attend(q, window, at, blocks=n, block=block)[live],
            attend(q, layer, at, blocks=n, block=block)[live],
        )
    with pytest.raises(ValueError, match="window of 2 blocks of 8 positions was asked for 1"):
        window.blocks(1, block)


@pytest.mark.parametrize("n,kv", [(4, 2), (6, 2), (4, 4)])  # GQA; G = 3 pads to 4; MHA
def test_pallas_kernel_equals_gathered_reference(n, kv):
    q, layer, pos = _pools(n, kv, seed=n + kv)
    assert len(set(np.asarray(layer.table)[:5, 0].tolist())) == 1  # rows share a prompt page
    ref = attend_blocks(q, *layer.blocks(M, C), pos)
    out = paged_attention(q, layer.k, layer.v, layer.table, pos)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=TOL, rtol=TOL)


@pytest.mark.parametrize("blocks,block", [(2, 2 * C), (1, 2 * C), (3, C)])
def test_pallas_seam_reads_the_blocks_the_xla_one_does(blocks, block):
    # (1, 2C) and (3, C) read fewer positions than some rows hold: those rows attend to every
    # position read, in both (the engine never asks that of a live row; a free one may)
    q, layer, pos = _pools(4, 2, seed=1)
    xla = DECODE_ATTENTION.get("xla")(q, layer, pos, blocks=blocks, block=block)
    pallas = DECODE_ATTENTION.get("pallas")(q, layer, pos, blocks=blocks, block=block)
    np.testing.assert_allclose(np.asarray(pallas), np.asarray(xla), atol=TOL, rtol=TOL)


@pytest.mark.parametrize("n,kv", [(4, 2), (6, 2), (4, 4)])
@pytest.mark.parametrize("blocks,block", [(0, 0), (2, 2 * C), (1, 2 * C), (3, C)])
def test_the_tpu_kernel_reads_what_the_xla_seam_does(n, kv, blocks, block):
    q, layer, pos = _pools(n, kv, seed=n + kv + blocks)
    xla = DECODE_ATTENTION.get("xla")(q, layer, pos, blocks=blocks, block=block)
    tpu = DECODE_ATTENTION.get("pallas_tpu")(q, _kv_major(layer), pos, blocks=blocks, block=block)
    assert tpu.shape == xla.shape and tpu.dtype == xla.dtype
    np.testing.assert_allclose(np.asarray(tpu), np.asarray(xla), atol=TPU_TOL, rtol=TPU_TOL)
    # not a coincidence of small outputs: the rows differ from one another by far more
    assert np.abs(np.diff(np.asarray(xla), axis=0)).max() > 20 * TPU_TOL


def test_pallas_kernel_reads_a_bfloat16_pool_in_float32():
    q, layer, pos = _pools(4, 2, seed=2, dtype=jnp.bfloat16)
    ref = attend_blocks(q, *layer.blocks(M, C), pos).astype(jnp.float32)
    out = paged_attention(q, layer.k, layer.v, layer.table, pos).astype(jnp.float32)
    # both accumulate in float32 and round once to bfloat16 (8 bits of mantissa)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2**-7, rtol=2**-7)


@pytest.mark.parametrize("kernel", ["pallas", "pallas_tpu"])
def test_the_pallas_kernels_refuse_a_dense_layer_or_the_other_layout(kernel):
    q, layer, pos = _pools(4, 2)
    dense = HeadMajorLayer(k=jnp.zeros((6, 2, H, 16)), v=jnp.zeros((6, 2, 16, H)))
    with pytest.raises(ValueError, match=f"'{kernel}' reads a paged cache; received a HeadMajorL"):
        DECODE_ATTENTION.get(kernel)(q, dense, pos, blocks=1, block=16)
    other = layer if kernel == "pallas_tpu" else _kv_major(layer)
    want = "kv-major" if kernel == "pallas_tpu" else "page-major"
    with pytest.raises(ValueError, match=f"'{kernel}' reads {want} pools; received a layer with"):
        DECODE_ATTENTION.get(kernel)(q, other, pos, blocks=1, block=2 * C)


def test_a_bad_attention_kernel_names_the_value_and_the_choices():
    with pytest.raises(ValueError, match=r"attention_kernel='flash'; expected one of \['pallas'"):
        EngineConfig(max_length=64, max_prefill_length=32, attention_kernel="flash")
    for kernel in ("pallas", "pallas_tpu"):
        with pytest.raises(ValueError, match=f"'{kernel}' reads a paged cache's pages; received"):
            EngineConfig(max_length=64, max_prefill_length=32, page_size=0, attention_kernel=kernel)
    config = smoke.get_config()
    config.engine.attention_kernel = "flash"
    with pytest.raises(ConfigError) as e:
        check_config(config)
    assert e.value.problems == [
        "config.engine: EngineConfig.attention_kernel='flash'; expected one of ['pallas', "
        "'pallas_tpu', 'xla']."
    ]
