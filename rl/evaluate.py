"""Held-out evaluation through the sampler engine: greedy accuracy and pass@k."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from rl.admission import FCFS
from rl.envs import EnvRunner
from rl.models.tokenizer import Tokenizer
from rl.passk import mean_pass_at_k
from rl.tasks.pipeline import DEFAULT_META_FIELDS, record_meta
from rl.tasks.templates import Template, render_prompt
from rl.types import Group, Request, SamplingParams

if TYPE_CHECKING:
    from sampler.engine import Engine
    from sampler.loop import RewardFn
from sampler.loop import SamplerLoop

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
    n: int = 0,
    temperature: float = 1.0,
    template: Template = "plain",
    system: str | None = None,
    instruction: str = "",
    meta_fields: Sequence[str] = DEFAULT_META_FIELDS,
    environment: EnvRunner | None = None,
) -> dict[str, float]:
    """Greedy accuracy over `records`, and pass@k from n samples at `temperature` when k > 1.

    A response is correct when `reward_fn` gives it a reward >= 1 (with an `environment`, when
    its episode's return is >= 1: rl/envs). Prompts are rendered with
    `template`, `system` and `instruction` as in training (rl.tasks.templates.render_prompt);
    each request's meta holds the record's `meta_fields` (the task's, as in training).
    pass@k is the unbiased estimator of the Codex paper (rl.passk) over n >= k samples per
    problem (n 0: n = k, the plain "any of k correct" fraction).

    Returns:
      {"accuracy": fraction correct greedily, "pass@k": mean unbiased pass@k (k > 1)}.
    """

    if not records:
        raise ValueError("evaluate received no records; expected a held-out split.")
    n = n or k
    if k < 1 or n < k:
        raise ValueError(f"evaluate: pass@k needs 1 <= k <= n; received k={k}, n={n}.")
    stop = (tokenizer.eos_id,)

    def run(group_size: int, sampling: SamplingParams) -> list[Group]:
        groups: list[Group] = []
        loop = SamplerLoop(
            engine.fork(),  # the rollout may be running on `engine` (async runs ahead)
            params,
            admission=FCFS(),
            reward_fn=reward_fn,
            emit=groups.append,
            environment=environment,
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
            n,
            SamplingParams(
                temperature=temperature, max_new_tokens=max_new_tokens, stop_token_ids=stop
            ),
        )
        out[f"pass@{k}"] = mean_pass_at_k([[r >= 1.0 for r in g.rewards] for g in sampled], k)
    return out
