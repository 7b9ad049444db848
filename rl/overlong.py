"""DAPO's overlong handling, both reading a completion's `finish_reason` ("length": truncated).

- Filter (`learner.overlong_filter`): truncated responses are masked out of the loss (their tokens
  get no gradient); they still count in their group's advantages. The learner applies it.
- Soft overlong punishment (`overlong.cache_tokens` = L_cache > 0): a reward term that is 0 up to
  L_max - L_cache response tokens, falls linearly to -factor at L_max, and is -factor for a
  truncated response (DAPO, arXiv 2503.14476, eq. 13). L_max is the request's max_new_tokens.

    reward_fn = OverlongPenalty(reward_fn, cache_tokens=64, factor=1.0)
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
from collections.abc import Callable

from rl.types import Completion, Request


def overlong_penalty(
    length: int, finish_reason: str, *, max_new_tokens: int, cache_tokens: int, factor: float = 1.0
) -> float:
    """DAPO's soft overlong punishment of one response.

    Args:
      length: response tokens (stop token included).
      finish_reason: "stop" or "length" (truncated at max_new_tokens).
      max_new_tokens: L_max, the response cap.
      cache_tokens: L_cache, the length of the linear ramp before L_max (1 <= L_cache <= L_max).
      factor: the penalty at and past L_max.

    Returns:
      0 if length <= L_max - L_cache; factor * (L_max - L_cache - length) / L_cache up to L_max;
      -factor for a truncated response.
    """
    if not 1 <= cache_tokens <= max_new_tokens:
        raise ValueError(
            f"overlong.cache_tokens must be in [1, max_new_tokens={max_new_tokens}]; received "
            f"{cache_tokens}."
        )
    if finish_reason not in ("stop", "length"):
        raise ValueError(f"finish_reason={finish_reason!r}; expected 'stop' or 'length'.")
    if finish_reason == "length":
        return -factor
    start = max_new_tokens - cache_tokens
    return factor * min(0, start - length) / cache_tokens


@dataclasses.dataclass(frozen=True)
class OverlongPenalty:
    """A reward function plus the soft overlong punishment (L_max: each request's cap).

    Args:
      reward_fn: (request, completion) -> reward.
      cache_tokens: L_cache; every request's max_new_tokens must be >= it.
      factor: the penalty at L_max (DAPO: 1, a wrong answer's distance from a right one).
    """

    reward_fn: Callable[[Request, Completion], float]
    cache_tokens: int
    factor: float = 1.0

    def __post_init__(self) -> None:
        if isinstance(self.cache_tokens, bool) or not (
            isinstance(self.cache_tokens, int) and self.cache_tokens >= 1
        ):
            raise ValueError(
                f"overlong.cache_tokens must be an int >= 1 (0 turns the penalty off); received "
                f"{self.cache_tokens!r}."
            )
        if not (math.isfinite(self.factor) and self.factor >= 0):
            raise ValueError(f"overlong.factor must be finite and >= 0; received {self.factor!r}.")

    def _penalty(self, request: Request, completion: Completion) -> float:
        return overlong_penalty(
            len(completion.tokens),
            completion.finish_reason,
            max_new_tokens=request.params.max_new_tokens,
            cache_tokens=self.cache_tokens,
            factor=self.factor,
        )

    def __call__(self, request: Request, completion: Completion) -> float:
        return float(self.reward_fn(request, completion)) + self._penalty(request, completion)

    @property
    def submit(self) -> Callable[[Request, Completion], concurrent.futures.Future] | None:
        """The wrapped reward's `submit` plus the penalty (sampler.loop scores through it off the
        decode thread), or None when the wrapped reward scores inline only."""
        inner = getattr(self.reward_fn, "submit", None)
        if inner is None:
            return None

        def submit(request: Request, completion: Completion) -> concurrent.futures.Future:
            penalty = self._penalty(request, completion)
            out: concurrent.futures.Future = concurrent.futures.Future()

            def done(f: concurrent.futures.Future) -> None:
                if f.exception() is not None:
                    out.set_exception(f.exception())
                else:
                    out.set_result(float(f.result()) + penalty)

            inner(request, completion).add_done_callback(done)
            return out

        return submit
