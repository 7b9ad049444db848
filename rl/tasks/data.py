"""The train and held-out records of a run's task, and how its prompts are rendered.

`load_task(data_config_from(config), tokenizer, max_prompt_tokens=n)` returns a `TaskData`. The
task is a name in the registry (rl/tasks/registry.py), which holds its loader and options:

- generated tasks ("addition", "countdown", rl/tasks/synthetic.py): `train_size` training problems
  and `heldout_size` held-out ones, split by the seed;
- file tasks ("gsm8k", "math", rl/tasks/jsonl.py): the rows of `train_path`, a JSONL file, a
  `.parquet` or `.arrow` file or a `datasets` `save_to_disk` directory (rl/tasks/hf_datasets.py;
  of a DatasetDict, the split `split`), the question and answer read from `question_field` and
  `answer_field` ("": the task's own). The held-out split is the first `heldout_size` rows of
  `heldout_path` (a DatasetDict's: of `heldout_split`; 0: all of them) or, with no
  `heldout_path`, `heldout_size` rows of the train file drawn with the seed and removed from the
  training rows. A malformed row is skipped and counted, its `file:line` (tables: `path:row n`)
  logged (the first few), or with `on_error="raise"` stops the run before it starts, naming it.
  Rows whose rendered prompt is longer than `max_prompt_tokens` are dropped and counted the same
  way (the engine would refuse them mid-run, as veRL's filter_overlong_prompts), and so, with
  `numeric_answers_only`, are rows whose answer is not one number (MATH's "\\sqrt{2}" or
  "(1, 2)"; the "gsm8k" verifier compares numbers only, while "math" checks such answers
  symbolically, so a math run needs no filter).

Records keep their loaders' fields and are numbered 0..n-1 ("id") within each split.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from absl import logging

from rl.models.tokenizer import Tokenizer
from rl.rewards.verifiers import parse_number
from rl.sections import from_section
from rl.tasks.hf_datasets import missing_dependency
from rl.tasks.registry import get_task
from rl.tasks.templates import check_template, render_prompt

MAX_REPORTED = 5  # dropped rows named (file:line) in the log, per reason and file


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where a run's problems come from and how their prompts are written."""

    task: str = "addition"  # a name in rl.tasks.registry.TASKS
    # The task's options (config.task.<option>); those left out take the task's defaults.
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    seed: int = 0  # synthetic problems and splits; the held-out slice of a file task's train file
    train_size: int = 20000  # generated tasks: training problems (file tasks: every row)
    heldout_size: int = 200  # held-out problems (file tasks with heldout_path: the first N; 0: all)
    # file tasks: the local training data: JSONL, .parquet, .arrow or a save_to_disk directory
    train_path: str = ""
    heldout_path: str = ""  # file tasks: held-out data (as train_path); "": a seeded train slice
    split: str = "train"  # train_path a DatasetDict directory: the split read
    heldout_split: str = "test"  # heldout_path a DatasetDict directory: the split read
    question_field: str = ""  # file tasks: the key / column of the question; "": the task's
    answer_field: str = ""  # file tasks: the key / column of the answer; "": the task's
    on_error: str = (
        "skip"  # malformed rows of a file task: skip (counted, file:line logged) | raise
    )
    numeric_answers_only: bool = False  # file tasks: drop rows whose answer is not one number
    template: str = "plain"  # plain | chat (the tokenizer's chat template)
    system: str = ""  # chat template's system message; "": none
    instruction: str = ""  # text put before each question

    def __post_init__(self) -> None:
        object.__setattr__(self, "options", get_task(self.task).resolve(dict(self.options)))
        check_template(self.template, self.system or None)
        if self.on_error not in ("skip", "raise"):
            raise ValueError(f"config.data.on_error={self.on_error!r}; expected 'skip' or 'raise'.")
        if self.heldout_size < 0 or (self.heldout_size == 0 and not self.heldout_path):
            raise ValueError(
                f"config.eval.heldout_size={self.heldout_size}; expected > 0 (0 means all rows of "
                "config.data.heldout_path, and needs one)."
            )
        if self.source == "file" and not self.train_path:
            raise ValueError(
                f"config.task.name={self.task!r} reads a local file, but config.data."
                "train_path is empty; expected e.g. --config.data.train_path=/data/gsm8k/train.jsonl."
            )
        for name in ("split", "heldout_split", "question_field", "answer_field"):
            value = getattr(self, name)
            if not isinstance(value, str) or (name.endswith("split") and not value):
                raise ValueError(f"config.data.{name}={value!r}; expected a name (a string).")
        if self.source == "generate" and (self.question_field or self.answer_field):
            raise ValueError(
                f"config.data.question_field / answer_field are set, but task {self.task!r} "
                "generates its records; expected them empty (they name a data file's columns)."
            )
        for name in ("train_path", "heldout_path"):
            if self.source == "file" and (reason := missing_dependency(getattr(self, name))):
                raise ValueError(f"config.data.{name}: {reason}.")

    @property
    def source(self) -> str:
        """How the task's records come: generate | file (rl.tasks.registry)."""
        return get_task(self.task).source

    @property
    def meta_fields(self) -> tuple[str, ...]:
        """The record fields the task's reward reads (copied into each request's meta)."""
        return get_task(self.task).meta_fields

    @property
    def prompt_kwargs(self) -> dict[str, Any]:
        """`template`, `system` and `instruction` for prompt_dataset, render_prompt, evaluate."""
        return {
            "template": self.template,
            "system": self.system or None,
            "instruction": self.instruction,
        }

    def render(self, record: Mapping[str, Any], tokenizer: Tokenizer) -> tuple[int, ...]:
        """The prompt token ids of `record` in this format."""
        return render_prompt(record, tokenizer, **self.prompt_kwargs)


