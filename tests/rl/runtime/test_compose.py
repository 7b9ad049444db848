"""The composition root: config.runtime and config.ray are checked before anything starts."""

import pytest

from configs import base
from rl.elastic.migration import Always, Off, Tail
from rl.runtime.compose import build_migration
from rl.runtime.factory import check_runtime_config


def config(**fields):
    c = base.get_config("smoke")
    c.sft.max_steps = 0
    for key, value in fields.items():
        node = c
        *path, last = key.split(".")
        for p in path:
            node = node[p]
        node[last] = value
    return c


@pytest.mark.parametrize(
    "fields, match",
    [
        (
            {"runtime": "processes"},
            r"config.runtime='processes'; expected one of \('threads', 'ray'\)",
        ),
        (
            {"runtime": "ray", "mesh.sampler_routing": "random"},
            r"config.mesh.sampler_routing='random'; expected one",
        ),
        (
            {"runtime": "ray", "ray.migration_poll_s": 0},
            r"config.ray.migration_poll_s must be a number > 0; received 0",
        ),
        (
            {"runtime": "ray", "elastic.borrowing": "both", "ray.learner_workers": 2},
            r"borrowing='both' with config.ray.learner_workers=2: .* expected "
            r"config.ray.learner_workers=1",
        ),
        (
            {"runtime": "ray", "elastic.borrowing": "sampler", "ray.learner_workers": 2},
            r"borrowing='sampler' with config.ray.learner_workers=2: .* expected",
        ),
        (
            {"runtime": "ray", "ray.on_replica_failure": "retry"},
            r"on_replica_failure='retry'; expected one of \('resample', 'stop'\)",
        ),
        (
            {"runtime": "ray", "ray.weights": "nccl"},
            r"ray.weights='nccl'; expected one of \('auto', 'transfer', 'object_store'\)",
        ),
        ({"runtime": "ray", "mesh.sampler_replicas": 0}, r"sampler_replicas must be an int >= 1"),
        ({"runtime": "ray", "ray.replica_gpus": -1}, r"replica_gpus must be a number >= 0"),
        (
            {"runtime": "ray", "sft.max_steps": 5, "ray.learner_workers": 2},
            r"sft.max_steps=5 with config.ray.learner_workers=2: .* expected",
        ),
    ],
)
def test_bad_runtime_config_is_named(fields, match):
    with pytest.raises(ValueError, match=match):
        check_runtime_config(config(**fields))


def test_good_runtime_configs_pass():
    check_runtime_config(config())
    check_runtime_config(config(runtime="ray", **{"mesh.sampler_replicas": 2}))
    # tail batching, response over-provisioning and the SFT warm start all run under Ray
    tail = {"driver.tail.enabled": True, "driver.tail.response_eta": 1.5, "sft.max_steps": 5}
    check_runtime_config(config(runtime="ray", **tail))
    # migration between replica actors, and the learner worker lending its devices to the sampler
    elastic = {"elastic.migration": "tail", "elastic.borrowing": "sampler"}
    check_runtime_config(config(runtime="ray", **{"mesh.sampler_replicas": 2}, **elastic))


def test_tail_migration_is_off_in_one_pipeline_and_says_why(caplog):
    """No consumer for the replicas `tail` frees in one pipeline, in any mode (the simulator's
    figures in rl/elastic/migration.py); `always`, the forcing mode, still moves."""
    for fields in (
        {"mesh.sampler_replicas": 2},
        {"driver.mode": "async"},
        {"elastic.borrowing": "learner"},
    ):
        caplog.clear()
        with caplog.at_level("WARNING"):
            assert isinstance(
                build_migration(config(**{"elastic.migration": "tail"}, **fields)), Off
            )
        assert "migration is off for this run" in caplog.text
    assert isinstance(build_migration(config(**{"elastic.migration": "always"})), Always)


def test_in_a_multiplexed_pool_tail_runs_on_demand():
    """The other pipelines consume what `tail` frees: it empties recalled replicas and spreads
    onto joining ones, and never consolidates by itself; `off` stays off."""
    pooled = build_migration(config(**{"elastic.migration": "tail"}), pooled=True)
    assert isinstance(pooled, Tail) and pooled.config.on_demand
    assert isinstance(build_migration(config(), pooled=True), Off)
