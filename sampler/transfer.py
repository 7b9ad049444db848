"""A migrating request's handoff, or an evicted run, as host data, for a move between processes
(Ray replicas).

`SamplerLoop.handoff` gives a Handoff whose decode state lives on the source engine's devices and
whose finished samples may still have rewards running (Futures). `to_host` waits for those rewards
and copies the state to host arrays (PRNG keys as their raw data, with their implementation's
name), so the result pickles into the object store; `from_host` rebuilds the Handoff in the
destination's process, where `Engine.import_slots` places the arrays on that engine's devices.
The moved samples go on with the tokens they would have produced (a slot's random stream is its
request's and sample's). A run evicted from a replica taken back mid-rollout (`SamplerLoop.evict`)
travels the same way without a decode state (`run_to_host`, `run_from_host`): the loop it resumes on
re-prefills it with its tokens so far.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses

import jax

from sampler.migration import Handoff
from sampler.runs import Run
from sampler.slot_export import SlotState


@dataclasses.dataclass(frozen=True)
class HostRun:
    """A Run with nothing tied to a process: its finished samples' rewards resolved.

    Attributes:
      run: the Run, its `done` holding the finished samples' Completions (no Futures).
      rewards: finished sample index -> its reward.
    """

    run: Run
    rewards: dict[int, float]


def run_to_host(run: Run) -> HostRun:
    """`run` as host data; waits for the rewards of its finished samples (a reward's error is
    raised here, as it would be when the group is emitted)."""
    rewards = {i: float(f.result()) for i, (_, f) in run.done.items()}
    completions = {i: c for i, (c, _) in run.done.items()}
    return HostRun(dataclasses.replace(run, done=completions), rewards)


def run_from_host(host: HostRun) -> Run:
    """The Run `run_to_host` made, in this process (its rewards as resolved Futures)."""
    done = {}
    for i, completion in host.run.done.items():
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.set_result(host.rewards[i])
        done[i] = (completion, future)
    return dataclasses.replace(host.run, done=done)


@dataclasses.dataclass(frozen=True)
class HostHandoff:
    """A Handoff with nothing tied to a process.

    Attributes:
      run: the request's bookkeeping as host data.
      samples: the running sample indices, in the order of `state`'s rows.
      state: the decode state as numpy arrays; `keys` holds the PRNG keys' raw data.
      key_impl: the keys' PRNG implementation (jax.random.key_impl).
    """

    run: HostRun
    samples: tuple[int, ...]
    state: SlotState
    key_impl: str

    @property
    def nbytes(self) -> int:
        return self.state.nbytes


def to_host(handoff: Handoff) -> HostHandoff:
    """`handoff` as host data (`run_to_host`: waits for its finished samples' rewards)."""
    state = handoff.state
    key_impl = str(jax.random.key_impl(state.keys))
    host = jax.device_get(dataclasses.replace(state, keys=jax.random.key_data(state.keys)))
    return HostHandoff(
        run=run_to_host(handoff.run), samples=handoff.samples, state=host, key_impl=key_impl
    )


def from_host(host: HostHandoff) -> Handoff:
    """The Handoff `to_host` made, for `SamplerLoop.adopt` in this process."""
    keys = jax.random.wrap_key_data(host.state.keys, impl=host.key_impl)
    return Handoff(
        run=run_from_host(host.run),
        samples=host.samples,
        state=dataclasses.replace(host.state, keys=keys),
    )
