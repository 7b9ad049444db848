"""The train and held-out records of a run's task, and how its prompts are rendered.

`load_task(data_config_from(config), tokenizer, max_prompt_tokens=n)` returns a `TaskData`:

- synthetic tasks ("addition", "countdown"): `train_size` training problems and `heldout_size`
  held-out ones, split by the seed (rl/tasks/synthetic.py);
- local JSONL ("gsm8k", "math", rl/tasks/jsonl.py): the rows of `train_path`. The held-out split
  is the first `heldout_size` rows of `heldout_path` (0: all of them) or, with no
  `heldout_path`, `heldout_size` rows of the train file drawn with the seed and removed from
  the training rows. A malformed row is skipped and counted, its `file:line` logged (the first
  few), or with `on_error="raise"` stops the run before it starts, naming `file:line`. Rows whose
  rendered prompt is longer than `max_prompt_tokens` are dropped and counted the same way (the
  engine would refuse them mid-run, as veRL's filter_overlong_prompts), and so, with
  `numeric_answers_only`, are rows whose answer is not one number (MATH's "\\sqrt{2}" or
  "(1, 2)"; the "gsm8k" verifier compares numbers only, while "math" checks such answers
  symbolically, so a math run needs no filter).

Records keep their loaders' fields and are renumbered 0..n-1 within each split.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from absl import logging

from rl.models.tokenizer import Tokenizer
from rl.rewards.verifiers import parse_number
from rl.tasks import jsonl, synthetic
from rl.tasks.templates import check_template, render_prompt

SYNTHETIC_TASKS = ("addition", "countdown")
JSONL_TASKS = ("gsm8k", "math")
TASKS = SYNTHETIC_TASKS + JSONL_TASKS
MAX_REPORTED = 5  # dropped rows named (file:line) in the log, per reason and file


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where a run's problems come from and how their prompts are written."""

    task: str = "addition"  # one of TASKS
    seed: int = 0  # synthetic problems and splits; the held-out slice of a JSONL train file
    digits: int = 3  # addition: operands of up to this many digits
    pad_operands: bool = False  # addition: zero-padded operands and sum ("007+095=" -> "0102")
    reverse_answer: bool = False  # addition: the sum written least-significant digit first
    reverse_operands: bool = False  # addition: the operands written least-significant digit first
    count: int = 4  # countdown: numbers per problem
    max_number: int = 100  # countdown: numbers are uniform in [1, max_number]
    max_target: int = 0  # countdown: bound on the target and every intermediate value; 0: none
    style: str = "words"  # countdown: question wording, words (TinyZero) | compact ("3 5 2 -> 16:")
    train_size: int = 20000  # synthetic training problems (JSONL: every row of train_path)
    heldout_size: int = 200  # held-out problems (JSONL with heldout_path: the first N rows; 0: all)
    train_path: str = ""  # JSONL tasks: the local training file
    heldout_path: str = ""  # JSONL tasks: a held-out file; "": a seeded slice of train_path
    on_error: str = "skip"  # malformed JSONL rows: skip (counted, file:line logged) | raise
    numeric_answers_only: bool = False  # JSONL: drop rows whose answer is not one number
    template: str = "plain"  # plain | chat (the tokenizer's chat template)
    system: str = ""  # chat template's system message; "": none
    instruction: str = ""  # text put before each question

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"config.task.name={self.task!r}; expected one of {TASKS}.")
        check_template(self.template, self.system or None)
        if self.task == "countdown" and (
            self.count < 2 or self.max_number < 1 or self.max_target < 0
        ):
            raise ValueError(
                f"config.task: countdown needs count >= 2, max_number >= 1 and max_target >= 0 "
                f"(0: no bound); received count={self.count}, max_number={self.max_number}, "
                f"max_target={self.max_target}."
            )
        if self.style not in synthetic.COUNTDOWN_STYLES:
            raise ValueError(
                f"config.task.style={self.style!r}; expected one of {synthetic.COUNTDOWN_STYLES}."
            )
        if self.on_error not in ("skip", "raise"):
            raise ValueError(f"config.data.on_error={self.on_error!r}; expected 'skip' or 'raise'.")
        if self.heldout_size < 0 or (self.heldout_size == 0 and not self.heldout_path):
            raise ValueError(
                f"config.eval.heldout_size={self.heldout_size}; expected > 0 (0 means all rows of "
                "config.data.heldout_path, and needs one)."
            )
        if self.task in JSONL_TASKS and not self.train_path:
            raise ValueError(
                f"config.task.name={self.task!r} reads a local JSONL file, but config.data."
                "train_path is empty; expected e.g. --config.data.train_path=/data/gsm8k/train.jsonl."
            )

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


# DataConfig fields that come from `config.data` (the rest from config.task, seed, eval).
_DATA_FIELDS = (
    "train_path",
    "heldout_path",
    "on_error",
    "numeric_answers_only",
    "template",
    "system",
    "instruction",
)


