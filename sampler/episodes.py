"""Multi-turn episodes in the sampler loop: samples between turns, and their observations in.

With an environment (rl/envs), a sample whose decode stops does not finish: its turn goes to the
environment (`EnvRunner.submit`, off the decode thread) and its slot stays held, inactive on the
engine, its KV cache kept. At a later step boundary, once the environment has answered, the
sample either goes on (the observation's tokens appended to its response, marked observed, and
to its KV cache by `Engine.extend`; a sample whose cache predates a weight swap it waited through
with recompute_kv is re-prefilled whole instead) or finishes, its reward the sum of its turns'.
An episode finishes when the environment says done, after env.max_turns turns, when a turn ran
out of response tokens (it ended on length, not on its stop token), or when the observation does
not fit: the response budget (max_new_tokens, observations included) must leave room for at least
one more token, and an observation is at most the engine's max_prefill_length.

Whatever the order environments answer in, a sample's tokens are the same: its random stream
goes by position, and each row's floats are its own. Callers hold the loop's lock for
`turn_ended` and `settle`, not for `wait`.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses

from rl.envs import EnvRunner, Transcript, Turn
from sampler.runs import Run, SlotTable
from sampler.stats import SamplerStats

WAIT_S = 0.05  # how long an idle loop waits for an environment before it looks again


@dataclasses.dataclass(frozen=True)
class Waiting:
    """A sample between turns: its slot, and the environment's answer to come."""

    slot: int
    run: Run
    sample: int
    turn: concurrent.futures.Future


@dataclasses.dataclass(frozen=True)
class Resume:
    """A sample that goes on: its slot, what `Engine.extend` feeds, and whether to re-prefill."""

    slot: int
    run: Run
    sample: int
    fed: tuple[int, ...]
    last: int
    reprefill: bool


class Episodes:
    """The samples of one loop that wait for their environment; see the module docstring."""

    def __init__(self, runner: EnvRunner, *, max_observation: int):
        self.runner = runner
        self.max_observation = max_observation  # the engine's max_prefill_length
        self.waiting: list[Waiting] = []  # in the order their turns ended

    def turn_ended(self, table: SlotTable, slot: int, run: Run, i: int) -> None:
        """Sample i of `run` stopped in `slot` (released by the decode's record): it holds the
        slot again and its turn goes to the environment."""
        sample = run.samples[i]
        table.run[slot], table.sample[slot] = run, i
        run.waiting.add(i)
        transcript = Transcript.of(sample.tokens, sample.observed)
        self.waiting.append(Waiting(slot, run, i, self.runner.submit(run.request, transcript)))

    def settle(
        self, table: SlotTable, version: int, stats: SamplerStats
    ) -> tuple[list[Resume], list[tuple[int, Run, int]]]:
        """The samples whose environment answered: those that go on (observation appended to
        their tokens), and those that finished, (slot, run, sample), their slots released."""
        resume, finished, left = [], [], []
        for w in self.waiting:
            if not w.turn.done():
                left.append(w)
                continue
            run, i = w.run, w.sample
            run.waiting.discard(i)
            if run.aborted or table.run[w.slot] is not run or table.sample[w.slot] != i:
                continue  # aborted, or cut by its group's completion: its slot is freed already
            turn: Turn = w.turn.result()
            sample = run.samples[i]
            sample.turn_rewards.append(turn.reward)
            stats.env_turns += 1
            if self._goes_on(run, i, turn):
                stop = sample.tokens[-1]
                obs = turn.observation
                sample.tokens.extend(obs)
                sample.logprobs.extend([0.0] * len(obs))
                sample.versions.extend([version] * len(obs))
                sample.observed.extend([True] * len(obs))
                stats.observation_tokens += len(obs)
                fed = (stop, *obs[:-1])
                resume.append(Resume(w.slot, run, i, fed, obs[-1], sample.stale))
                sample.stale = False
            else:
                table.run[w.slot] = None  # inactive on the engine since its turn ended
                table.ended.append(w.slot)
                finished.append((w.slot, run, i))
        self.waiting = left
        return resume, finished

    def _goes_on(self, run: Run, i: int, turn: Turn) -> bool:
        sample, p = run.samples[i], run.request.params
        stopped = bool(sample.tokens) and sample.tokens[-1] in p.stop_token_ids
        room = p.max_new_tokens - len(sample.tokens) - len(turn.observation)
        return (
            not turn.done
            and stopped
            and len(sample.turn_rewards) < self.runner.max_turns
            and room >= 1
            and len(turn.observation) <= self.max_observation
        )

    def wait(self) -> None:
        """Blocks a little while for the first environment answer (the loop has nothing else)."""
        futures = [w.turn for w in self.waiting]
        if futures:
            concurrent.futures.wait(futures, timeout=WAIT_S, return_when="FIRST_COMPLETED")
