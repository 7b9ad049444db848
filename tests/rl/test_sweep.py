"""A sweep's pipelines from one config (rl/sweep.py): names, workdirs, typed values, errors."""

import pytest

from configs import smoke
from rl.sweep import expand, run_sweep


def test_values_give_the_product_of_typed_fields_each_in_its_own_workdir():
    base = smoke.get_config()
    out = expand(base, "learner.optimizer.lr=1e-3,2e-3; seed=0,1")
    assert [n for n, _ in out] == [
        "learner.optimizer.lr=0.001,seed=0",
        "learner.optimizer.lr=0.001,seed=1",
        "learner.optimizer.lr=0.002,seed=0",
        "learner.optimizer.lr=0.002,seed=1",
    ]
    name, last = out[-1]
    assert last.learner.optimizer.lr == 2e-3 and last.seed == 1
    assert last.workdir == f"{base.workdir}/{name}"
    assert base.seed == smoke.get_config().seed  # the base config is left as it was
    flags = expand(base, "driver.tail.enabled=true,false")
    assert [c.driver.tail.enabled for _, c in flags] == [True, False]


@pytest.mark.parametrize(
    "values,message",
    [
        ("", "empty"),
        ("seed", "expected key=v1,v2"),
        ("seed=0,", "expected key=v1,v2"),
        ("sede=0,1", "no config field 'sede'"),
        ("learner.optimiser.lr=1,2", "no config field 'learner.optimiser'"),
        ("learner=1,2", "is a section"),
        ("seed=0,x", "seed='x': expected type int"),
        ("driver.tail.enabled=yes,maybe", "expected type bool"),
        ("mesh.sampler_replicas=1,2", "share one pool of devices"),
        ("seed=0", "gives 1 pipeline"),
    ],
)
def test_bad_values_are_one_error_naming_the_field(values, message):
    with pytest.raises(ValueError, match=message):
        expand(smoke.get_config(), values)


PLANNED = {"mesh.split": "plan", "mesh.learner_devices": 0, "mesh.sampler_devices": 0}


@pytest.mark.parametrize(
    "fields,message",
    [
        ({"elastic.migration": "tail"}, "pipeline seed=0: config.elastic.migration='tail'.*Ray"),
        (
            {**PLANNED, "elastic.stage_model": "preset:qwen3-1.7b:h100"},
            "pipeline seed=0: config.mesh.split='plan' in a multiplexed sweep under Ray",
        ),
        (PLANNED, "pipeline seed=0: config.mesh.split='plan' with no"),  # a ConfigError
    ],
)
def test_a_ray_sweep_refuses_what_its_pool_does_not_run_before_anything_starts(fields, message):
    base = smoke.get_config()
    base.runtime, base.mesh.sampler_replicas = "ray", 2
    for field, value in fields.items():
        section, name = field.split(".")
        base[section][name] = value
    with pytest.raises(ValueError, match=message):
        run_sweep(expand(base, "seed=0,1"))