def data_config_from(config: Any) -> DataConfig:
    """The DataConfig of a run config: `config.task`, `config.data`, `config.eval.heldout_size`."""
    data = dict(config.data) if "data" in config else {}
    unknown = set(data) - set(_DATA_FIELDS)
    if unknown:
        raise ValueError(
            f"Unknown config.data fields {sorted(unknown)}; expected some of {_DATA_FIELDS}."
        )
    return DataConfig(
        task=config.task.name,
        seed=config.seed,
        digits=config.task.digits,
        pad_operands=config.task.pad_operands,
        reverse_answer=config.task.reverse_answer,
        reverse_operands=config.task.reverse_operands,
        count=config.task.count,
        max_number=config.task.max_number,
        max_target=config.task.max_target,
        style=config.task.style,
        train_size=config.task.train_size,
        heldout_size=config.eval.heldout_size,
        **data,
    )


@dataclasses.dataclass(frozen=True)
class TaskData:
    """A run's records: `train` and `heldout` (ids 0..n-1 each) and what loading dropped."""

    train: list[dict[str, Any]]
    heldout: list[dict[str, Any]]
    counts: dict[str, int]  # train_rows, heldout_rows, skipped_malformed, too_long, non_numeric


def _synthetic(cfg: DataConfig, split: str, n: int) -> list[dict[str, Any]]:
    if cfg.task == "addition":
        return synthetic.addition_records(
            n,
            digits=cfg.digits,
            seed=cfg.seed,
            split=split,
            pad=cfg.pad_operands,
            reverse=cfg.reverse_answer,
            reverse_operands=cfg.reverse_operands,
        )
    return synthetic.countdown_records(
        n,
        count=cfg.count,
        max_number=cfg.max_number,
        max_target=cfg.max_target or None,
        seed=cfg.seed,
        split=split,
        style=cfg.style,
    )


def _report(what: str, file: str, lines: Sequence[int], count: int, detail: str) -> None:
    where = ", ".join(f"{file}:{n}" for n in lines[:MAX_REPORTED])
    more = f" and {count - MAX_REPORTED} more" if count > MAX_REPORTED else ""
    logging.warning("Dropped %d rows %s (%s): %s%s", count, what, detail, where, more)


def _jsonl(
    cfg: DataConfig, path: str, tokenizer: Tokenizer, max_prompt_tokens: int, counts: dict
) -> list[dict[str, Any]]:
    """The usable rows of one JSONL file, dropped ones counted and reported with file:line."""
    load = jsonl.load_gsm8k if cfg.task == "gsm8k" else jsonl.load_math
    rows = load(path, on_error=cfg.on_error)
    counts["skipped_malformed"] += rows.skipped
    kept, too_long, non_numeric = [], [], []
    for record, line in zip(rows, rows.lines or range(1, len(rows) + 1), strict=True):
        if cfg.numeric_answers_only and parse_number(record["answer"]) is None:
            non_numeric.append(line)
        elif max_prompt_tokens and len(cfg.render(record, tokenizer)) > max_prompt_tokens:
            too_long.append(line)
        else:
            kept.append(record)
    if non_numeric:
        counts["non_numeric"] += len(non_numeric)
        _report("whose answer is not one number", path, non_numeric, len(non_numeric),
                "numeric_answers_only")  # fmt: skip
    if too_long:
        counts["too_long"] += len(too_long)
        _report("whose prompt is too long", path, too_long, len(too_long),
                f"over {max_prompt_tokens} tokens")  # fmt: skip
    if not kept:
        raise ValueError(
            f"{path}: no usable rows ({len(rows)} well-formed, {rows.skipped} malformed, "
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
        max_prompt_tokens: JSONL rows whose prompt is longer are dropped; 0: no limit.

    Returns:
        The records and counts of what was dropped.

    Raises:
        ValueError: A malformed row with on_error="raise" (naming file:line), a file with no
            usable row, a held-out slice that leaves no training rows, or a synthetic prompt
            longer than `max_prompt_tokens`.
        FileNotFoundError: A JSONL path that does not exist.
    """
    counts = dict.fromkeys(("skipped_malformed", "too_long", "non_numeric"), 0)
    if cfg.task in SYNTHETIC_TASKS:
        train = _synthetic(cfg, "train", cfg.train_size)
        heldout = _synthetic(cfg, "heldout", cfg.heldout_size)
        if max_prompt_tokens:
            _check_synthetic_lengths(cfg, train + heldout, tokenizer, max_prompt_tokens)
    else:
        train = _jsonl(cfg, cfg.train_path, tokenizer, max_prompt_tokens, counts)
        if cfg.heldout_path:
            heldout = _jsonl(cfg, cfg.heldout_path, tokenizer, max_prompt_tokens, counts)
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
