"""Local loaders for GSM8K- and MATH-style datasets, offline: JSONL, parquet, arrow, `datasets`.

Each loader reads the rows of a path and returns `LoadedRecords`, a list of records
`{"id", "question", "answer", "solution", ...}` with ids 0..n-1 in row order. The path's format
is told by the path (rl.tasks.hf_datasets.format_of): a `.parquet` or `.arrow` file or a
`save_to_disk` directory (a DatasetDict's split chosen by `split`) is read as a table of rows
(rl/tasks/hf_datasets.py), anything else as JSONL, one JSON object per line, blank lines ignored.
`question_field` / `answer_field` name the key (JSONL) or column holding the question and the
answer ("": the task's own, e.g. GSM8K's "question" and "answer"); a table without such a column
is an error naming its columns.

Every format's rows pass one check (`_check_rows`). A malformed row (not UTF-8, not JSON, nested
too deeply for the parser, not an object, a missing, null or non-string field, text with a lone
surrogate escape such as "\ud83d" that no tokenizer can encode, no final answer) raises ValueError
naming `file:line` (tables: `path:row n`, from 0) with `on_error="raise"`; with `on_error="skip"`
it is dropped, counted in `.skipped`, its (line or row, reason) kept in `.errors` (the first
`MAX_REPORTED`), and one absl warning names the file and the count.
"""

from __future__ import annotations

import functools
import json
import pathlib
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Literal

from absl import logging

from rl.rewards.verifiers import extract_boxed
from rl.tasks import hf_datasets

OnError = Literal["skip", "raise"]
MAX_REPORTED = 5  # (line or row, reason) pairs kept in LoadedRecords.errors
MAX_DEPTH = 100  # JSON nesting a row may have (rows are flat objects; the parser recurses)
_JSON_TOKEN = re.compile(r'"(?:\\.|[^"\\])*"|[\[\]{}]')  # a string literal, or a bracket
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


class LoadedRecords(list):
    """The records of a file (a plain list of dicts) plus what was skipped.

    Attributes:
        path: The file read (a DatasetDict's: its split's directory).
        skipped: How many malformed rows were skipped.
        errors: (position, reason) of the first `MAX_REPORTED` skipped rows.
        lines: The position of each record, in order: its line (JSONL, from 1) or its row index
            (tables, from 0); `where` names one.
        unit: "line" (JSONL) or "row" (parquet, arrow, `datasets` directories).
    """

    def __init__(
        self,
        records: list[dict[str, Any]],
        *,
        path: str,
        skipped: int,
        errors: list,
        lines: list[int] | None = None,
        unit: str = "line",
    ):
        super().__init__(records)
        self.path = path
        self.skipped = skipped
        self.errors: list[tuple[int, str]] = errors
        self.lines: list[int] = list(lines) if lines is not None else []
        self.unit = unit

    def where(self, position: int) -> str:
        """A row's place for messages: `file:line` (JSONL) or `path:row n` (tables)."""
        return f"{self.path}:{position}" if self.unit == "line" else f"{self.path}:row {position}"


def _too_deep(text: str) -> bool:
    """Whether the JSON in `text` nests deeper than MAX_DEPTH (brackets in strings do not count)."""
    if text.count("[") + text.count("{") <= MAX_DEPTH:
        return False
    depth = 0
    for token in _JSON_TOKEN.finditer(text):
        bracket = token.group()
        if bracket in "[{":
            depth += 1
            if depth > MAX_DEPTH:
                return True
        elif bracket in "]}":
            depth -= 1
    return False


def _field(row: Mapping[str, Any], key: str) -> str:
    value = row.get(key)
    if not isinstance(value, str):
        got = f"of type {type(value).__name__}"
        if value is None:
            got = "missing" if key not in row else "null"
        keys = [k[:40] for k in sorted(row)[:10]]
        raise ValueError(f"field {key!r} is {got}; expected a string (row keys: {keys})")
    return _text(value, key)


