"""Tasks by name: each owns its loader, its options and the record fields its reward reads.

    @register_task("parity", options={"bits": 4}, meta_fields=("answer",))
    def parity(split, n, *, seed, bits):
        rng = random.Random(f"{seed}/{split}")
        rows = [[rng.randint(0, 1) for _ in range(bits)] for _ in range(n)]
        return [{"question": "".join(map(str, r)) + ":", "answer": str(sum(r) % 2)} for r in rows]

A config names a task (`config.task.name`) and sets its options as `config.task.<option>`; an
option a config leaves out takes the default given here. `rl.tasks.data.load_task` calls the
loader, `rl.tasks.pipeline.prompt_dataset` and `rl.evaluate.evaluate` copy `meta_fields` of each
record into the request's `meta`, where the reward reads them. Adding a task needs no edit to the
library: register it before the run is built.

Two kinds of loader:
- `source="generate"`: `fn(split, n, *, seed, **options) -> records`, n records of "train" or
  "heldout" (`config.task.train_size` and `config.eval.heldout_size`), split by the seed;
- `source="file"`: `fn(path, *, on_error, split, question_field, answer_field, **options) ->
  rl.tasks.jsonl.LoadedRecords`, the rows of local data (`config.data.train_path`,
  `config.data.heldout_path`: JSONL, parquet, arrow or a `datasets` save_to_disk directory, whose
  DatasetDict split is `split`), the question and answer in the key or column that
  `question_field` / `answer_field` name ("": the task's own), malformed rows skipped and counted
  with their line or row numbers (or raised, with on_error="raise").
Records are mappings with a string "question" (the prompt's text) and whatever fields the reward
needs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from rl.registry import Registry
from rl.tasks import jsonl, synthetic

SOURCES = ("generate", "file")
# Names the loaders are called with, or config.task's own fields: no task option may take them.
RESERVED = ("name", "train_size", "seed", "split", "n", "path", "on_error", "question_field",
            "answer_field")  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Task:
    """A registered task: its loader, its options with their defaults, its metadata fields."""

    name: str
    load: Callable[..., Any]  # see the module docstring for the two signatures
    source: str  # generate | file
    options: Mapping[str, Any]  # option -> default (config.task.<option>)
    meta_fields: tuple[str, ...]  # record fields copied into Prompt.meta / Request.meta
    check: Callable[[Mapping[str, Any]], None] | None = None  # raises ValueError on bad options

    def resolve(self, given: Mapping[str, Any]) -> dict[str, Any]:
        """The task's options: the defaults, overridden by `given` (which must be options)."""
        unknown = sorted(set(given) - set(self.options))
        if unknown:
            raise ValueError(
                f"config.task: {unknown} are not options of task {self.name!r}; expected some of "
                f"{sorted(self.options)}."
            )
        options = {**self.options, **given}
        if self.check is not None:
            self.check(options)
        return options


TASKS: Registry[Task] = Registry("task")


def register_task(
    name: str,
    *,
    options: Mapping[str, Any] | None = None,
    meta_fields: tuple[str, ...] = ("answer",),
    source: str = "generate",
    check: Callable[[Mapping[str, Any]], None] | None = None,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: registers a task loader under `name` (see the module docstring).

    Args:
        name: The name a config gives as `config.task.name`; must be new.
        options: The loader's keyword options and their defaults (`config.task.<option>`).
        meta_fields: Record fields the reward reads, copied into each request's `meta`.
        source: "generate" (synthetic records) or "file" (rows of a local file).
        check: Validates the resolved options; raises ValueError naming the bad one.

    Returns:
        The decorator; it returns the loader unchanged.
    """
    if source not in SOURCES:
        raise ValueError(f"register_task({name!r}): source={source!r}; expected one of {SOURCES}.")
    if isinstance(meta_fields, str) or not all(isinstance(f, str) for f in meta_fields):
        raise ValueError(
            f"register_task({name!r}): meta_fields={meta_fields!r}; expected a tuple of field names."
        )
    reserved = set(RESERVED) & set(options or {})
    if reserved:
        raise ValueError(
            f"register_task({name!r}): options {sorted(reserved)} are reserved names; expected "
            "other names."
        )

    def decorator(fn: Callable[..., Any]) -> Callable[..., Any]:
        task = Task(name, fn, source, dict(options or {}), tuple(meta_fields), check)
        TASKS.register(name)(task)
        return fn

    return decorator


def get_task(name: str) -> Task:
    """The task registered under `name`; a ValueError lists the registered names."""
    if name not in TASKS and name not in TASKS.unloaded:
        raise ValueError(f"config.task.name={name!r}; expected one of {sorted(TASKS)}.")
    return TASKS.get(name)  # one the driver registered and this worker could not load: why


# ------------------------------------------------------------------------------ built-in tasks


@register_task(
    "addition",
    options={
        "digits": 3,
        "pad_operands": False,
        "reverse_answer": False,
        "reverse_operands": False,
    },
    check=lambda o: _at_least(o, digits=1),
)
def _addition(split: str, n: int, *, seed: int, digits: int, pad_operands: bool,
              reverse_answer: bool, reverse_operands: bool) -> list[dict[str, Any]]:  # fmt: skip
    """rl.tasks.synthetic.addition_records: "123+45=" -> "168"."""
    return synthetic.addition_records(
        n,
        digits=digits,
        seed=seed,
        split=split,
        pad=pad_operands,
        reverse=reverse_answer,
        reverse_operands=reverse_operands,
    )


def _check_countdown(o: Mapping[str, Any]) -> None:
    if o["count"] < 2 or o["max_number"] < 1 or o["max_target"] < 0:
        raise ValueError(
            f"config.task: countdown needs count >= 2, max_number >= 1 and max_target >= 0 "
            f"(0: no bound); received count={o['count']}, max_number={o['max_number']}, "
            f"max_target={o['max_target']}."
        )
    if o["style"] not in synthetic.COUNTDOWN_STYLES:
        raise ValueError(
            f"config.task.style={o['style']!r}; expected one of {synthetic.COUNTDOWN_STYLES}."
        )


@register_task(
    "countdown",
    options={"count": 4, "max_number": 100, "max_target": 0, "style": "words"},
    meta_fields=("answer", "numbers", "target"),
    check=_check_countdown,
)
def _countdown(split: str, n: int, *, seed: int, count: int, max_number: int, max_target: int,
               style: str) -> list[dict[str, Any]]:  # fmt: skip
    """rl.tasks.synthetic.countdown_records: reach a target from numbers with + - * /."""
    return synthetic.countdown_records(
        n,
        count=count,
        max_number=max_number,
        max_target=max_target or None,
        seed=seed,
        split=split,
        style=style,
    )


register_task("gsm8k", source="file")(jsonl.load_gsm8k)
register_task("math", source="file")(jsonl.load_math)


def _at_least(options: Mapping[str, Any], **lows: int) -> None:
    for name, low in lows.items():
        value = options[name]
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"config.task.{name}={value!r}; expected an integer >= {low}.")
