"""The unbiased pass@k estimator (Chen et al. 2021, "Evaluating Large Language Models Trained on
Code", eq. 1): with n >= k samples of a problem of which c are correct,

    pass@k = 1 - C(n - c, k) / C(n, k),

the chance that k of the n samples drawn without replacement hold at least one correct one. Its
mean over problems is unbiased for the pass@k of k fresh samples; n = k gives the plain "any of
k correct" fraction, larger n lowers the variance.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def pass_at_k(n: int, c: int, k: int) -> float:
    """1 - C(n - c, k) / C(n, k), computed as a stable product.

    Args:
      n: samples drawn for the problem.
      c: how many of them are correct (0 <= c <= n).
      k: the k of pass@k (1 <= k <= n).
    """
    for name, v in (("n", n), ("c", c), ("k", k)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise ValueError(f"pass_at_k: {name} must be an int; received {v!r}.")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 1 <= k <= n; received n={n}, k={k}.")
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n; received n={n}, c={c}.")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    # C(n-c, k) / C(n, k) = prod_{i = n-c+1}^{n} (1 - k / i)
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


def mean_pass_at_k(correct: Sequence[Sequence[bool]], k: int) -> float:
    """The mean over problems of pass_at_k(n_i, c_i, k), problem i's samples in `correct[i]`."""
    if not correct:
        raise ValueError("mean_pass_at_k received no problems; expected at least one.")
    return float(np.mean([pass_at_k(len(s), int(sum(map(bool, s))), k) for s in correct]))
