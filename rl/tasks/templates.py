"""Prompt templates: a task record's question -> prompt token ids, for any `Tokenizer`.

"plain" encodes `instruction + question` and prepends bos when the tokenizer has one (what
`AdditionTask` does). "chat" renders `[system?, user: instruction + question]` with the tokenizer's
chat template and the generation prompt, encodes the text without adding specials, then prepends
bos only if the tokenizer has one and the rendered text did not already start with it (templates
such as Llama 3's or Gemma's write bos themselves): the prompt starts with exactly one bos either
way. transformers' `apply_chat_template(tokenize=True)` would not add a bos the template leaves
out; this library prefers one convention for both templates.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from rl.models.tokenizer import Tokenizer

Template = Literal["plain", "chat"]
TEMPLATES = ("plain", "chat")


def _question(record: Mapping[str, Any]) -> str:
    if isinstance(record, Mapping) and isinstance(record.get("question"), str):
        return record["question"]
    if isinstance(record, Mapping):
        got = f"id={record.get('id')!r} with keys {sorted(record)}"
    else:
        got = f"a {type(record).__name__}"
    raise ValueError(f"Expected a record with a string 'question'; received {got}.")


def check_template(template: str, system: str | None) -> None:
    """Raises ValueError if `template` is unknown or `system` is set for the plain template."""
    if template not in TEMPLATES:
        raise ValueError(f"template must be one of {TEMPLATES}; received {template!r}.")
    if system is not None and template != "chat":
        raise ValueError(
            f"system={system!r} needs template='chat'; received template={template!r} (the "
            "plain template has no system turn: put the text in `instruction` instead)."
        )


def render_prompt(
    record: Mapping[str, Any],
    tokenizer: Tokenizer,
    *,
    template: Template = "plain",
    system: str | None = None,
    instruction: str = "",
) -> tuple[int, ...]:
    """Returns the prompt token ids of `record` (see the module docstring for each template).

    Args:
        record: A task record with a string "question".
        tokenizer: Encodes the text; its chat template renders "chat" prompts.
        template: "plain" or "chat".
        system: The system message of the chat template (None: no system turn); chat only.
        instruction: Text put before the question, in the user turn for "chat".

    Returns:
        The token ids.
    """
    check_template(template, system)
    user = instruction + _question(record)
    bos = tokenizer.bos_id
    if template == "plain":
        return tuple(tokenizer.encode(user, add_bos=bos is not None))
    messages = [{"role": "system", "content": system}] if system is not None else []
    messages.append({"role": "user", "content": user})
    ids = tokenizer.encode(
        tokenizer.apply_chat_template(messages, add_generation_prompt=True), add_bos=False
    )
    if bos is not None and (not ids or ids[0] != bos):
        ids = [bos, *ids]
    return tuple(ids)
