"""Tests for rl/tasks/jsonl.py: GSM8K and MATH loaders on good and malformed local files."""

from __future__ import annotations

import json

import pytest

from rl.tasks import jsonl
from rl.tasks.jsonl import extract_boxed, gsm8k_answer, load_gsm8k, load_math

GSM8K_GOOD = [
    {"question": "Tom has 3 apples and buys 2. How many?", "answer": "3 + 2 = <<3+2=5>>5\n#### 5"},
    {"question": "A farm sells 1,200 eggs.", "answer": "It sells 1,200.\n#### 1,200"},
    {"question": "Debt?", "answer": "She owes it.\n#### -7"},
]
GSM8K_BAD_LINES = [  # (line text, a fragment of the reason)
    ("{not json", "not valid JSON"),
    (json.dumps({"question": "Q?"}), "field 'answer' is missing"),
    (json.dumps({"question": "Q?", "answer": "no final answer"}), "no '####'"),
    (json.dumps({"question": "Q?", "answer": "#### about five"}), "expected a number"),
    (json.dumps(["question", "answer"]), "a JSON list; expected an object"),
    (json.dumps({"question": 3, "answer": "#### 3"}), "field 'question' is of type int"),
]


def write_lines(path, lines: list[str]) -> str:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return str(path)


@pytest.fixture
def warnings(monkeypatch):
    calls = []
    monkeypatch.setattr(jsonl.logging, "warning", lambda *args: calls.append(args))
    return calls


def test_gsm8k_good_rows(tmp_path, warnings):
    path = write_lines(tmp_path / "gsm8k.jsonl", [json.dumps(r) for r in GSM8K_GOOD] + [""])
    records = load_gsm8k(path, on_error="raise")
    assert records == [
        {"id": 0, "question": GSM8K_GOOD[0]["question"], "answer": "5",
         "solution": GSM8K_GOOD[0]["answer"]},
        {"id": 1, "question": GSM8K_GOOD[1]["question"], "answer": "1200",
         "solution": GSM8K_GOOD[1]["answer"]},
        {"id": 2, "question": GSM8K_GOOD[2]["question"], "answer": "-7",
         "solution": GSM8K_GOOD[2]["answer"]},
    ]  # fmt: skip
    assert records.skipped == 0 and records.errors == [] and records.path == path
    assert not warnings


def test_gsm8k_skips_and_counts_malformed_rows(tmp_path, warnings):
    good = [json.dumps(r) for r in GSM8K_GOOD]
    lines = [good[0], *(line for line, _ in GSM8K_BAD_LINES), "", good[1], good[2]]
    path = write_lines(tmp_path / "mixed.jsonl", lines)
    records = load_gsm8k(path)
    assert [r["answer"] for r in records] == ["5", "1200", "-7"]
    assert [r["id"] for r in records] == [0, 1, 2]
    assert records.skipped == len(GSM8K_BAD_LINES)
    assert [line for line, _ in records.errors] == [2, 3, 4, 5, 6]  # first MAX_REPORTED, 1-based
    for (_, reason), (_, fragment) in zip(records.errors, GSM8K_BAD_LINES, strict=False):
        assert fragment in reason
    assert len(warnings) == 1
    message = warnings[0][0] % warnings[0][1:]
    assert path in message and f"skipped {len(GSM8K_BAD_LINES)} malformed rows" in message


@pytest.mark.parametrize("k", range(len(GSM8K_BAD_LINES)))
def test_gsm8k_raise_names_file_and_line(tmp_path, k):
    bad, fragment = GSM8K_BAD_LINES[k]
    path = write_lines(tmp_path / "bad.jsonl", [json.dumps(GSM8K_GOOD[0]), "", bad])
    with pytest.raises(ValueError, match=r"GSM8K row at .*bad\.jsonl:3 is malformed") as e:
        load_gsm8k(path, on_error="raise")
    assert fragment in str(e.value)


def test_invalid_utf8_is_a_malformed_row(tmp_path, warnings):
    path = tmp_path / "bytes.jsonl"
    path.write_bytes(json.dumps(GSM8K_GOOD[0]).encode() + b"\n\xff\xfe{}\n")
    records = load_gsm8k(path)
    assert len(records) == 1 and records.skipped == 1 and "not UTF-8" in records.errors[0][1]
    with pytest.raises(ValueError, match=r"bytes\.jsonl:2 is malformed: not UTF-8"):
        load_gsm8k(path, on_error="raise")