def _text(value: str, key: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:  # JSON allows "\ud83d" alone; no text encoding does
        raise ValueError(
            f"field {key!r} holds a lone surrogate {value[e.start]!r} at character {e.start}; "
            "expected valid Unicode text"
        ) from None
    return value


def gsm8k_answer(solution: str) -> str:
    """The number after the last "####" of a GSM8K solution, commas removed.

    Args:
        solution: The full answer text, e.g. "...\\n#### 1,200".

    Returns:
        The number as text, e.g. "1200".
    """
    if "####" not in solution:
        raise ValueError(f"no '####' in the answer (ends with {solution[-40:]!r})")
    tail = solution.rpartition("####")[2].strip()
    number = tail.replace(",", "").removeprefix("$")
    if not _NUMBER.fullmatch(number):
        raise ValueError(f"expected a number after '####'; found {tail!r}")
    return number


def _parse_gsm8k(
    row: Mapping[str, Any], *, question_field: str = "question", answer_field: str = "answer"
) -> dict[str, Any]:
    question, solution = _field(row, question_field), _field(row, answer_field)
    return {"question": question, "answer": gsm8k_answer(solution), "solution": solution}


def _parse_math(
    row: Mapping[str, Any], *, question_field: str = "problem", answer_field: str = "solution"
) -> dict[str, Any]:
    question, solution = _field(row, question_field), _field(row, answer_field)
    answer = extract_boxed(solution)
    if answer is None:
        raise ValueError(f"no complete \\boxed{{...}} in the solution (ends {solution[-40:]!r})")
    extra = {k: row[k] for k in ("level", "type", "subject") if isinstance(row.get(k), str | int)}
    for k, v in extra.items():
        if isinstance(v, str):
            _text(v, k)
    return {"question": question, "answer": answer, "solution": solution, **extra}


def _load(
    path: str | pathlib.Path,
    parse: Callable[[Mapping[str, Any]], dict[str, Any]],
    on_error: OnError,
    what: str,
    *,
    split: str = "train",
    columns: Mapping[str, str] | None = None,
) -> LoadedRecords:
    """The records of `path`, read by its format (rl.tasks.hf_datasets.format_of)."""
    if on_error not in ("skip", "raise"):
        raise ValueError(f"on_error must be 'skip' or 'raise'; received {on_error!r}.")
    file = pathlib.Path(path)
    fmt = hf_datasets.format_of(file)
    if fmt == "directory":
        raise IsADirectoryError(
            f"{what} file {str(file)!r} is a directory; expected a JSONL file (one JSON object "
            "per line), a .parquet or .arrow file, or a directory written by datasets' "
            "save_to_disk (holding state.json or dataset_dict.json)."
        )
    if fmt != "jsonl":
        table = hf_datasets.open_rows(file, split=split, what=what)
        for role, column in (columns or {}).items():  # every row would lack it: not a row's fault
            if column not in table.columns:
                raise ValueError(
                    f"{what} data {table.path!r} has no column {column!r}; its columns are "
                    f"{list(table.columns)}; expected config.data.{role} naming one of them."
                )
        out = LoadedRecords([], path=table.path, skipped=0, errors=[], unit="row")
        return _check_rows(out, table, lambda row: row, parse, on_error, what)
    if not file.is_file():
        raise FileNotFoundError(f"{what} file {str(file)!r} not found; expected a JSONL file.")
    out = LoadedRecords([], path=str(file), skipped=0, errors=[], unit="line")
    return _check_rows(out, _lines(file), _json_object, parse, on_error, what)


def _lines(file: pathlib.Path) -> Iterator[tuple[int, bytes]]:
    with file.open("rb") as f:
        yield from enumerate(f, start=1)


def _json_object(raw: bytes) -> dict[str, Any] | None:
    """One JSONL line's object; None for a blank line."""
    text = raw.decode("utf-8")
    if not text.strip():
        return None
    # json.loads recurses per level: [[[[...]]]] a thousand deep raises RecursionError, or with a
    # raised recursion limit overflows the C stack.
    if _too_deep(text):
        raise ValueError(
            f"JSON nested too deeply: deeper than {MAX_DEPTH} levels ({len(raw):,} bytes); "
            "expected an object of strings"
        )
    try:
        row = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON ({e})") from None
    except RecursionError:
        raise ValueError(f"JSON nested too deeply ({len(raw):,} bytes)") from None
    if not isinstance(row, dict):
        raise ValueError(f"a JSON {type(row).__name__}; expected an object")
    return row


def _check_rows(
    out: LoadedRecords,
    rows: Iterable[tuple[int, Any]],
    decode: Callable[[Any], Mapping[str, Any] | None],
    parse: Callable[[Mapping[str, Any]], dict[str, Any]],
    on_error: OnError,
    what: str,
) -> LoadedRecords:
    """The one record check of every format: each (position, raw row) decoded (None: no row) and
    parsed into `out`; a malformed row is skipped, counted and named in `out`, or raised."""
    for n, raw in rows:
        try:
            row = decode(raw)
            if row is None:
                continue
            record = parse(row)
        except ValueError as e:  # UnicodeDecodeError included
            reason = f"not UTF-8 ({e})" if isinstance(e, UnicodeDecodeError) else str(e)
            if on_error == "raise":
                raise ValueError(f"{what} row at {out.where(n)} is malformed: {reason}.") from None
            out.skipped += 1
            if len(out.errors) < MAX_REPORTED:
                out.errors.append((n, reason))
            continue
        out.append({"id": len(out), **record})
        out.lines.append(n)
    if out.skipped:
        logging.warning(
            "%s file %s: skipped %d malformed rows (kept %d); first (%s, reason): %s",
            what,
            out.path,
            out.skipped,
            len(out),
            out.unit,
            out.errors,
        )
    return out


def load_gsm8k(
    path: str | pathlib.Path,
    *,
    on_error: OnError = "skip",
    split: str = "train",
    question_field: str = "",
    answer_field: str = "",
) -> LoadedRecords:
    """Loads GSM8K-style rows {"question", "answer": "...#### <n>"}.

    Args:
        path: A JSONL, .parquet or .arrow file, or a `save_to_disk` directory.
        on_error: "skip" (count and log malformed rows) or "raise" (ValueError at the first).
        split: The split of a DatasetDict directory; other formats ignore it.
        question_field: The key or column of the question; "": "question".
        answer_field: The key or column of the answer text; "": "answer".

    Returns:
        Records {"id", "question", "answer": the number after "####" (commas removed),
        "solution": the full answer text}, with `.skipped` and `.errors`.
    """
    columns = _columns(question_field or "question", answer_field or "answer")
    parse = functools.partial(_parse_gsm8k, **columns)
    return _load(path, parse, on_error, "GSM8K", split=split, columns=columns)


def load_math(
    path: str | pathlib.Path,
    *,
    on_error: OnError = "skip",
    split: str = "train",
    question_field: str = "",
    answer_field: str = "",
) -> LoadedRecords:
    """Loads MATH-style rows {"problem", "solution": "... \\boxed{<answer>} ..."}.

    Args:
        path: A JSONL, .parquet or .arrow file, or a `save_to_disk` directory.
        on_error: "skip" (count and log malformed rows) or "raise" (ValueError at the first).
        split: The split of a DatasetDict directory; other formats ignore it.
        question_field: The key or column of the problem; "": "problem".
        answer_field: The key or column of the solution (with its \\boxed answer); "": "solution".

    Returns:
        Records {"id", "question": the problem, "answer": the last boxed content, "solution",
        and "level", "type", "subject" when the row has them}, with `.skipped` and `.errors`.
    """
    columns = _columns(question_field or "problem", answer_field or "solution")
    parse = functools.partial(_parse_math, **columns)
    return _load(path, parse, on_error, "MATH", split=split, columns=columns)


def _columns(question: str, answer: str) -> dict[str, str]:
    return {"question_field": question, "answer_field": answer}