def data_config_from(config: Any) -> DataConfig:
    """The DataConfig of a run config: `config.task`, `config.data`, `config.eval.heldout_size`.

    The task's options are read from `config.task` (options of other tasks there are ignored).
    """
    task = get_task(config.task.name)
    return from_section(
        DataConfig,
        config.data if "data" in config else None,
        name="data",
        task=task.name,
        options={k: config.task[k] for k in task.options if k in config.task},
        seed=config.seed,
        train_size=config.task.train_size,
        heldout_size=config.eval.heldout_size,
    )


@dataclasses.dataclass(frozen=True)
class TaskData:
    """A run's records: `train` and `heldout` (ids 0..n-1 each) and what loading dropped."""

    train: list[dict[str, Any]]
    heldout: list[dict[str, Any]]
    counts: dict[str, int]  # train_rows, heldout_rows, skipped_malformed, too_long, non_numeric


def _generated(cfg: DataConfig, split: str, n: int) -> list[dict[str, Any]]:
    records = get_task(cfg.task).load(split, n, seed=cfg.seed, **cfg.options)
    _check_records(cfg, records, f"{split} split")
    return list(records)


def _check_records(cfg: DataConfig, records: Any, where: str) -> None:
    """A task loader's output: a sequence of mappings, each with a string "question"."""
    if not isinstance(records, Sequence) or isinstance(records, str):
        raise ValueError(
            f"Task {cfg.task!r} returned {type(records).__name__} for its {where}; expected a "
            "list of records (mappings with a string 'question')."
        )
    for k, r in enumerate(records):
        if not isinstance(r, Mapping) or not isinstance(r.get("question"), str):
            got = sorted(r) if isinstance(r, Mapping) else type(r).__name__
            raise ValueError(
                f"Task {cfg.task!r}, {where}, record {k}: expected a mapping with a string "
                f"'question'; received {got}."
            )


def _report(
    what: str, where: Callable[[int], str], lines: Sequence[int], count: int, detail: str
) -> None:
    places = ", ".join(where(n) for n in lines[:MAX_REPORTED])
    more = f" and {count - MAX_REPORTED} more" if count > MAX_REPORTED else ""
    logging.warning("Dropped %d rows %s (%s): %s%s", count, what, detail, places, more)


