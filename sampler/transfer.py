"""A migrating request's handoff as host data, for a move between processes (Ray replicas).

`SamplerLoop.handoff` gives a Handoff whose decode state lives on the source engine's devices and
whose finished samples may still have rewards running (Futures). `to_host` waits for those rewards
and copies the state to host arrays (PRNG keys as their raw data, with their implementation's
name), so the result pickles into the object store; `from_host` rebuilds the Handoff in the
destination's process, where `Engine.import_slots` places the arrays on that engine's devices.
The moved samples go on with the tokens they would have produced (a slot's random stream is its
request's and sample's).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses

import jax

from sampler.migration import Handoff
from sampler.slot_export import SlotState


@dataclasses.dataclass(frozen=True)
class HostHandoff:
    """A Handoff with nothing tied to a process.

    Attributes:
      run: the request's bookkeeping, its finished samples' rewards resolved (`rewards`).
      samples: the running sample indices, in the order of `state`'s rows.
      state: the decode state as numpy arrays; `keys` holds the PRNG keys' raw data.
      key_impl: the keys' PRNG implementation (jax.random.key_impl).
      rewards: finished sample index -> its reward.
    """

    run: object
    samples: tuple[int, ...]
    state: SlotState
    key_impl: str
    rewards: dict[int, float]

    @property
    def nbytes(self) -> int:
        return self.state.nbytes


def to_host(handoff: Handoff) -> HostHandoff:
    """`handoff` as host data; waits for the rewards of its finished samples (a reward's error is
    raised here, as it would be when the group is emitted)."""
    run = handoff.run
    rewards = {i: float(f.result()) for i, (_, f) in run.done.items()}
    completions = {i: c for i, (c, _) in run.done.items()}
    state = handoff.state
    key_impl = str(jax.random.key_impl(state.keys))
    host = jax.device_get(dataclasses.replace(state, keys=jax.random.key_data(state.keys)))
    return HostHandoff(
        run=dataclasses.replace(run, done=completions),
        samples=handoff.samples,
        state=host,
        key_impl=key_impl,
        rewards=rewards,
    )


def from_host(host: HostHandoff) -> Handoff:
    """The Handoff `to_host` made, for `SamplerLoop.adopt` in this process."""
    done = {}
    for i, completion in host.run.done.items():
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.set_result(host.rewards[i])
        done[i] = (completion, future)
    keys = jax.random.wrap_key_data(host.state.keys, impl=host.key_impl)
    return Handoff(
        run=dataclasses.replace(host.run, done=done),
        samples=host.samples,
        state=dataclasses.replace(host.state, keys=keys),
    )
