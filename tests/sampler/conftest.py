"""Shared tiny model for sampler tests: init_std 0.3 so greedy outputs are not constant."""

import pytest

from rl.models import create_model, get_preset


@pytest.fixture(scope="module")
def model():
    return create_model(get_preset("tiny", init_std=0.3), seed=0)