def _file_rows(
    cfg: DataConfig,
    path: str,
    split: str,
    tokenizer: Tokenizer,
    max_prompt_tokens: int,
    counts: dict,
) -> list[dict[str, Any]]:
    """The usable rows of one data file, dropped ones counted and reported with file:line."""
    columns = {"question_field": cfg.question_field, "answer_field": cfg.answer_field}
    load = get_task(cfg.task).load
    rows = load(path, on_error=cfg.on_error, split=split, **columns, **cfg.options)
    _check_records(cfg, rows, path)
    skipped = getattr(rows, "skipped", 0)  # jsonl.LoadedRecords counts and numbers the rows
    counts["skipped_malformed"] += skipped
    where = getattr(rows, "where", None) or (lambda n: f"{path}:{n}")
    kept, too_long, non_numeric = [], [], []
    for record, line in zip(rows, getattr(rows, "lines", None) or range(1, len(rows) + 1),
                            strict=True):  # fmt: skip
        if cfg.numeric_answers_only and parse_number(record.get("answer")) is None:
            non_numeric.append(line)
        elif max_prompt_tokens and len(cfg.render(record, tokenizer)) > max_prompt_tokens:
            too_long.append(line)
        else:
            kept.append(record)
    if non_numeric:
        counts["non_numeric"] += len(non_numeric)
        _report("whose answer is not one number", where, non_numeric, len(non_numeric),
                "numeric_answers_only")  # fmt: skip
    if too_long:
        counts["too_long"] += len(too_long)
        _report("whose prompt is too long", where, too_long, len(too_long),
                f"over {max_prompt_tokens} tokens")  # fmt: skip
    if not kept:
        raise ValueError(
            f"{path}: no usable rows ({len(rows)} well-formed, {skipped} malformed, "
            f"{len(too_long)} with prompts over {max_prompt_tokens} tokens, {len(non_numeric)} "
            "with non-numeric answers); expected at least one."
        )
    return kept


def _check_synthetic_lengths(
    cfg: DataConfig, records: Sequence[Mapping[str, Any]], tokenizer: Tokenizer, limit: int
) -> None:
    """Every synthetic prompt must fit the engine (they are generated, so none is dropped)."""
    longest, record = max(((len(cfg.render(r, tokenizer)), r) for r in records), key=lambda x: x[0])
    if longest > limit:
        raise ValueError(
            f"The {cfg.task} task's prompts take up to {longest} tokens (e.g. "
            f"{record['question']!r}), more than the {limit} the engine leaves for a prompt; "
            f"expected config.engine.max_prefill_length >= {longest} and config.engine.max_length "
            f">= {longest} + config.sampling.max_new_tokens."
        )


def _renumber(records: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    return [{**r, "id": i} for i, r in enumerate(records)]


def load_task(cfg: DataConfig, tokenizer: Tokenizer, *, max_prompt_tokens: int = 0) -> TaskData:
    """The train and held-out records `cfg` names (see the module docstring).

    Args:
        cfg: The task and data settings.
        tokenizer: Renders prompts, to measure them.
        max_prompt_tokens: File rows whose prompt is longer are dropped; 0: no limit.

    Returns:
        The records and counts of what was dropped.

    Raises:
        ValueError: A malformed row with on_error="raise" (naming file:line), a file with no
            usable row, a held-out slice that leaves no training rows, or a synthetic prompt
            longer than `max_prompt_tokens`.
        FileNotFoundError: A data path that does not exist.
    """
    counts = dict.fromkeys(("skipped_malformed", "too_long", "non_numeric"), 0)
    if cfg.source == "generate":
        train = _generated(cfg, "train", cfg.train_size)
        heldout = _generated(cfg, "heldout", cfg.heldout_size)
        if max_prompt_tokens:
            _check_synthetic_lengths(cfg, train + heldout, tokenizer, max_prompt_tokens)
    else:
        train = _file_rows(cfg, cfg.train_path, cfg.split, tokenizer, max_prompt_tokens, counts)
        if cfg.heldout_path:
            heldout = _file_rows(cfg, cfg.heldout_path, cfg.heldout_split, tokenizer,
                                 max_prompt_tokens, counts)  # fmt: skip
            heldout = heldout[: cfg.heldout_size or None]
        else:
            if cfg.heldout_size >= len(train):
                raise ValueError(
                    f"config.eval.heldout_size={cfg.heldout_size} would hold out all {len(train)} "
                    f"usable rows of {cfg.train_path}; expected fewer, or a "
                    "config.data.heldout_path."
                )
            pick = np.random.default_rng(cfg.seed).permutation(len(train))[: cfg.heldout_size]
            out = np.zeros(len(train), bool)
            out[pick] = True
            heldout = [r for r, o in zip(train, out, strict=True) if o]
            train = [r for r, o in zip(train, out, strict=True) if not o]
    train, heldout = _renumber(train), _renumber(heldout)
    counts = {"train_rows": len(train), "heldout_rows": len(heldout), **counts}
    logging.info("Task %s: %s", cfg.task, counts)
    return TaskData(train=train, heldout=heldout, counts=counts)
