"""Tests for rl/tasks/data.py: a config's train and held-out records, synthetic or local JSONL."""

from __future__ import annotations

import json

import pytest

from configs import base
from rl.models.tokenizer import ByteTokenizer
from rl.tasks.data import DataConfig, data_config_from, load_task
from rl.tasks.synthetic import addition_records, countdown_records
from rl.tasks.templates import render_prompt

TOK = ByteTokenizer()
GSM8K = [{"question": f"What is {a} + 2?", "answer": f"{a} + 2 = {a + 2}\n#### {a + 2}"} for a in range(10)]  # fmt: skip
MATH = [
    {"problem": "Half of 1?", "solution": "$\\boxed{\\frac{1}{2}}$"},
    {"problem": "Root of 2?", "solution": "$\\boxed{\\sqrt{2}}$"},
    {"problem": "Pair?", "solution": "$\\boxed{(1, 2)}$"},
    {"problem": "Seven?", "solution": "$\\boxed{7}$"},
]


def write(path, rows, bad_at: int | None = None) -> str:
    lines = [json.dumps(r) for r in rows]
    if bad_at is not None:
        lines.insert(bad_at - 1, "{not json")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


def test_synthetic_task_is_the_generators_records():
    data = load_task(
        DataConfig(task="addition", options={"digits": 2}, train_size=50, heldout_size=7), TOK
    )
    assert data.train == addition_records(50, digits=2, seed=0, split="train")
    assert data.heldout == addition_records(7, digits=2, seed=0, split="heldout")
    assert data.counts["train_rows"] == 50 and data.counts["heldout_rows"] == 7


def test_base_config_maps_to_the_data_config():
    cfg = data_config_from(base.get_config())
    assert (cfg.task, cfg.train_size, cfg.heldout_size, cfg.template) == (
        "addition",
        20000,
        200,
        "plain",
    )
    assert cfg.prompt_kwargs == {"template": "plain", "system": None, "instruction": ""}


def test_jsonl_heldout_slice_is_seeded_disjoint_and_renumbered(tmp_path):
    path = write(tmp_path / "train.jsonl", GSM8K, bad_at=4)
    cfg = DataConfig(task="gsm8k", train_path=path, heldout_size=3, seed=1)
    a, b = load_task(cfg, TOK), load_task(cfg, TOK)
    assert a == b  # the same seed holds out the same rows
    assert [r["id"] for r in a.train] == list(range(7)) and [r["id"] for r in a.heldout] == [
        0,
        1,
        2,
    ]
    questions = {r["question"] for r in a.train}
    assert not questions & {r["question"] for r in a.heldout}
    assert len(questions | {r["question"] for r in a.heldout}) == 10
    other = load_task(DataConfig(task="gsm8k", train_path=path, heldout_size=3, seed=2), TOK)
    assert other.heldout != a.heldout
    assert a.counts == {"train_rows": 7, "heldout_rows": 3, "skipped_malformed": 1,
                        "too_long": 0, "non_numeric": 0}  # fmt: skip


def test_jsonl_heldout_file_first_rows_or_all(tmp_path):
    train = write(tmp_path / "train.jsonl", GSM8K[:6])
    test = write(tmp_path / "test.jsonl", GSM8K[6:])
    cfg = DataConfig(task="gsm8k", train_path=train, heldout_path=test, heldout_size=2)
    data = load_task(cfg, TOK)
    assert len(data.train) == 6 and [r["answer"] for r in data.heldout] == ["8", "9"]
    cfg = DataConfig(task="gsm8k", train_path=train, heldout_path=test, heldout_size=0)
    assert len(load_task(cfg, TOK).heldout) == 4


def test_jsonl_drops_long_prompts_and_non_numeric_answers(tmp_path):
    path = write(tmp_path / "math.jsonl", MATH)
    cfg = DataConfig(
        task="math",
        train_path=path,
        heldout_path=path,
        numeric_answers_only=True,
        template="chat",
        instruction="Box it. ",
    )
    limit = len(render_prompt(MATH[0] | {"question": "Half of 1?"}, TOK, **cfg.prompt_kwargs))
    data = load_task(cfg, TOK, max_prompt_tokens=limit)  # "Seven?" fits, "Half of 1?" just fits
    assert [r["answer"] for r in data.train] == ["\\frac{1}{2}", "7"]
    assert data.counts["non_numeric"] == 4 and data.counts["too_long"] == 0  # both files
    data = load_task(cfg, TOK, max_prompt_tokens=limit - 1)
    assert [r["answer"] for r in data.train] == ["7"] and data.counts["too_long"] == 2


