"""Trees of device arrays as host numpy, for tests that compare states bit for bit."""

import jax
import numpy as np


def host_arrays(tree) -> dict[str, np.ndarray]:
    """Leaf path -> numpy copy (PRNG keys as their key data)."""
    out = {}
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        out[jax.tree_util.keystr(path)] = np.asarray(jax.device_get(x))
    return out


def assert_bitwise_equal(got, want) -> None:
    """Two trees (or host_arrays of them) have the same leaves, bit for bit."""
    got = got if isinstance(got, dict) else host_arrays(got)
    want = want if isinstance(want, dict) else host_arrays(want)
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
