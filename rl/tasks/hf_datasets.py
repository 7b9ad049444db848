"""Rows of local Hugging Face `datasets` data, read offline: which format a path is, and its rows.

A file task's `config.data.train_path` / `heldout_path` is read by its format, told by the path:

- a directory written by `datasets.Dataset.save_to_disk` (it holds `state.json`), or by
  `DatasetDict.save_to_disk` (`dataset_dict.json`; `split` picks the split, whose rows are
  reported as those of its own directory, `<path>/<split>`): read with `datasets.load_from_disk`;
- a `.parquet` file: read with pyarrow (`Dataset.to_parquet`, the Hub's parquet files);
- a `.arrow` file, Arrow IPC file or stream format (a `save_to_disk` shard, `datasets`' cache
  files, `pyarrow.ipc` / feather v2 output): read with pyarrow;
- anything else: JSONL (rl/tasks/jsonl.py), as before these formats existed.

Nothing here touches the network: `load_from_disk` of a local directory and pyarrow read local
files only. pyarrow and `datasets` are optional (`pip install -e ".[datasets]"`); `datasets` is
imported only to read a `save_to_disk` directory, since importing it takes about a second that
JSONL, parquet and arrow runs need not pay. Rows are numbered from 0, as `dataset[n]` and
`table.slice(n, 1)` index them, and named `path:row n`.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import pathlib
from collections.abc import Iterable, Iterator
from typing import Any

try:
    import pyarrow as pa
    import pyarrow.parquet as pq
except ImportError:  # optional: pip install -e ".[datasets]"
    pa = pq = None

INSTALL = 'pip install -e ".[datasets]"'
BATCH_ROWS = 1024  # rows converted to Python at a time


def format_of(path: str | pathlib.Path) -> str:
    """How `path` is read: "datasets" (a save_to_disk directory), "parquet", "arrow", "jsonl",
    or "directory" (a directory that `save_to_disk` did not write, which nothing reads)."""
    file = pathlib.Path(path)
    if file.is_dir():
        marks = ("state.json", "dataset_dict.json")
        return "datasets" if any((file / m).is_file() for m in marks) else "directory"
    suffix = file.suffix.lower()
    return {".parquet": "parquet", ".arrow": "arrow"}.get(suffix, "jsonl")


def missing_dependency(path: str | pathlib.Path) -> str:
    """Why `path` cannot be read here (a package its format needs is not installed), or ""."""
    fmt = format_of(path)
    if fmt in ("parquet", "arrow", "datasets") and pa is None:
        return f"reading {str(path)!r} ({fmt}) needs pyarrow, which is not installed: {INSTALL}"
    if fmt == "datasets" and not _has_datasets():
        return f"reading {str(path)!r} (a datasets directory) needs datasets: {INSTALL}"
    return ""


@dataclasses.dataclass(frozen=True)
class Rows:
    """The rows of one table on disk: iterating (once) yields (row index from 0, row as a dict)."""

    path: str  # the file or dataset directory, as messages name it ("<path>:row <n>")
    columns: tuple[str, ...]
    batches: Iterable[Any]  # pyarrow RecordBatches or Tables, in row order

    def __iter__(self) -> Iterator[tuple[int, dict[str, Any]]]:
        n = 0
        for batch in self.batches:
            for row in batch.to_pylist():
                yield n, row
                n += 1


def open_rows(path: str | pathlib.Path, *, split: str = "train", what: str = "Data") -> Rows:
    """The rows of a parquet or arrow file or a `save_to_disk` directory (see the module docstring).

    Args:
        path: The file or directory (`format_of(path)` not "jsonl" or "directory").
        split: The split read from a DatasetDict directory; other formats ignore it.
        what: The dataset's kind, for messages ("GSM8K").

    Returns:
        The rows, read lazily in batches of `BATCH_ROWS`.

    Raises:
        ImportError: pyarrow (or, for a directory, datasets) is not installed.
        FileNotFoundError: No file at `path`.
        ValueError: Not a parquet / Arrow file, or a DatasetDict without `split`.
    """
    fmt = format_of(path)
    if fmt not in ("parquet", "arrow", "datasets"):
        raise ValueError(
            f"{what} path {str(path)!r} is {fmt}; expected parquet, arrow or datasets."
        )
    if reason := missing_dependency(path):
        raise ImportError(f"{what} {reason}.")
    file = pathlib.Path(path)
    if fmt == "datasets":
        return _saved(file, split, what)
    if not file.is_file():
        raise FileNotFoundError(f"{what} file {str(file)!r} not found; expected a {fmt} file.")
    try:
        if fmt == "parquet":
            table = pq.ParquetFile(file)
            return Rows(str(file), tuple(table.schema_arrow.names), table.iter_batches(BATCH_ROWS))
        return _arrow(file)
    except pa.ArrowException as e:  # not parquet / Arrow at all, or a damaged footer
        raise ValueError(f"{what} file {str(file)!r} is not a readable {fmt} file: {e}") from None


def _arrow(file: pathlib.Path) -> Rows:
    """An Arrow IPC file (random access), or else an IPC stream (what `datasets` writes)."""
    try:
        reader = pa.ipc.open_file(pa.memory_map(str(file)))
        batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
    except pa.ArrowInvalid:
        reader = pa.ipc.open_stream(pa.memory_map(str(file)))
        batches = iter(reader)
    return Rows(str(file), tuple(reader.schema.names), batches)


def _saved(root: pathlib.Path, split: str, what: str) -> Rows:
    """A `save_to_disk` directory's rows; a DatasetDict's from `split`."""
    import datasets  # optional and slow to import (see the module docstring)

    data = datasets.load_from_disk(str(root), keep_in_memory=False)
    path = root
    if isinstance(data, datasets.DatasetDict):
        if split not in data:
            raise ValueError(
                f"{what} dataset {str(root)!r} has no split {split!r}; its splits are "
                f"{sorted(data)}; expected one of them (config.data.split for train_path, "
                "config.data.heldout_split for heldout_path)."
            )
        data, path = data[split], root / split  # save_to_disk writes each split there
    batches = data.with_format("arrow").iter(batch_size=BATCH_ROWS)
    return Rows(str(path), tuple(data.column_names), batches)


def _has_datasets() -> bool:
    return importlib.util.find_spec("datasets") is not None
