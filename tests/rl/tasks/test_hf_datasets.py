"""Tests for rl/tasks/hf_datasets.py: GSM8K/MATH rows from save_to_disk dirs, parquet and arrow.

Each format must give the records that the same rows give as JSONL, pass them through the same
record check (malformed rows skipped and counted as `path:row n`, or raised naming the row), map
fields by config.data.question_field / answer_field, and name what exists when a split or a
column is missing. Nothing may touch the network.
"""

from __future__ import annotations

import json
import socket

import datasets  # in setup.py's [test] extras: if missing or broken, fail (never skip)
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from configs import base
from rl.models.tokenizer import ByteTokenizer
from rl.tasks import data, hf_datasets, jsonl
from rl.tasks.data import DataConfig, data_config_from, load_task
from rl.tasks.jsonl import load_gsm8k, load_math

TOK = ByteTokenizer()
GSM8K = [
    {"question": f"What is {a} + 2?", "answer": f"{a} + 2 = {a + 2}\n#### {a + 2:,}"}
    for a in (1, 40, 1998, 7)
]
MATH = [
    {"problem": "Half of 1?", "solution": "$\\boxed{\\frac{1}{2}}$", "level": "Level 1", "n": 3},
    {"problem": "Seven?", "solution": "so $\\boxed{7}$", "level": "Level 2", "n": 4},
]
BAD = [  # GSM8K rows every format can hold (string columns, some null), and a fragment of why
    ({"question": None, "answer": "#### 1"}, "field 'question' is null"),
    ({"question": "Q?", "answer": "no final answer"}, "no '####'"),
    ({"question": "Q?", "answer": None}, "field 'answer' is null"),
]
FORMATS = ("save_to_disk", "dataset_dict", "parquet", "arrow_file", "arrow_stream")


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    """Any connection attempt fails the test: the loaders read local files only."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"network access attempted: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


@pytest.fixture
def warnings(monkeypatch):
    calls = []
    monkeypatch.setattr(jsonl.logging, "warning", lambda *args: calls.append(args))
    return calls


def write(tmp_path, fmt: str, rows: list[dict], name: str = "train") -> str:
    """`rows` written in `fmt` under tmp_path; the path a config would give."""
    if fmt == "jsonl":
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        return str(path)
    if fmt == "save_to_disk":
        path = tmp_path / name
        datasets.Dataset.from_list(rows).save_to_disk(str(path))
        return str(path)
    if fmt == "dataset_dict":  # rows in "train", a different "test" split beside them
        path = tmp_path / f"{name}_dict"
        test = datasets.Dataset.from_list(rows[:1])
        datasets.DatasetDict(train=datasets.Dataset.from_list(rows), test=test).save_to_disk(
            str(path)
        )
        return str(path)
    table = pa.Table.from_pylist(rows)
    if fmt == "parquet":
        path = tmp_path / f"{name}.parquet"
        pq.write_table(table, path)
        return str(path)
    path = tmp_path / f"{name}.arrow"
    new = pa.ipc.new_file if fmt == "arrow_file" else pa.ipc.new_stream
    with pa.OSFile(str(path), "wb") as sink, new(sink, table.schema) as writer:
        for batch in table.to_batches(max_chunksize=2):  # several batches: rows numbered across
            writer.write_batch(batch)
    return str(path)


@pytest.mark.parametrize("fmt", FORMATS)
def test_records_equal_those_of_the_same_rows_as_jsonl(tmp_path, fmt, warnings):
    expected = load_gsm8k(write(tmp_path, "jsonl", GSM8K), on_error="raise")
    path = write(tmp_path, fmt, GSM8K)
    assert hf_datasets.format_of(path) == {"parquet": "parquet", "arrow_file": "arrow",
                                           "arrow_stream": "arrow"}.get(fmt, "datasets")  # fmt: skip
    records = load_gsm8k(path, on_error="raise")
    assert records == expected and [r["answer"] for r in records] == ["3", "42", "2000", "9"]
    assert records.lines == [0, 1, 2, 3] and records.unit == "row" and records.skipped == 0
    suffix = "/train" if fmt == "dataset_dict" else ""  # a DatasetDict's rows: its split's dir
    assert records.path == path + suffix and not warnings


def test_math_rows_keep_their_metadata_and_types(tmp_path):
    expected = load_math(write(tmp_path, "jsonl", MATH), on_error="raise")
    for fmt in ("parquet", "save_to_disk"):
        records = load_math(write(tmp_path, fmt, MATH), on_error="raise")
        assert records == expected
        assert records[0] == {"id": 0, "question": "Half of 1?", "answer": "\\frac{1}{2}",
                              "solution": MATH[0]["solution"], "level": "Level 1"}  # fmt: skip


@pytest.mark.parametrize("fmt", ("jsonl", "parquet", "save_to_disk"))
def test_field_mapping_names_the_question_and_answer_columns(tmp_path, fmt):
    rows = [{"prompt": r["question"], "response": r["answer"], "question": "decoy"} for r in GSM8K]
    path = write(tmp_path, fmt, rows)
    records = load_gsm8k(path, question_field="prompt", answer_field="response")
    assert [r["question"] for r in records] == [r["question"] for r in GSM8K]
    assert [r["solution"] for r in records] == [r["answer"] for r in GSM8K]
    math_rows = [{"q": r["problem"], "a": r["solution"]} for r in MATH]
    math = load_math(write(tmp_path, fmt, math_rows, "math"), question_field="q", answer_field="a")
    assert [r["answer"] for r in math] == ["\\frac{1}{2}", "7"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_malformed_rows_are_skipped_and_counted_by_row(tmp_path, fmt, warnings):
    rows = [GSM8K[0], *(r for r, _ in BAD), GSM8K[1]]
    path = write(tmp_path, fmt, rows)
    records = load_gsm8k(path)
    assert [r["answer"] for r in records] == ["3", "42"] and [r["id"] for r in records] == [0, 1]
    assert records.lines == [0, 4] and records.skipped == len(BAD)
    assert [n for n, _ in records.errors] == [1, 2, 3]  # row indices, from 0
    for (_, reason), (_, fragment) in zip(records.errors, BAD, strict=True):
        assert fragment in reason
    assert len(warnings) == 1
    message = warnings[0][0] % warnings[0][1:]
    assert records.path in message and "skipped 3 malformed rows" in message
    assert "(row, reason)" in message


@pytest.mark.parametrize("fmt", FORMATS)
def test_malformed_row_with_raise_names_the_row(tmp_path, fmt):
    path = write(tmp_path, fmt, [GSM8K[0], GSM8K[1], BAD[1][0]])
    where = path + ("/train" if fmt == "dataset_dict" else "")
    with pytest.raises(ValueError) as e:
        load_gsm8k(path, on_error="raise")
    assert str(e.value).startswith(f"GSM8K row at {where}:row 2 is malformed: no '####'")
    assert "\n" not in str(e.value)


def test_a_column_of_another_type_makes_every_row_malformed(tmp_path):
    rows = [{"question": i, "answer": f"#### {i}"} for i in range(3)]  # an int64 column
    path = write(tmp_path, "parquet", rows)
    records = load_gsm8k(path)
    assert records == [] and records.skipped == 3
    assert "field 'question' is of type int" in records.errors[0][1]


def test_a_missing_split_names_the_splits(tmp_path):
    path = write(tmp_path, "dataset_dict", GSM8K)
    assert [r["answer"] for r in load_gsm8k(path, split="test")] == ["3"]
    with pytest.raises(ValueError, match=r"has no split 'validation'; its splits are "
                       r"\['test', 'train'\]; expected one of them"):  # fmt: skip
        load_gsm8k(path, split="validation")


@pytest.mark.parametrize("fmt", ("parquet", "arrow_stream", "save_to_disk", "dataset_dict"))
def test_a_missing_column_names_the_columns(tmp_path, fmt):
    path = write(tmp_path, fmt, GSM8K)
    with pytest.raises(ValueError) as e:
        load_gsm8k(path, question_field="prompt", on_error="skip")
    message = str(e.value)
    assert "has no column 'prompt'; its columns are ['question', 'answer']" in message
    assert "expected config.data.question_field naming one of them" in message
    with pytest.raises(ValueError, match=r"no column 'problem'.*config\.data\.question_field"):
        load_math(path)  # MATH's default columns are not GSM8K's


def test_unreadable_and_missing_files(tmp_path):
    bogus = tmp_path / "bogus.parquet"
    bogus.write_text("not parquet")
    with pytest.raises(ValueError, match=r"GSM8K file .*bogus\.parquet' is not a readable parquet"):
        load_gsm8k(bogus)
    bogus = tmp_path / "bogus.arrow"
    bogus.write_text("not arrow")
    with pytest.raises(ValueError, match=r"bogus\.arrow' is not a readable arrow file"):
        load_gsm8k(bogus)
    with pytest.raises(FileNotFoundError, match=r"MATH file .*nope\.arrow' not found"):
        load_math(tmp_path / "nope.arrow")
    (tmp_path / "plain").mkdir()
    with pytest.raises(IsADirectoryError, match=r"plain' is a directory; expected a JSONL file.*"
                       r"a \.parquet or \.arrow file, or a directory written by datasets"):  # fmt: skip
        load_gsm8k(tmp_path / "plain")


def test_missing_packages_are_named_with_the_extra(tmp_path, monkeypatch):
    parquet, saved = write(tmp_path, "parquet", GSM8K), write(tmp_path, "save_to_disk", GSM8K)
    install = r'pip install -e "\.\[datasets\]"'
    monkeypatch.setattr(hf_datasets, "_has_datasets", lambda: False)
    assert hf_datasets.missing_dependency(parquet) == ""
    with pytest.raises(ValueError, match=rf"config.data.train_path: reading .* needs datasets: "
                       rf"{install}\.$"):  # fmt: skip
        DataConfig(task="gsm8k", train_path=saved)
    monkeypatch.setattr(hf_datasets, "pa", None)
    with pytest.raises(ImportError, match=rf"^GSM8K reading .*train\.parquet' \(parquet\) needs "
                       rf"pyarrow, which is not installed: {install}\.$"):  # fmt: skip
        load_gsm8k(parquet)
    with pytest.raises(ValueError, match=rf"config.data.heldout_path: .* needs pyarrow.*{install}"):
        DataConfig(task="gsm8k", train_path="t.jsonl", heldout_path=parquet)
    assert DataConfig(task="gsm8k", train_path="t.jsonl").train_path == "t.jsonl"  # JSONL: none


def test_load_task_reads_train_and_heldout_splits_of_one_dataset_dict(tmp_path):
    root = write(tmp_path, "dataset_dict", GSM8K)
    config = base.get_config()
    config.task.name, config.eval.heldout_size = "gsm8k", 0
    config.data.train_path = config.data.heldout_path = root
    got = load_task(data_config_from(config), TOK)
    assert [r["answer"] for r in got.train] == ["3", "42", "2000", "9"]
    assert [r["answer"] for r in got.heldout] == ["3"]  # data.heldout_split: "test"
    config.data.split, config.data.heldout_split = "test", "train"
    got = load_task(data_config_from(config), TOK)
    assert len(got.train) == 1 and len(got.heldout) == 4


def test_load_task_maps_fields_and_reports_dropped_rows_by_row(tmp_path, monkeypatch):
    rows = [{"prompt": r["question"], "response": r["answer"]} for r in GSM8K]
    rows[2]["prompt"] = "x" * 200  # too long a prompt
    rows.insert(1, {"prompt": "Q?", "response": "no final answer"})  # malformed
    path = write(tmp_path, "parquet", rows)
    reports = []
    monkeypatch.setattr(data.logging, "warning", lambda *a: reports.append(a[0] % a[1:]))
    cfg = DataConfig(task="gsm8k", train_path=path, heldout_size=1, question_field="prompt",
                     answer_field="response")  # fmt: skip
    got = load_task(cfg, TOK, max_prompt_tokens=100)
    assert got.counts == {"train_rows": 2, "heldout_rows": 1, "skipped_malformed": 1,
                          "too_long": 1, "non_numeric": 0}  # fmt: skip
    assert any(f"{path}:row 3" in r and "too long" in r for r in reports)
    with pytest.raises(ValueError, match=rf"{path}:row 1 is malformed: no '####'"):
        load_task(DataConfig(task="gsm8k", train_path=path, on_error="raise",
                             question_field="prompt", answer_field="response"), TOK)  # fmt: skip


def test_data_config_checks_the_new_keys():
    with pytest.raises(ValueError, match=r"config.data.split=''; expected a name"):
        DataConfig(task="gsm8k", train_path="t.jsonl", split="")
    with pytest.raises(ValueError, match=r"config.data.question_field=3; expected a name"):
        DataConfig(task="gsm8k", train_path="t.jsonl", question_field=3)
    with pytest.raises(ValueError, match=r"task 'addition' generates its records; expected them"):
        DataConfig(task="addition", question_field="prompt")
    cfg = data_config_from(base.get_config())
    assert (cfg.split, cfg.heldout_split, cfg.question_field, cfg.answer_field) == (
        "train", "test", "", "",
    )  # fmt: skip