def test_jsonl_errors_name_the_file_and_line(tmp_path):
    path = write(tmp_path / "train.jsonl", GSM8K, bad_at=4)
    with pytest.raises(ValueError, match=f"{tmp_path / 'train.jsonl'}:4 is malformed"):
        load_task(DataConfig(task="gsm8k", train_path=path, on_error="raise"), TOK)
    with pytest.raises(ValueError, match="no usable rows"):
        load_task(DataConfig(task="gsm8k", train_path=path), TOK, max_prompt_tokens=3)
    with pytest.raises(ValueError, match="would hold out all 10 usable rows"):
        load_task(DataConfig(task="gsm8k", train_path=path, heldout_size=10), TOK)
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        load_task(DataConfig(task="gsm8k", train_path=str(tmp_path / "missing.jsonl")), TOK)


def test_config_errors():
    with pytest.raises(ValueError, match="config.data.train_path is empty"):
        DataConfig(task="gsm8k")
    with pytest.raises(
        ValueError, match=r"config.task.name='mmlu'; expected one of \['addition', "
    ):
        DataConfig(task="mmlu")
    with pytest.raises(ValueError, match="heldout_size=0"):
        DataConfig(task="gsm8k", train_path="x.jsonl", heldout_size=0)
    with pytest.raises(ValueError, match="needs template='chat'"):
        DataConfig(system="Be brief.")
    config = base.get_config()
    config.data.train_file = "x.jsonl"
    with pytest.raises(ValueError, match=r"config.data has unknown fields \['train_file'\]"):
        data_config_from(config)


def test_countdown_options_reach_the_generator():
    config = base.get_config()
    config.task.name, config.task.train_size, config.eval.heldout_size = "countdown", 30, 5
    config.task.count, config.task.max_number, config.task.max_target = 3, 20, 100
    config.task.style = "compact"
    data = load_task(data_config_from(config), TOK)
    kw = dict(count=3, max_number=20, max_target=100, seed=0, style="compact")
    assert data.train == countdown_records(30, **kw)
    assert data.heldout == countdown_records(5, split="heldout", **kw)
    with pytest.raises(ValueError, match=r"countdown needs count >= 2.*received count=1"):
        DataConfig(task="countdown", options={"count": 1})
    with pytest.raises(ValueError, match=r"config.task.style='long'; expected one of"):
        DataConfig(task="countdown", options={"style": "long"})
    with pytest.raises(ValueError, match=r"\['digits'\] are not options of task 'countdown'"):
        DataConfig(task="countdown", options={"digits": 2})


def test_a_registered_task_needs_no_edit_to_the_library(monkeypatch):
    """A generated task with its own option and meta field: loaded, checked, its meta copied."""
    from rl.tasks.pipeline import prompt_dataset
    from rl.tasks.registry import TASKS, register_task

    monkeypatch.delitem(TASKS, "parity", raising=False)

    @register_task("parity", options={"bits": 4}, meta_fields=("answer", "ones"))
    def parity(split, n, *, seed, bits):
        rows = [[(seed + i * 7 + j * 3 + (split == "heldout")) % 2 for j in range(bits)]
                for i in range(n)]  # fmt: skip
        return [{"question": "".join(map(str, r)) + ":", "answer": str(sum(r) % 2),
                 "ones": sum(r), "unused": "x"} for r in rows]  # fmt: skip

    config = base.get_config()
    config.task.name, config.task.train_size, config.eval.heldout_size = "parity", 6, 2
    with config.unlocked():
        config.task.bits = 5
    cfg = data_config_from(config)
    assert cfg.options == {"bits": 5} and cfg.meta_fields == ("answer", "ones")
    data = load_task(cfg, TOK)
    assert [len(r["question"]) for r in data.train] == [6] * 6 and len(data.heldout) == 2
    assert [r["id"] for r in data.train] == list(range(6))
    prompt = next(iter(prompt_dataset(data.train, TOK, shuffle=False, meta_fields=cfg.meta_fields)))
    assert prompt.meta == {
        "id": 0,
        "answer": data.train[0]["answer"],
        "ones": data.train[0]["ones"],
    }
    assert DataConfig(task="parity").options == {"bits": 4}  # the registered default

    @register_task("broken", options={})
    def broken(split, n, *, seed):
        return [{"prompt": "no question"}] * n

    monkeypatch.setitem(TASKS, "broken", TASKS.pop("broken"))
    with pytest.raises(ValueError, match=r"Task 'broken', train split, record 0: expected a mapping "
                       r"with a string 'question'; received \['prompt'\]"):  # fmt: skip
        load_task(DataConfig(task="broken"), TOK)
    with pytest.raises(ValueError, match="already registered"):
        register_task("parity")(parity)
