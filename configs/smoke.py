"""Smoke config: the base config shrunk to a tiny byte-level model that runs on a CPU in seconds.

Launch:  python -m launch.train --config=configs/smoke.py
Expect:  "model: tiny (qwen3), ... parameters" and a forward pass with finite log-probs.
"""

import ml_collections

from configs import base


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    del arg  # already as small as it gets
    return base.get_config("smoke")
