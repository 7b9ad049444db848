"""Multi-digit addition: "a+b=" -> "c", rewarded 1.0 for the exact sum. Offline, seeded, any tokenizer."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import numpy as np

from rl.models.tokenizer import Tokenizer
from rl.types import Completion, Prompt, Request


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdditionTask:
    digits: int = 3  # operands have 1..digits digits
    seed: int = 0

    def __post_init__(self):
        if not 1 <= self.digits <= 9:
            raise ValueError(f"AdditionTask.digits must be in [1, 9]; received {self.digits}.")

    def problems(self, start_uid: int = 0) -> Iterator[tuple[int, int, int]]:
        """(uid, a, b) forever; the same seed gives the same sequence."""
        rng = np.random.default_rng(self.seed)
        hi = 10**self.digits
        uid = start_uid
        while True:
            a, b = (int(x) for x in rng.integers(0, hi, size=2))
            yield uid, a, b
            uid += 1

    def prompts(self, tokenizer: Tokenizer) -> Iterator[Prompt]:
        for uid, a, b in self.problems():
            yield Prompt(
                uid=uid,
                tokens=tuple(tokenizer.encode(f"{a}+{b}=", add_bos=tokenizer.bos_id is not None)),
                meta={"answer": a + b},
            )


def make_reward(tokenizer: Tokenizer):
    """reward(request, completion) = 1.0 iff the response decodes to the sum (up to end of sequence)."""

    def reward(request: Request, completion: Completion) -> float:
        text = tokenizer.decode(completion.tokens, skip_special_tokens=True).strip()
        return 1.0 if text == str(request.meta["answer"]) else 0.0

    return reward
