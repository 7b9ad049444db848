"""SamplerStats: a sampler loop's counters (admission, emission, cuts, tokens, occupancy, moves)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable


@dataclasses.dataclass
class SamplerStats:
    prefills: int = 0
    groups_admitted: int = 0
    groups_emitted: int = 0
    groups_aborted: int = 0  # by abort() or by a round's cut
    groups_cut: int = 0  # complete groups refused by a full round cut
    samples_cut: int = 0  # unfinished samples dropped once their group kept `keep` finished ones
    cut_sample_tokens: int = 0  # tokens those samples had produced (a lower bound on their length)
    tokens: int = 0  # response tokens produced
    generate_calls: int = 0
    slot_steps: int = 0  # slots x decode steps run (occupancy = tokens / slot_steps)
    recomputes: int = 0  # recompute_kv: running samples re-prefilled after a weight swap
    recomputed_tokens: int = 0  # the tokens those re-prefills covered (prompt + response so far)
    migrations: int = 0  # requests handed off to another replica (JigsawRL migration)
    migrated_sequences: int = 0  # their running samples
    migrated_bytes: int = 0  # decode state moved (KV rows and per-slot state)
    evicted_sequences: int = 0  # samples taken out of a replica taken back mid-rollout
    resumed_sequences: int = 0  # samples resumed here (re-prefilled with their tokens so far)
    env_turns: int = 0  # multi-turn: the model's turns the environment answered
    observation_tokens: int = 0  # tokens the environment appended (not in `tokens`)

    @property
    def occupancy(self) -> float:
        return self.tokens / self.slot_steps if self.slot_steps else 0.0

    @classmethod
    def total(cls, stats: Iterable[SamplerStats]) -> SamplerStats:
        """The counters of several replicas summed."""
        out = cls()
        for one in stats:
            for f in dataclasses.fields(cls):
                setattr(out, f.name, getattr(out, f.name) + getattr(one, f.name))
        return out
