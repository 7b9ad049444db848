"""README's "Write your own algorithm" example runs as written, with no edit to the library."""

import dataclasses
import json
import pathlib
import re

import pytest

from rl.advantages import ADVANTAGE_ESTIMATORS
from rl.losses import POLICY_LOSSES
from rl.rewards import REWARDS
from rl.tasks import TASKS
from rl.tasks import data as data_lib

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
MARKER = "<!-- readme-example: custom-algorithm -->"
NAMES = (
    (ADVANTAGE_ESTIMATORS, "leave_one_out_max"),
    (POLICY_LOSSES, "symmetric_clip"),
    (REWARDS, "digit_overlap"),
    (TASKS, "reverse_digits"),
)


def _example() -> str:
    text = README.read_text(encoding="utf-8")
    assert text.count(MARKER) == 1, f"expected one {MARKER!r} in README.md"
    block = re.match(r"\s*```python\n(.*?)\n```", text.split(MARKER, 1)[1], re.DOTALL)
    assert block, f"expected a ```python block right after {MARKER!r}"
    return block[1]


@pytest.fixture
def clean_registries():
    """The example registers new names; they are removed again so it can run twice."""
    for registry, name in NAMES:
        registry.pop(name, None)
    yield
    for registry, name in NAMES:
        registry.pop(name, None)


def test_readme_custom_algorithm_example_runs(tmp_path, monkeypatch, clean_registries):
    monkeypatch.chdir(tmp_path)  # the example writes runs/custom_algorithm under the cwd
    loads = []  # (task, split or path, options) of every record load the run makes
    get_task = data_lib.get_task

    def spy(name):
        task = get_task(name)

        def load(where, *args, **kwargs):
            loads.append((name, where, {k: v for k, v in kwargs.items() if k != "seed"}))
            return task.load(where, *args, **kwargs)

        return dataclasses.replace(task, load=load)

    monkeypatch.setattr(data_lib, "get_task", spy)
    namespace: dict = {"__name__": "readme_example"}
    exec(compile(_example(), str(README), "exec"), namespace)

    config, summary = namespace["config"], namespace["summary"]
    assert (
        config.learner.advantage,
        config.learner.policy_loss,
        config.task.reward,
        config.task.name,
    ) == tuple(name for _, name in NAMES)
    for registry, name in NAMES:  # registered through the public registries
        entry = registry[name]
        assert (entry.load if registry is TASKS else entry) is namespace[name]
    # the run's records came from the task, with its option set in the config
    assert loads == [
        ("reverse_digits", "train", {"length": 4}),
        ("reverse_digits", "heldout", {"length": 4}),
    ]
    assert summary["data"]["train_rows"] == config.task.train_size
    assert len(summary["rounds"]) == config.rounds == 3
    for r in summary["rounds"]:
        assert 0.0 <= r["reward_mean"] <= 1.0 and r["updates"] > 0
    saved = json.loads((tmp_path / "runs" / "custom_algorithm" / "summary.json").read_text())
    assert saved["reward_errors"] == saved["reward_timeouts"] == 0  # the reward never failed
