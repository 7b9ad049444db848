"""EnvRunner: an Environment's steps on worker threads, each with a timeout.

The reward runner's machinery (rl.rewards.RewardRunner): `workers` steps run at once, off the
decode thread; a step that raises, returns something other than a valid Turn
(rl.envs.base.check_turn) or runs past `timeout_s` ends its episode with a turn reward of 0.0 and
is counted (`stats()`), the first of each kind logged. So a hung tool or a hostile answer costs
one episode its reward, never the run.
"""

from __future__ import annotations

import concurrent.futures
import functools
from typing import Any

from rl.envs.base import Environment, Transcript, Turn, check_turn
from rl.rewards.runner import RewardRunner
from rl.types import Request

ENDED = Turn(observation=(), reward=0.0, done=True)  # what a failed step gives


def _as_is(transcript: Transcript) -> Transcript:
    return transcript


class EnvRunner:
    """Runs `env.step` with a timeout; see the module docstring.

    Args:
      env: the environment.
      vocab_size: the model's vocabulary (an observation token outside it is invalid).
      max_turns: the model's turns per episode at most (the episode ends after the last).
      timeout_s: how long one step may take.
      workers: steps run at once.
    """

    def __init__(
        self,
        env: Environment,
        *,
        vocab_size: int,
        max_turns: int,
        timeout_s: float = 5.0,
        workers: int = 4,
    ):
        if isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < 1:
            raise ValueError(f"max_turns must be an int >= 1; received {max_turns!r}.")
        self.env, self.max_turns = env, max_turns
        self._runner = RewardRunner(
            env.step,
            decode=_as_is,
            timeout_s=timeout_s,
            workers=workers,
            check=functools.partial(check_turn, vocab_size=vocab_size),
            failure=ENDED,
            what="Environment",
            expected="a Turn: observation tokens in [0, vocab_size), a finite reward, and an "
            "observation unless done",
        )

    def submit(self, request: Request, transcript: Transcript) -> concurrent.futures.Future:
        """A Future of the Turn answering the transcript's last turn (ENDED on failure)."""
        return self._runner.submit_call(request, transcript)

    def stats(self) -> dict[str, int]:
        """Counters: calls, errors, timeouts, stuck, replaced (as RewardRunner.stats)."""
        return self._runner.stats()

    def close(self) -> None:
        self._runner.close()

    def __enter__(self) -> EnvRunner:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
