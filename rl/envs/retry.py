"""The "retry" environment: a checker tool that says whether an answer is right, and lets the
model try again.

Each of the model's turns is checked with the task's reward (config.task.reward, on the turn's
text alone). A right answer (reward >= 1) ends the episode with that reward; a wrong one is
answered with `feedback` followed by the question again (the request's prompt tokens, as they
are), and the model answers anew, up to env.max_turns turns. The episode's return is 1 when some
turn is right, so the policy learns to answer again differently after "wrong" rather than repeat
itself. With one turn it is the single-turn task.
"""

from __future__ import annotations

from typing import Any

from rl.envs.base import Transcript, Turn, register_environment
from rl.rewards.registry import TextRewardFn
from rl.types import Request


@register_environment("retry")
class Retry:
    """The checker tool (module docstring).

    Args:
      tokenizer: the run's tokenizer (encodes `feedback` once; decodes each turn for the check).
      reward: the task's reward, `reward(request, text) -> float`.
      feedback: the text of the checker's answer to a wrong turn.
      restate: follow the feedback with the question again (the request's prompt).
    """

    def __init__(
        self, *, tokenizer: Any, reward: TextRewardFn, feedback: str = "no:", restate: bool = True
    ):
        self.decode, self.reward, self.restate = tokenizer.decode, reward, restate
        self.feedback = tuple(tokenizer.encode(feedback))
        if not self.feedback and not restate:
            raise ValueError(
                "env 'retry': feedback is empty and restate is False, so a wrong answer would be "
                "answered with no tokens; expected a feedback text or restate=True."
            )

    def step(self, request: Request, transcript: Transcript) -> Turn:
        score = float(self.reward(request, self.decode(transcript.turns[-1])))
        if score >= 1.0:
            return Turn(reward=score, done=True)
        question = request.prompt if self.restate else ()
        return Turn(observation=self.feedback + tuple(question), reward=0.0, done=False)
