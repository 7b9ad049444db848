"""Workloads: deterministic, prompt-correlated long tails, capped; fixed per-prompt lengths."""

import numpy as np
import pytest

from rl.sim.workload import Workload, WorkloadConfig
from rl.types import Request, SamplingParams


def request(uid, round=0, g=8, cap=8192):
    return Request(
        uid=uid, round=round, prompt=(0,), group_size=g, params=SamplingParams(max_new_tokens=cap)
    )


def test_lengths_are_deterministic_and_independent_of_call_order():
    cfg = WorkloadConfig(seed=3)
    a = [Workload(cfg).lengths(request(u)) for u in range(20)]
    w = Workload(cfg)
    b = [w.lengths(request(u)) for u in reversed(range(20))][::-1]
    assert a == b
    assert a != [Workload(WorkloadConfig(seed=4)).lengths(request(u)) for u in range(20)]


def test_a_prompts_samples_share_its_difficulty():
    w = Workload(WorkloadConfig(runaway_fraction=0.0, prompt_sigma=1.0, sample_sigma=0.2))
    logs = np.log([w.lengths(request(u)) for u in range(400)])
    within = logs.var(axis=1).mean()
    across = logs.mean(axis=1).var()
    assert within < across / 5  # the spread is mostly between prompts
    again = np.log([w.lengths(request(u, round=1)) for u in range(400)])
    assert np.corrcoef(logs.mean(1), again.mean(1))[0, 1] > 0.9  # a long prompt runs long again


def test_cap_and_runaways():
    w = Workload(
        WorkloadConfig(runaway_fraction=0.2, runaway_p=1.0, max_new_tokens=4096, median_tokens=200)
    )
    lengths = np.array([w.lengths(request(u, cap=2000)) for u in range(500)])
    assert lengths.max() == 2000 and lengths.min() >= 1
    at_cap = (lengths == 2000).all(axis=1).mean()
    assert 0.12 < at_cap < 0.3


def test_fixed_lengths_belong_to_the_prompt_and_end_the_stream():
    w = Workload(WorkloadConfig(max_new_tokens=96, fixed_lengths=(5, 96, 7)))
    assert [p.uid for p in w.prompts()] == [0, 1, 2]
    assert w.lengths(request(1, round=4, g=3, cap=50)) == (50, 50, 50)
    with pytest.raises(ValueError, match="Prompt uid 3 has no fixed length"):
        w.lengths(request(3))
    with pytest.raises(ValueError, match="runaway_p must be in"):
        WorkloadConfig(runaway_p=2.0)
