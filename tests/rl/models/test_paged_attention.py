"""The decode attention seam: the Pallas paged kernel (interpret mode on CPU) equals the gathered
XLA reference, and a bad name is refused (an engine decoding with either: tests/sampler/test_paged.py)."""

import jax.numpy as jnp
import numpy as np
import pytest

from configs import smoke
from rl.config_check import ConfigError, check_config
from rl.models.attention import attend_blocks
from rl.models.kv_cache import HeadMajorLayer, PagedLayer
from rl.models.paged_attention import DECODE_ATTENTION, paged_attention
from sampler.engine import EngineConfig

TOL = 1e-5  # float32 attention outputs, absolute and relative: the kernel sums in another order

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


def test_pallas_kernel_reads_a_bfloat16_pool_in_float32():
    q, layer, pos = _pools(4, 2, seed=2, dtype=jnp.bfloat16)
    ref = attend_blocks(q, *layer.blocks(M, C), pos).astype(jnp.float32)
    out = paged_attention(q, layer.k, layer.v, layer.table, pos).astype(jnp.float32)
    # both accumulate in float32 and round once to bfloat16 (8 bits of mantissa)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2**-7, rtol=2**-7)


def test_pallas_refuses_a_dense_layer():
    q, layer, pos = _pools(4, 2)
    dense = HeadMajorLayer(k=jnp.zeros((6, 2, H, 16)), v=jnp.zeros((6, 2, 16, H)))
    with pytest.raises(ValueError, match="reads a paged cache; received a HeadMajorLayer"):
        DECODE_ATTENTION.get("pallas")(q, dense, pos, blocks=1, block=16)


def test_a_bad_attention_kernel_names_the_value_and_the_choices():
    with pytest.raises(ValueError, match=r"attention_kernel='flash'; expected one of \['pallas'"):
        EngineConfig(max_length=64, max_prefill_length=32, attention_kernel="flash")
    with pytest.raises(ValueError, match="'pallas' reads a paged cache's pages; received page_s"):
        EngineConfig(max_length=64, max_prefill_length=32, page_size=0, attention_kernel="pallas")
    config = smoke.get_config()
    config.engine.attention_kernel = "flash"
    with pytest.raises(ConfigError) as e:
        check_config(config)
    assert e.value.problems == [
        "config.engine: EngineConfig.attention_kernel='flash'; expected one of ['pallas', 'xla']."
    ]
