"""Complete groups -> padded arrays for the train step.

Row i holds one completion: inputs = (prompt + response)[:-1], targets = (prompt + response)[1:].
The loss mask is 1 exactly where the target is a response token; the behaviour log-probs (the
sampler's) sit at the same positions. Lengths pad to power-of-two buckets and rows to a multiple of
`rows`, so the step compiles once per bucket.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np

from rl.types import Group


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Batch:
    inputs: np.ndarray  # (B, T) int32
    targets: np.ndarray  # (B, T) int32
    positions: np.ndarray  # (B, T) int32
    segments: np.ndarray  # (B, T) int32: 1 real token, 0 padding
    loss_mask: np.ndarray  # (B, T) float32: 1 where the target is a response token
    advantages: np.ndarray  # (B,) float32
    behavior_logp: np.ndarray  # (B, T) float32: sampler log-probs at loss positions

    @property
    def num_tokens(self) -> int:
        return int(self.loss_mask.sum())


def length_bucket(n: int, minimum: int) -> int:
    b = minimum
    while b < n:
        b *= 2
    return b


def make_batch(
    groups: Sequence[Group],
    advantages: Sequence[Sequence[float]],
    *,
    rows: int,
    min_length_bucket: int = 32,
) -> Batch:
    """Packs the completions of `groups` (one row each) into a Batch.

    Args:
      groups: complete groups.
      advantages: one advantage per completion, group by group.
      rows: the row count is padded up to a multiple of this (padding rows have an all-zero mask).
      min_length_bucket: smallest sequence-length bucket.
    """
    if not groups:
        raise ValueError("make_batch received an empty group list; expected at least one group.")
    if len(advantages) != len(groups):
        raise ValueError(f"Got {len(advantages)} advantage lists for {len(groups)} groups.")
    seqs = []
    for g, adv in zip(groups, advantages, strict=True):
        if len(adv) != len(g.completions):
            raise ValueError(
                f"Group uid={g.request.uid} has {len(g.completions)} completions but "
                f"{len(adv)} advantages."
            )
        for c, a in zip(g.completions, adv, strict=True):
            if len(c.logprobs) != len(c.tokens):
                raise ValueError(
                    f"Completion uid={c.uid} sample={c.sample}: {len(c.tokens)} tokens but "
                    f"{len(c.logprobs)} log-probs."
                )
            seqs.append((c.prompt, c.tokens, c.logprobs, a))
    if not any(tokens for _, tokens, _, _ in seqs):
        raise ValueError(
            f"make_batch: the {len(seqs)} completions hold no response tokens; nothing to train on."
        )
    b = -(-len(seqs) // rows) * rows
    t = length_bucket(max(len(p) + len(r) - 1 for p, r, _, _ in seqs), min_length_bucket)
    out = Batch(
        inputs=np.zeros((b, t), np.int32),
        targets=np.zeros((b, t), np.int32),
        positions=np.zeros((b, t), np.int32),
        segments=np.zeros((b, t), np.int32),
        loss_mask=np.zeros((b, t), np.float32),
        advantages=np.zeros((b,), np.float32),
        behavior_logp=np.zeros((b, t), np.float32),
    )
    for i, (prompt, response, logprobs, adv) in enumerate(seqs):
        seq = np.asarray(prompt + response, np.int32)
        n = len(seq) - 1
        out.inputs[i, :n] = seq[:-1]
        out.targets[i, :n] = seq[1:]
        out.positions[i, :n] = np.arange(n)
        out.segments[i, :n] = 1
        start = len(prompt) - 1
        out.loss_mask[i, start:n] = 1.0
        out.behavior_logp[i, start:n] = logprobs
        out.advantages[i] = adv
    return out
