"""rl.sections.from_section: the one way a typed config is built from a run config's section."""

from __future__ import annotations

import ml_collections
import pytest

from rl.driver import DriverConfig
from rl.elastic.borrowing import BorrowConfig
from rl.round_planner import TailConfig
from rl.sections import from_section
from rl.types import SamplingParams
from sampler.engine import EngineConfig


def test_a_section_builds_its_dataclass_with_derived_fields_and_nested_sections():
    section = ml_collections.ConfigDict(
        {"mode": "cgp", "groups_per_round": 8, "groups_per_update": 4, "tail": {"enabled": True}}
    )
    sampling = SamplingParams(max_new_tokens=16)
    driver = from_section(DriverConfig, section, name="driver", sampling=sampling)
    assert driver.tail == TailConfig(enabled=True)  # a ConfigDict sub-section: its dataclass
    assert driver.sampling is sampling and driver.mode == "cgp"


def test_unknown_fields_are_named_with_the_ones_expected_nested_ones_by_their_path():
    with pytest.raises(
        ValueError, match=r"config.engine has unknown fields \['slots'\].*max_slots"
    ):
        from_section(EngineConfig, {"slots": 4}, name="engine", seed=0)
    with pytest.raises(ValueError, match=r"config.driver.tail has unknown fields \['eta2'\]"):
        from_section(DriverConfig, {"tail": {"eta2": 1.0}}, name="driver")
    with pytest.raises(ValueError, match=r"config.engine sets \['seed'\], which the run derives"):
        from_section(EngineConfig, {"seed": 3}, name="engine", seed=0)
    with pytest.raises(ValueError, match=r"config.sampling=3; expected a section"):
        from_section(SamplingParams, 3, name="sampling")


def test_a_shared_section_gives_each_dataclass_its_own_fields():
    elastic = {"borrowing": "learner", "migration": "tail", "stage_model": "preset:x:h100"}
    borrow = from_section(BorrowConfig, elastic, name="elastic", shared=True)
    assert borrow.borrowing == "learner" and borrow.stage_model == "preset:x:h100"
    with pytest.raises(ValueError, match="unknown fields"):
        from_section(BorrowConfig, elastic, name="elastic")
