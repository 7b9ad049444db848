"""Registries by name, and what carries a script's registrations to another process: `snapshot`
pickles (cloudpickle, as Ray sends it) and `install` adds the names the other process lacks."""

import cloudpickle
import pytest

from rl import registry
from rl.admission import POLICIES
from rl.formation import FORMERS
from rl.losses import LOSS_OPTIONS, POLICY_LOSSES
from rl.rewards import REWARDS
from rl.tasks.registry import TASKS


def test_get_names_the_registered_ones_and_a_name_registers_once():
    rewards = registry.Registry("test thing")
    rewards.register("a")(len)
    assert rewards.get("a") is len and rewards.get("b", None) is None
    with pytest.raises(ValueError, match=r"Unknown test thing 'b'; expected one of \['a'\]"):
        rewards.get("b")
    with pytest.raises(ValueError, match="Test thing 'a' is already registered"):
        rewards.register("a")(str)


def test_every_library_registry_is_in_the_snapshot():
    kinds = registry.snapshot()
    for r in (REWARDS, POLICY_LOSSES, LOSS_OPTIONS, TASKS, POLICIES, FORMERS):
        assert kinds[r.kind] == dict(r)


def test_a_local_function_travels_by_value_and_installs_only_what_is_missing():
    def shout(request, text):  # defined here: another process could not import it
        return float(text.isupper())

    REWARDS.register("test_shout")(shout)
    try:
        shipped = cloudpickle.loads(cloudpickle.dumps(registry.snapshot()))
    finally:
        del REWARDS["test_shout"]
    assert "test_shout" not in REWARDS  # as in a worker process, which never registered it
    exact = REWARDS["exact"]
    shipped["reward"]["exact"] = len  # a name the worker has keeps its own entry
    shipped["a kind this process has no registry of"] = {"x": len}
    try:
        registry.install(shipped)
        assert REWARDS["test_shout"](None, "YES") == 1.0
        assert REWARDS["exact"] is exact
    finally:
        REWARDS.pop("test_shout", None)
