"""Local JSONL loaders for GSM8K- and MATH-style datasets, offline.

Each loader reads one JSON object per line and returns `LoadedRecords`, a list of records
`{"id", "question", "answer", "solution", ...}` with ids 0..n-1 in file order. Blank lines are
ignored. A malformed row (not UTF-8, not JSON, nested too deeply for the parser, not an object, a
missing or non-string field, text with a lone surrogate escape such as "\ud83d" that no tokenizer
can encode, no final answer) raises ValueError naming `file:line` with `on_error="raise"`; with
`on_error="skip"` it is dropped, counted in `.skipped`, its (line, reason) kept in `.errors` (the
first `MAX_REPORTED`), and one absl warning names the file and the count.
"""

from __future__ import annotations

import json
import pathlib
import re
from collections.abc import Callable, Mapping
from typing import Any, Literal

from absl import logging

from rl.rewards.verifiers import extract_boxed

OnError = Literal["skip", "raise"]
MAX_REPORTED = 5  # (line, reason) pairs kept in LoadedRecords.errors
MAX_DEPTH = 100  # JSON nesting a row may have (rows are flat objects; the parser recurses)
_JSON_TOKEN = re.compile(r'"(?:\\.|[^"\\])*"|[\[\]{}]')  # a string literal, or a bracket
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


class LoadedRecords(list):
    """The records of a file (a plain list of dicts) plus what was skipped.

    Attributes:
        path: The file read.
        skipped: How many malformed rows were skipped.
        errors: (1-based line number, reason) of the first `MAX_REPORTED` skipped rows.
        lines: The 1-based line number of each record, in order (for reporting `file:line`).
    """

    def __init__(
        self,
        records: list[dict[str, Any]],
        *,
        path: str,
        skipped: int,
        errors: list,
        lines: list[int] | None = None,
    ):
        super().__init__(records)
        self.path = path
        self.skipped = skipped
        self.errors: list[tuple[int, str]] = errors
        self.lines: list[int] = list(lines) if lines is not None else []


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
        got = "missing" if key not in row else f"of type {type(value).__name__}"
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


def _parse_gsm8k(row: Mapping[str, Any]) -> dict[str, Any]:
    question, solution = _field(row, "question"), _field(row, "answer")
    return {"question": question, "answer": gsm8k_answer(solution), "solution": solution}


def _parse_math(row: Mapping[str, Any]) -> dict[str, Any]:
    question, solution = _field(row, "problem"), _field(row, "solution")
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
) -> LoadedRecords:
    """Reads `path` line by line, parsing each non-blank line's JSON object with `parse`."""
    if on_error not in ("skip", "raise"):
        raise ValueError(f"on_error must be 'skip' or 'raise'; received {on_error!r}.")
    file = pathlib.Path(path)
    if file.is_dir():
        raise IsADirectoryError(
            f"{what} file {str(file)!r} is a directory; expected a JSONL file (one JSON object "
            "per line)."
        )
    if not file.is_file():
        raise FileNotFoundError(f"{what} file {str(file)!r} not found; expected a JSONL file.")
    records: list[dict[str, Any]] = []
    lines: list[int] = []
    errors: list[tuple[int, str]] = []
    skipped = 0
    with file.open("rb") as f:
        for line_no, raw in enumerate(f, start=1):
            try:
                text = raw.decode("utf-8")
                if not text.strip():
                    continue
                # json.loads recurses per level: [[[[...]]]] a thousand deep raises
                # RecursionError, or with a raised recursion limit overflows the C stack.
                if _too_deep(text):
                    raise ValueError(
                        f"JSON nested too deeply: deeper than {MAX_DEPTH} levels ({len(raw):,} "
                        "bytes); expected an object of strings"
                    )
                try:
                    row = json.loads(text)
                except json.JSONDecodeError as e:
                    raise ValueError(f"not valid JSON ({e})") from None
                except RecursionError:
                    raise ValueError(f"JSON nested too deeply ({len(raw):,} bytes)") from None
                if not isinstance(row, dict):
                    raise ValueError(f"a JSON {type(row).__name__}; expected an object")
                record = parse(row)
            except ValueError as e:  # UnicodeDecodeError included
                reason = f"not UTF-8 ({e})" if isinstance(e, UnicodeDecodeError) else str(e)
                if on_error == "raise":
                    raise ValueError(
                        f"{what} row at {file}:{line_no} is malformed: {reason}."
                    ) from None
                skipped += 1
                if len(errors) < MAX_REPORTED:
                    errors.append((line_no, reason))
                continue
            records.append({"id": len(records), **record})
            lines.append(line_no)
    if skipped:
        logging.warning(
            "%s file %s: skipped %d malformed rows (kept %d); first (line, reason): %s",
            what,
            file,
            skipped,
            len(records),
            errors,
        )
    return LoadedRecords(records, path=str(file), skipped=skipped, errors=errors, lines=lines)


def load_gsm8k(path: str | pathlib.Path, *, on_error: OnError = "skip") -> LoadedRecords:
    """Loads GSM8K-style rows {"question", "answer": "...#### <n>"}.

    Args:
        path: The JSONL file.
        on_error: "skip" (count and log malformed rows) or "raise" (ValueError at the first).

    Returns:
        Records {"id", "question", "answer": the number after "####" (commas removed),
        "solution": the full answer text}, with `.skipped` and `.errors`.
    """
    return _load(path, _parse_gsm8k, on_error, "GSM8K")


def load_math(path: str | pathlib.Path, *, on_error: OnError = "skip") -> LoadedRecords:
    """Loads MATH-style rows {"problem", "solution": "... \\boxed{<answer>} ..."}.

    Args:
        path: The JSONL file.
        on_error: "skip" (count and log malformed rows) or "raise" (ValueError at the first).

    Returns:
        Records {"id", "question": the problem, "answer": the last boxed content, "solution",
        and "level", "type", "subject" when the row has them}, with `.skipped` and `.errors`.
    """
    return _load(path, _parse_math, on_error, "MATH")
