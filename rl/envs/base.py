"""Multi-turn environments: what the model's turns are answered with, and the registry of them.

An episode is one sample of a request: the model writes a turn (up to a stop token), the
environment `step`s on it and answers with a `Turn`: observation tokens, the turn's reward, and
whether the episode is done. Unless it is, the sampler appends the observation to the sample's KV
cache as it stands (token-in/token-out: nothing is decoded and re-tokenized) and the model writes
its next turn after it. The sample's response is then every turn and observation in order; the
observation tokens carry zero loss weight (`Completion.observation_mask`), and its reward is the
episode's return, the sum of its turns' rewards.

`step` is a pure function of the request and the transcript so far, with no state kept between
calls: an episode can move to another replica (migration, Ray) or be replayed after a resume and
get the same observations. (Where the issue's `reset(prompt) -> tokens` would build the first
prompt, the task's prompt is used as it is: the G episodes of a group share its one prefill.)

    @register_environment("mine")
    class Mine:
        def __init__(self, *, tokenizer, reward, **options): ...
        def step(self, request, transcript) -> Turn: ...

and `--config.env.name=mine` (options: `--config.env.<option>`, passed to the constructor).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, Protocol

from rl.registry import Registry
from rl.types import Request


@dataclasses.dataclass(frozen=True)
class Turn:
    """The environment's answer to one of the model's turns."""

    observation: tuple[int, ...] = ()  # tokens appended after the turn (required unless done)
    reward: float = 0.0  # this turn's reward; the episode's is the sum over its turns
    done: bool = True  # the episode ends here (it also ends at env.max_turns or out of tokens)


@dataclasses.dataclass(frozen=True)
class Transcript:
    """An episode so far: the model's turns, each up to and with its stop token, and the
    observations between them (one fewer than the turns); the last turn just ended."""

    turns: tuple[tuple[int, ...], ...]
    observations: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, tokens: list[int], observed: list[bool]) -> Transcript:
        """Splits a response into the model's turns and the observations between them."""
        turns: list[tuple[int, ...]] = []
        observations: list[tuple[int, ...]] = []
        run: list[int] = []
        for i, (token, obs) in enumerate(zip(tokens, observed, strict=True)):
            run.append(token)
            if i + 1 == len(tokens) or observed[i + 1] != obs:
                (observations if obs else turns).append(tuple(run))
                run = []
        return cls(turns=tuple(turns), observations=tuple(observations))


class Environment(Protocol):
    def step(self, request: Request, transcript: Transcript) -> Turn:
        """Answers the transcript's last turn (a pure function of its arguments)."""


# factory(tokenizer=..., reward=<the task's TextRewardFn>, **config.env options) -> Environment
EnvFactory = Callable[..., Environment]

ENVIRONMENTS: Registry[EnvFactory] = Registry("environment")
register_environment = ENVIRONMENTS.register


def check_turn(value: Any, vocab_size: int) -> Turn | None:
    """`value` as a valid Turn (a Turn, or an (observation, reward, done) tuple), or None: token
    ids in [0, vocab_size), a finite reward, and an observation unless the episode is done."""
    if isinstance(value, tuple) and len(value) == 3:
        value = Turn(observation=tuple(value[0]), reward=value[1], done=value[2])
    if not isinstance(value, Turn):
        return None
    try:
        reward = float(value.reward)
        observation = tuple(int(t) for t in value.observation)
    except (TypeError, ValueError, OverflowError):
        return None
    if not math.isfinite(reward) or not isinstance(value.done, (bool, int)):
        return None
    if any(not 0 <= t < vocab_size for t in observation) or (not value.done and not observation):
        return None
    return Turn(observation=observation, reward=reward, done=bool(value.done))
