"""What no policy can beat on a simulated run: the bounds the comparisons print beside their figures.

pooling_bound    borrowing: a static split's device-seconds over the device-seconds its devices
                 worked (moving devices only fills idle ones).
predrain_bound   a round-mode learner borrowing each sampler replica as it goes idle, before the
                 rollout drains, over one borrowing them all once it has drained.
overlap_bound    cgp: a trainer taking each group the moment it arrives.
"""

from __future__ import annotations

import math

import numpy as np

from rl.sim.simulator import SimResult


def pooling_bound(result: SimResult, *, learner_devices: int, replica_devices: int = 1) -> float:
    """The most any moving of devices between the learner and the sampler could gain over this
    static-split run: its device-seconds over the device-seconds its devices worked (a sampler
    replica counts as working while any of its slots runs). Borrowing only fills the idle ones,
    so a run that borrows is at most this many times faster, with free switches."""
    t = result.end_s
    sampler = result.config.replicas * replica_devices
    busy = (
        learner_devices * result.counters["learner_busy_s"]
        + replica_devices * result.counters["replica_busy_s"]
    )
    return (learner_devices + sampler) * t / busy if busy > 0 else math.nan


def predrain_bound(result: SimResult, *, learner_devices: int, replica_devices: int = 1) -> float:
    """The most a round-mode learner that borrowed each sampler replica the moment it went idle,
    before the rollout drains, could gain over one that borrows them all once it has drained
    (rl.elastic.borrowing's rule), as a throughput ratio (>= 1), with free switches.

    Per round: replicas go idle at their last slot span's end, e_1 <= ... <= e_R (the drain). A
    learner operation running in [e_i, e_i+1) with i replicas lent would save its overlap x (1 -
    L / (L + i x replica_devices)) (data parallel over L + those devices, per-token terms only:
    an upper bound); work saved before the drain shortens what is left after it, which runs on
    all L + R x replica_devices devices: at most saved x L / (L + S) of wall time, and never more
    than that after-drain work itself (in sync the learner has nothing to do before the drain,
    so the bound is 1). NaN under async, whose rollout does not drain each round."""
    if result.config.mode == "async":
        return math.nan
    timeline, total, gain = result.timeline, 0.0, 0.0
    lanes: dict[tuple[int, int], float] = {}
    slots = result.config.slots
    for s in timeline.spans("sampler/slot"):
        key = (int(s.args["round"]), int(s.lane[len("sampler/slot") :]) // slots)
        lanes[key] = max(lanes.get(key, -math.inf), s.end)
    learner = timeline.spans("learner")
    L, S = learner_devices, result.config.replicas * replica_devices
    for i, _ in enumerate(result.rounds):
        ends = sorted(t for (r, _), t in lanes.items() if r == i)
        start = min(s.start for s in timeline.spans("sampler/prefill") if s.args["round"] == i)
        end = max(s.end for s in timeline.spans("publish") if s.args.get("round") == i)
        drain, saved = ends[-1], 0.0
        for x in learner:
            for n, (a, b) in enumerate(zip(ends, ends[1:], strict=False), start=1):
                overlap = max(0.0, min(x.end, b) - max(x.start, a))
                saved += overlap * (1 - L / (L + n * replica_devices))
        after = sum(max(0.0, min(x.end, end) - max(x.start, drain)) for x in learner)
        gain += min(after * L / (L + S), saved * L / (L + S))
        total += end - start
    return total / (total - gain) if total > gain else math.inf


def overlap_bound(result: SimResult) -> float:
    """The least mean rollout-to-train-end a trainer could reach on this run's group arrivals: one
    that trains each group the moment it arrives, each at the mean learner time per group of the
    round (its micro-steps and updates), so round r ends no earlier than max over its groups k
    (in arrival order) of arrival_k + (groups from k on) x that mean, counted from the round's
    first prefill. cgp's reduction vs sync cannot beat 1 - this / sync's."""
    timeline, out = result.timeline, []
    for i, _ in enumerate(result.rounds):
        arrivals = sorted(e.t for e in timeline.instants("sampler/groups") if e.args["round"] == i)
        learner = [s for s in timeline.spans("learner") if s.args.get("round") == i]
        start = min(s.start for s in timeline.spans("sampler/prefill") if s.args["round"] == i)
        per_group = sum(s.end - s.start for s in learner) / len(arrivals)
        n = len(arrivals)
        out.append(max(a + (n - k) * per_group for k, a in enumerate(arrivals)) - start)
    return float(np.mean(out))
