"""Registries by name, and what carries a script's registrations to a Ray worker
(rl.runtime.ray_process.worker_payload / worker_config): each entry pickled on its own, the worker
installing the names it lacks, an entry it cannot load named with the reason when looked up."""

import threading

import ml_collections
import pytest

from rl import registry
from rl.admission import POLICIES, make_policy
from rl.formation import FORMERS, make_former
from rl.loss_config import LossConfig
from rl.losses import LOSS_OPTIONS, POLICY_LOSSES
from rl.rewards import REWARDS
from rl.runtime.ray_process import worker_config, worker_payload
from rl.tasks.registry import TASKS, get_task


def test_get_names_the_registered_ones_and_a_name_registers_once():
    things = registry.Registry("test thing")
    things.register("a")(len)
    assert things.get("a") is len and things.get("b", None) is None
    with pytest.raises(ValueError, match=r"Unknown test thing 'b'; expected one of \['a'\]"):
        things.get("b")
    with pytest.raises(ValueError, match="Test thing 'a' is already registered"):
        things.register("a")(str)


def test_every_library_registry_is_in_the_snapshot():
    kinds = registry.snapshot()
    for r in (REWARDS, POLICY_LOSSES, LOSS_OPTIONS, TASKS, POLICIES, FORMERS):
        assert kinds[r.kind] == dict(r)


def test_a_payload_carries_a_local_function_and_names_what_a_worker_cannot_load():
    def shout(request, text):  # defined here: another process could not import it
        return float(text.isupper())

    REWARDS.register("test_shout")(shout)
    lock = threading.Lock()  # no pickle takes it
    REWARDS.register("test_unpicklable")(lambda r, t: 0.0 if lock else 1.0)
    try:
        payload = worker_payload(ml_collections.ConfigDict({"seed": 3}))
    finally:
        del REWARDS["test_shout"], REWARDS["test_unpicklable"]
    # as in a worker process, which never registered them; a name it has keeps its own entry
    exact = REWARDS["exact"]
    payload["registrations"]["reward"]["exact"] = payload["registrations"]["reward"]["digits"]
    payload["registrations"]["a kind this process has no registry of"] = {"x": b"junk"}
    # a function of a module the worker cannot import (pickled by reference in the driver)
    payload["registrations"]["reward"]["test_elsewhere"] = b"cno_such_module_here\nfn\n."
    try:
        assert worker_config(payload).seed == 3
        assert REWARDS.get("test_shout")(None, "YES") == 1.0
        assert REWARDS["exact"] is exact
        with pytest.raises(ValueError, match="'test_unpicklable' in this worker process.*pickled"):
            REWARDS.get("test_unpicklable")
        with pytest.raises(ValueError, match="ModuleNotFoundError.*no_such_module_here"):
            REWARDS.get("test_elsewhere")
    finally:
        REWARDS.pop("test_shout", None)
        REWARDS.unloaded.pop("test_unpicklable", None)
        REWARDS.unloaded.pop("test_elsewhere", None)


@pytest.mark.parametrize(
    "registry, look_up",
    [
        (TASKS, get_task),
        (FORMERS, lambda name: make_former(name, 2)),
        (POLICIES, make_policy),
        (LOSS_OPTIONS, LossConfig().options),
    ],
    ids=["task", "former", "admission", "loss options"],
)
def test_every_lookup_says_why_a_worker_could_not_load_an_entry(registry, look_up):
    """The lookups with their own messages name an entry the driver registered and this process
    could not load, with the reason, rather than calling it unknown."""
    registry.unloaded["test_missing"] = "ModuleNotFoundError: No module named 'mine'"
    try:
        with pytest.raises(ValueError, match="could not be loaded here .ModuleNotFoundError"):
            look_up("test_missing")
    finally:
        del registry.unloaded["test_missing"]
    with pytest.raises(ValueError, match="expected one of"):
        look_up("test_missing")