def test_missing_file_and_bad_on_error(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(FileNotFoundError, match=r"nope\.jsonl"):
        load_gsm8k(missing)
    with pytest.raises(FileNotFoundError, match=r"MATH file .*nope\.jsonl"):
        load_math(missing)
    path = write_lines(tmp_path / "ok.jsonl", [json.dumps(GSM8K_GOOD[0])])
    with pytest.raises(ValueError, match=r"on_error must be 'skip' or 'raise'; received 'ignore'"):
        load_gsm8k(path, on_error="ignore")


@pytest.mark.parametrize(
    "text, expected",
    [
        ("so $x = \\boxed{5}$", "5"),
        ("$\\boxed{\\frac{1}{2}}$", "\\frac{1}{2}"),
        ("first \\boxed{1}, finally \\boxed{\\sqrt{\\{a\\}}}", "\\sqrt{\\{a\\}}"),
        ("\\fbox{x+1}", "x+1"),
        ("\\boxed{}", ""),
        ("no box", None),
        ("\\boxed{\\frac{1}{2}", None),  # unbalanced
    ],
)
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


def test_gsm8k_answer():
    assert gsm8k_answer("a\n#### 3.5") == "3.5"
    assert gsm8k_answer("#### 1 #### $2,000 ") == "2000"
    with pytest.raises(ValueError, match="no '####'"):
        gsm8k_answer("42")


def test_math_rows(tmp_path, warnings):
    rows = [
        {"problem": "What is 1/2 + 0?", "solution": "It is $\\boxed{\\frac{1}{2}}$.",
         "level": "Level 1", "type": "Algebra"},
        {"problem": "No box.", "solution": "The answer is 3."},
        {"problem": "Unbalanced", "solution": "\\boxed{\\frac{1}{2}"},
        {"solution": "\\boxed{1}"},
        {"problem": "Nested?", "solution": "\\boxed{1} then \\boxed{\\{x \\mid x > {0}\\}}"},
    ]  # fmt: skip
    path = write_lines(tmp_path / "math.jsonl", [json.dumps(r) for r in rows])
    records = load_math(path)
    assert records == [
        {"id": 0, "question": rows[0]["problem"], "answer": "\\frac{1}{2}",
         "solution": rows[0]["solution"], "level": "Level 1", "type": "Algebra"},
        {"id": 1, "question": "Nested?", "answer": "\\{x \\mid x > {0}\\}",
         "solution": rows[4]["solution"]},
    ]  # fmt: skip
    assert records.skipped == 3 and [line for line, _ in records.errors] == [2, 3, 4]
    assert "no complete \\boxed{...}" in records.errors[0][1]
    assert "field 'problem' is missing" in records.errors[2][1]
    assert len(warnings) == 1 and "MATH" in warnings[0][1]
    with pytest.raises(ValueError, match=r"MATH row at .*math\.jsonl:2 is malformed: no complete"):
        load_math(path, on_error="raise")


HOSTILE_LINES = [  # (line text, a fragment of the reason): rows that used to crash the skip path
    ("[" * 1000 + "]" * 1000, "nested too deeply"),  # 2 KB at depth 1000: RecursionError
    ('{"question": ' + "[" * 500_000 + "]" * 500_000 + "}", "nested too deeply"),  # a 1 MB row
    ('{"question": "\\ud83d", "answer": "#### 1"}', "lone surrogate '\\ud83d' at character 0"),
    ('{"question": "Q?", "answer": "x\\udc00\\n#### 1"}', "field 'answer' holds a lone surrogate"),
]


@pytest.mark.parametrize("recursion_limit", [None, 100_000])
def test_hostile_rows_are_skipped_and_counted(tmp_path, warnings, recursion_limit):
    import sys

    good = json.dumps(GSM8K_GOOD[0])
    path = write_lines(tmp_path / "hostile.jsonl", [good, *(t for t, _ in HOSTILE_LINES), good])
    default = sys.getrecursionlimit()
    try:  # some libraries raise the limit: then the parser would not stop a deep row by itself
        sys.setrecursionlimit(recursion_limit or default)
        records = load_gsm8k(path)
    finally:
        sys.setrecursionlimit(default)
    assert len(records) == 2 and records.lines == [1, 6]
    assert records.skipped == len(HOSTILE_LINES)
    assert [line for line, _ in records.errors] == [2, 3, 4, 5]
    for (_, reason), (_, fragment) in zip(records.errors, HOSTILE_LINES, strict=True):
        assert fragment in reason
    for record in records:  # what was kept can be encoded, e.g. by a tokenizer
        record["question"].encode("utf-8")
    message = warnings[0][0] % warnings[0][1:]
    assert "skipped 4 malformed rows" in message


@pytest.mark.parametrize("k", range(len(HOSTILE_LINES)))
def test_hostile_row_with_raise_is_one_line_naming_file_and_line(tmp_path, k):
    text, fragment = HOSTILE_LINES[k]
    path = write_lines(tmp_path / "bad.jsonl", [json.dumps(GSM8K_GOOD[0]), text])
    with pytest.raises(ValueError, match=r"GSM8K row at .*bad\.jsonl:2 is malformed") as e:
        load_gsm8k(path, on_error="raise")
    assert fragment in str(e.value) and "\n" not in str(e.value) and len(str(e.value)) < 400


def test_math_metadata_with_a_lone_surrogate_is_malformed(tmp_path, warnings):
    row = '{"problem": "P", "solution": "\\\\boxed{1}", "type": "Alg\\ud800"}'
    records = load_math(write_lines(tmp_path / "m.jsonl", [row]))
    assert records == [] and records.skipped == 1 and "field 'type'" in records.errors[0][1]


def test_a_directory_given_as_the_data_file_is_named_as_one(tmp_path):
    with pytest.raises(IsADirectoryError, match=r"GSM8K file .* is a directory; expected a JSONL"):
        load_gsm8k(tmp_path)
