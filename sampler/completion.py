"""Finished samples: a decode call's tokens recorded, finished samples settled into groups.

`record` appends each generate call's tokens, log-probs and weight versions to the samples in the
slots, and returns the samples that finished. `score` starts a finished sample's reward (on the
reward workers, or inline). `settle` adds the sample, with its reward's Future, to its run; once the run has `kept` finished samples its group is complete (response
over-provisioning: its unfinished samples are cut and their slots freed) and is emitted once its
rewards are in. Callers of `record` and `settle` hold the loop's lock.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any

import numpy as np

from rl.types import Completion, Request
from sampler.runs import Complete, Run, SlotTable
from sampler.stats import SamplerStats


def record(
    table: SlotTable, result: Any, version: int, stats: SamplerStats
) -> list[tuple[int, Run, int]]:
    """Appends a generate call's tokens (host StepResult, (k, B)) to their samples; returns the
    (slot, run, sample) that finished, in slot order, their slots released."""
    finished = []
    k, b = result.tokens.shape
    stats.generate_calls += 1
    stats.slot_steps += k * b
    stats.tokens += int(np.sum(result.valid))
    for s in range(b):
        run = table.run[s]
        if run is None:
            continue  # free, or aborted while this call ran
        i = table.sample[s]
        sample = run.samples[i]
        for t in range(k):
            if not result.valid[t, s]:
                continue
            sample.tokens.append(int(result.tokens[t, s]))
            sample.logprobs.append(float(result.logprobs[t, s]))
            sample.versions.append(version)
            sample.observed.append(False)
            if result.finished[t, s]:
                table.run[s] = None
                finished.append((s, run, i))
                break
    return finished


def score(
    reward_fn: Any, submit: Any, request: Request, done: Completion
) -> concurrent.futures.Future:
    """The reward's Future: `submit`ted to the reward workers (rl.rewards.RewardRunner.submit, off
    the decode thread), or, with `submit` None, `reward_fn` computed here (inline)."""
    if submit is not None:
        return submit(request, done)
    return resolved(float(reward_fn(request, done)))


def resolved(reward: float) -> concurrent.futures.Future:
    """A reward known now, as the Future the loop settles."""
    future: concurrent.futures.Future = concurrent.futures.Future()
    future.set_result(float(reward))
    return future


def settle(
    table: SlotTable,
    run: Run,
    i: int,
    completion: Completion,
    reward: concurrent.futures.Future,
    stats: SamplerStats,
) -> Complete | None:
    """Records sample i of `run` as finished; returns its group if that made it complete."""
    r = run.request
    if run.aborted:
        return None
    run.done[i] = (completion, reward)
    if len(run.done) < r.kept:
        return None
    run.aborted = True  # emitted: later finishers of this run are dropped
    del table.runs[r.key]
    if r.kept < r.group_size:  # response over-provisioning: cut the unfinished samples
        for j, s in enumerate(run.slots):
            if j not in run.done and s is not None and table.run[s] is run and table.sample[s] == j:
                stats.samples_cut += 1
                stats.cut_sample_tokens += len(run.samples[j].tokens)
        table.release(run)
    return Complete(request=r, done=tuple(run.done[j] for j in sorted(run.done)))
