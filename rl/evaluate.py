"""Held-out evaluation through the sampler engine: greedy accuracy and pass@k."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from rl.admission import FCFS
from rl.models.tokenizer import Tokenizer
from rl.tasks.pipeline import DEFAULT_META_FIELDS, record_meta
from rl.tasks.templates import Template, render_prompt
from rl.types import Group, Request, SamplingParams

if TYPE_CHECKING:
    from sampler.engine import Engine
    from sampler.loop import RewardFn

EVAL_ROUND = 2**31 - 1  # evaluation streams never coincide with a training round's


def evaluate(
    engine: Engine,
    params: Any,
    records: Sequence[Mapping[str, Any]],
    tokenizer: Tokenizer,
    reward_fn: RewardFn,
    *,
    max_new_tokens: int,
    k: int = 1,
    temperature: float = 1.0,
    template: Template = "plain",
    system: str | None = None,
    instruction: str = "",
    meta_fields: Sequence[str] = DEFAULT_META_FIELDS,
) -> dict[str, float]:
    """Greedy accuracy over `records`, and pass@k with k samples at `temperature` when k > 1.

    A response is correct when `reward_fn` gives it a reward >= 1. Prompts are rendered with
    `template`, `system` and `instruction` as in training (rl.tasks.templates.render_prompt);
    each request's meta holds the record's `meta_fields` (the task's, as in training).

    Returns:
      {"accuracy": fraction correct greedily, "pass@k": fraction with >= 1 of k correct (k > 1)}.
    """
    from sampler.loop import SamplerLoop

    if not records:
        raise ValueError("evaluate received no records; expected a held-out split.")
    stop = (tokenizer.eos_id,)

    def run(group_size: int, sampling: SamplingParams) -> list[Group]:
        groups: list[Group] = []
        loop = SamplerLoop(
            engine, params, admission=FCFS(), reward_fn=reward_fn, emit=groups.append
        )
        loop.submit(
            Request(
                uid=i,
                round=EVAL_ROUND,
                index=i,
                prompt=render_prompt(
                    r, tokenizer, template=template, system=system, instruction=instruction
                ),
                group_size=group_size,
                params=sampling,
                meta=record_meta({"id": i, **r}, meta_fields),
            )
            for i, r in enumerate(records)
        )
        loop.run_until_idle()
        return groups

    greedy = run(
        1, SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, stop_token_ids=stop)
    )
    out = {"accuracy": float(np.mean([g.rewards[0] >= 1.0 for g in greedy]))}
    if k > 1:
        sampled = run(
            k,
            SamplingParams(
                temperature=temperature, max_new_tokens=max_new_tokens, stop_token_ids=stop
            ),
        )
        out[f"pass@{k}"] = float(np.mean([max(g.rewards) >= 1.0 for g in sampled]))
    return out
