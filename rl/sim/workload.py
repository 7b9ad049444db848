"""Simulated workloads: prompts and the response length of every sample, prompt-correlated.

A prompt's G samples share a difficulty: its median response length is drawn once per prompt
(lognormal body around `median_tokens`, spread `prompt_sigma`), each sample then scatters around it
(`sample_sigma`); a `runaway_fraction` of prompts are runaways whose samples each run to the cap
with probability `runaway_p` (looping reasoning that never emits a stop token). Lengths are capped
at the request's max_new_tokens. Every draw derives from (seed, uid) for the difficulty and
(seed, round, uid, sample) for the scatter, never from simulation order: same seed, same lengths.

`fixed_lengths` instead gives every sample of prompt uid i the length fixed_lengths[i]
(launch.bench_pipeline's workload, whose lengths belong to the prompt).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Sequence

import numpy as np

from rl.types import Prompt, Request, SamplingParams


@dataclasses.dataclass(frozen=True, kw_only=True)
class WorkloadConfig:
    """Response and prompt length distributions (tokens)."""

    max_new_tokens: int = 8192  # the cap (a request's own max_new_tokens may lower it)
    median_tokens: float = 1500.0  # median of the prompts' median response length
    prompt_sigma: float = 0.8  # lognormal spread across prompts (difficulty)
    sample_sigma: float = 0.35  # lognormal spread of one prompt's samples around its median
    runaway_fraction: float = 0.05  # prompts whose samples may loop to the cap
    runaway_p: float = 0.5  # chance that one sample of a runaway prompt hits the cap
    prompt_min: int = 100  # prompt lengths, uniform in [prompt_min, prompt_max]
    prompt_max: int = 400
    fixed_lengths: tuple[int, ...] = ()  # if set: the response length of prompt uid i
    seed: int = 0

    def __post_init__(self):
        if self.max_new_tokens < 1 or not 1 <= self.prompt_min <= self.prompt_max:
            raise ValueError(
                "WorkloadConfig expects max_new_tokens >= 1 and 1 <= prompt_min <= prompt_max; "
                f"received {self.max_new_tokens}, {self.prompt_min}, {self.prompt_max}."
            )
        if self.median_tokens <= 0 or self.prompt_sigma < 0 or self.sample_sigma < 0:
            raise ValueError(
                "WorkloadConfig expects median_tokens > 0 and sigmas >= 0; received "
                f"{self.median_tokens}, {self.prompt_sigma}, {self.sample_sigma}."
            )
        for name in ("runaway_fraction", "runaway_p"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(
                    f"WorkloadConfig.{name} must be in [0, 1]; received {getattr(self, name)}."
                )
        if any(n < 1 for n in self.fixed_lengths):
            raise ValueError(f"fixed_lengths must all be >= 1; received {self.fixed_lengths}.")


class Workload:
    """Prompts (`prompts()`) and sample lengths (`length`) of one WorkloadConfig."""

    def __init__(self, cfg: WorkloadConfig):
        self.cfg = cfg
        self._difficulty: dict[int, tuple[float, bool]] = {}

    def prompts(self) -> Iterator[Prompt]:
        """The prompt stream, uid 0, 1, ...; tokens are placeholders of a drawn length.

        Endless, or with `fixed_lengths` one prompt per fixed length (a finite epoch).
        """
        rng = np.random.default_rng([self.cfg.seed, 7])
        uid = 0
        while not self.cfg.fixed_lengths or uid < len(self.cfg.fixed_lengths):
            n = int(rng.integers(self.cfg.prompt_min, self.cfg.prompt_max + 1))
            yield Prompt(uid=uid, tokens=(0,) * n)
            uid += 1

    def _prompt_draw(self, uid: int) -> tuple[float, bool]:
        if uid not in self._difficulty:
            rng = np.random.default_rng([self.cfg.seed, 1, uid])
            median = self.cfg.median_tokens * math.exp(
                self.cfg.prompt_sigma * rng.standard_normal()
            )
            self._difficulty[uid] = (median, bool(rng.random() < self.cfg.runaway_fraction))
        return self._difficulty[uid]

    def lengths(self, request: Request) -> tuple[int, ...]:
        """Response length of each of the request's samples, capped at its max_new_tokens."""
        cap = min(request.params.max_new_tokens, self.cfg.max_new_tokens)
        if self.cfg.fixed_lengths:
            if request.uid >= len(self.cfg.fixed_lengths):
                raise ValueError(
                    f"Prompt uid {request.uid} has no fixed length; fixed_lengths holds "
                    f"{len(self.cfg.fixed_lengths)} (uids 0..{len(self.cfg.fixed_lengths) - 1})."
                )
            return (min(self.cfg.fixed_lengths[request.uid], cap),) * request.group_size
        median, runaway = self._prompt_draw(request.uid)
        rng = np.random.default_rng([self.cfg.seed, 2, request.round, request.uid])
        g = request.group_size
        body = median * np.exp(self.cfg.sample_sigma * rng.standard_normal(g))
        loops = rng.random(g) < (self.cfg.runaway_p if runaway else 0.0)
        out = np.where(loops, cap, np.clip(np.rint(body), 1, cap))
        return tuple(int(x) for x in out)

    def sample_lengths(self, group_size: int, *, prompts: int = 500) -> list[int]:
        """Every sample's response length, prompt by prompt, over the first `prompts` prompts
        (round 0; a fixed_lengths workload: at most its prompts)."""
        params = SamplingParams(max_new_tokens=self.cfg.max_new_tokens)
        n = min(prompts, len(self.cfg.fixed_lengths) or prompts)
        return [
            x
            for uid in range(n)
            for x in self.lengths(
                Request(uid=uid, prompt=(0,), group_size=group_size, params=params)
            )
        ]

    def mean_length(self, group_size: int, *, prompts: int = 500) -> float:
        """The mean response length over the first `prompts` prompts' samples (round 0)."""
        return float(np.mean(self.sample_lengths(group_size, prompts=prompts)))


def summarize(lengths: Sequence[int]) -> dict[str, float]:
    """Median, p75, p90, max and mean of response lengths."""
    a = np.asarray(lengths, np.float64)
    return dict(
        median=float(np.median(a)),
        p75=float(np.percentile(a, 75)),
        p90=float(np.percentile(a, 90)),
        max=float(a.max()),
        mean=float(a.mean()),
    )
