"""Per-round pipeline metrics from a Timeline (rl/metrics_writer.py writes them out).

Clock-free like the Timeline: every time comes from the caller (seconds), so the simulator's
virtual clock works too. Definitions (RolloutPipe, arXiv 2606.26997), for round r started at
`rollout_start` (t0); "the round's spans" are those with args round == r:

    rollout_s              t0 -> end of the round's last sampler slot span (last sequence done)
    rollout_to_train_end_s t0 -> end of the round's last learner "update" span
    first_dispatch_s       t0 -> start of the round's first learner span (micro_step or update)
    trainer_wait_s         time in the window [t0, train end] the learner lane is not busy
    trainer_compute_s      time in that window the learner lane is busy (its spans merged)
    trainer_wait_ratio     wait / (wait + compute) = wait / rollout_to_train_end_s
    slot_occupancy         busy slot-seconds in [t0, rollout end] / (num_slots * rollout_s)
    sampler_tokens_per_s   sum of the round's slot spans' "tokens" / rollout_s
    learner_tokens_per_s   tokens trained in the round / the round's learner busy time (merged)

The utilization metrics (trainer_wait/compute/ratio, slot_occupancy) look at the lanes over the
round's window whatever round the work belongs to: a learner busy with round r-1 inside round r's
window is not waiting (in synchronous rounds only round r's work falls in the window). Busy time
is the union of the lane's spans, so a micro_step inside an update counts once. Tokens trained:
per optimizer step, the update span's "tokens" (it covers its micro steps), or the sum of that
step's micro_step "tokens" when the update carries none (or has not happened yet). A micro_step
belongs to the update with the same "step" arg; without one, to the first update ending at or
after it. A metric whose spans are missing (no update yet, say) is NaN (null in the JSONL).

With several sampler replicas, slot spans carry args["replica"], and `replica_metrics` gives
replica{i}_slot_occupancy and replica{i}_tokens_per_s over each replica's own rollout window
[t0, end of its last sequence of the round]. A sequence that migrated (rl.elastic.migration) has a
slot span per replica it ran on, the earlier ones marked args["migrated"]; `sequences` counts it
once, tokens add up. `migration_metrics` sums the round's "migrate" spans: migrations (requests
moved), migrated_sequences, migrated_bytes (decode state moved) and migration_s (time spent).

Borrowing (rl.elastic.borrowing, config.elastic.borrowing): a round the policy decided in carries
borrow_{d} (1 moved, 0 not), borrow_{d}_gain_s (the predicted seconds saved), borrow_{d}_switch_cost_s
(the estimate it was weighed against) and borrow_{d}_measured_s (the switch there and back, NaN if
none), d = learner | sampler (Decision.metrics, rl.runtime.lending). The switches are spans too:
"borrow" and "give_back" on the learner lane (learner busy: counted in trainer_compute_s, not in
first_dispatch_s), "lend" on the "elastic" lane.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import numpy as np

from rl.timeline import SLOT_PREFIX, Span, Timeline, lane_group

LEARNER_LANE = "learner"
LEARNER_SPANS = ("micro_step", "update")
NAN = float("nan")


def _union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Merges overlapping or touching intervals; returns them sorted and disjoint."""
    merged: list[tuple[float, float]] = []
    for lo, hi in sorted(intervals):
        if merged and lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return merged


def _busy(spans: Iterable[Span], lo: float = -math.inf, hi: float = math.inf) -> float:
    """Length of the union of the spans, clipped to [lo, hi]."""
    clipped = [(max(s.start, lo), min(s.end, hi)) for s in spans]
    return sum(b - a for a, b in _union((a, b) for a, b in clipped if b > a))


def _div(num: float, den: float) -> float:
    return num / den if den > 0 and math.isfinite(num) and math.isfinite(den) else NAN


def _tokens(spans: Iterable[Span]) -> float:
    return float(sum(s.args.get("tokens") or 0 for s in spans))


def _learner_tokens(learner: list[Span]) -> float:
    """Per step: the update's tokens, else the sum of its micro steps' tokens."""
    updates = sorted((s for s in learner if s.name == "update"), key=lambda s: s.end)
    key = lambda s: s.args.get("step", ("span", id(s)))
    steps: dict[Any, list[Span]] = {}
    for s in learner:
        if s.name == "micro_step" and "step" not in s.args:  # the update that ends next owns it
            owner = next((u for u in updates if u.end >= s.end), s)
            steps.setdefault(key(owner), []).append(s)
        else:
            steps.setdefault(key(s), []).append(s)
    total = 0.0
    for spans in steps.values():
        updates = [s for s in spans if s.name == "update" and s.args.get("tokens") is not None]
        total += _tokens(updates) if updates else _tokens(s for s in spans if s.name != "update")
    return total


def round_metrics(
    timeline: Timeline, *, round: int, rollout_start: float, num_slots: int
) -> dict[str, float]:
    """Pipeline metrics of one round; see the module docstring for the definitions.

    Args:
      timeline: the run's Timeline (lanes as documented in rl.timeline).
      round: which round (spans' args["round"]).
      rollout_start: when the round's rollout started, in the timeline's clock (seconds).
      num_slots: the sampler's engine slots.

    Returns:
      Floats keyed by metric name (NaN where the spans needed are missing), plus counts
      sequences, updates, sampler_tokens and learner_tokens.
    """
    if num_slots < 1:
        raise ValueError(f"num_slots must be >= 1; received {num_slots}.")
    if not math.isfinite(rollout_start):
        raise ValueError(f"rollout_start must be a finite time; received {rollout_start}.")
    spans = timeline.spans(since=rollout_start)  # nothing ending earlier counts below
    mine = [s for s in spans if s.args.get("round") == round]
    if not mine:
        rounds = sorted({s.args["round"] for s in timeline.spans() if "round" in s.args}, key=str)
        raise ValueError(f"No spans with round={round} in the timeline; rounds present: {rounds}.")
    by_slot: dict[str, list[Span]] = {}
    for s in spans:
        if s.lane.startswith(SLOT_PREFIX):
            by_slot.setdefault(s.lane, []).append(s)
    if len(by_slot) > num_slots:
        raise ValueError(
            f"The timeline has {len(by_slot)} sampler slot lanes; expected at most "
            f"num_slots={num_slots}."
        )
    on_learner = [s for s in spans if lane_group(s.lane) == LEARNER_LANE]
    learner = [s for s in mine if lane_group(s.lane) == LEARNER_LANE and s.name in LEARNER_SPANS]
    slots = [s for s in mine if s.lane.startswith(SLOT_PREFIX)]
    updates = [s for s in learner if s.name == "update"]

    rollout_end = max((s.end for s in slots), default=NAN)
    train_end = max((s.end for s in updates), default=NAN)
    rollout_s = rollout_end - rollout_start
    window = train_end - rollout_start
    compute = _busy(on_learner, rollout_start, train_end) if window > 0 else NAN
    slot_busy = sum(_busy(lane, rollout_start, rollout_end) for lane in by_slot.values())
    sampler_tokens, learner_tokens = _tokens(slots), _learner_tokens(learner)
    return {
        "rollout_s": rollout_s,
        "rollout_to_train_end_s": window,
        "first_dispatch_s": min((s.start for s in learner), default=NAN) - rollout_start,
        "trainer_wait_s": window - compute,
        "trainer_compute_s": compute,
        "trainer_wait_ratio": _div(window - compute, window),
        "slot_occupancy": _div(slot_busy, num_slots * rollout_s),
        "sampler_tokens_per_s": _div(sampler_tokens, rollout_s),
        "learner_tokens_per_s": _div(learner_tokens, _busy(learner)),
        "sequences": float(sum(not s.args.get("migrated") for s in slots)),
        "updates": float(len(updates)),
        "sampler_tokens": sampler_tokens,
        "learner_tokens": learner_tokens,
    }


def publish_metrics(timeline: Timeline, *, round: int, rollout_start: float) -> dict[str, float]:
    """The round's weight publishes ("publish" spans with args round == r): publish_s, their
    summed wall time, and publish_mb, what they moved (args "bytes"; a LoRA run moves only its
    adapters, a colocated publish that shares the learner's arrays moves nothing)."""
    spans = [
        s for s in timeline.spans("publish", since=rollout_start) if s.args.get("round") == round
    ]
    return {
        "publish_s": float(sum(s.duration for s in spans)),
        "publish_mb": float(sum(s.args.get("bytes", 0) for s in spans)) / 2**20,
    }


def replica_metrics(
    timeline: Timeline, *, round: int, rollout_start: float, replica_slots: tuple[int, ...]
) -> dict[str, float]:
    """Per-replica slot occupancy and tokens/s of one round (slot spans' args["replica"]).

    Args:
      timeline: the run's Timeline.
      round: which round.
      rollout_start: when the round's rollout started (seconds, the timeline's clock).
      replica_slots: engine slots of each replica, by replica index.
    """
    spans = [s for s in timeline.spans(since=rollout_start) if s.lane.startswith(SLOT_PREFIX)]
    out = {}
    for i, slots in enumerate(replica_slots):
        lanes: dict[str, list[Span]] = {}
        for s in spans:
            if s.args.get("replica") == i:
                lanes.setdefault(s.lane, []).append(s)
        mine = [s for lane in lanes.values() for s in lane if s.args.get("round") == round]
        end = max((s.end for s in mine), default=NAN)
        busy = sum(_busy(lane, rollout_start, end) for lane in lanes.values())
        out[f"replica{i}_slot_occupancy"] = _div(busy, slots * (end - rollout_start))
        out[f"replica{i}_tokens_per_s"] = _div(_tokens(mine), end - rollout_start)
        out[f"replica{i}_sequences"] = float(len(mine))
    return out


def migration_metrics(timeline: Timeline, *, round: int, rollout_start: float) -> dict[str, float]:
    """The round's long-tail migrations: its "migrate" spans (any sampler lane) summed.

    Args:
      timeline: the run's Timeline.
      round: which round (the moved requests' round).
      rollout_start: when the round's rollout started (seconds, the timeline's clock).
    """
    moves = [
        s
        for s in timeline.spans(since=rollout_start)
        if s.name == "migrate" and lane_group(s.lane) == "sampler" and s.args.get("round") == round
    ]
    return {
        "migrations": float(len(moves)),
        "migrated_sequences": float(sum(s.args.get("sequences", 0) for s in moves)),
        "migrated_bytes": float(sum(s.args.get("bytes", 0) for s in moves)),
        "migration_s": float(sum(s.duration for s in moves)),
    }


def staleness_metrics(groups: Iterable[Any], version: int) -> dict[str, float]:
    """Version lag of an update's tokens: `version` (the params updated) minus the version that
    produced each token (Completion.versions); mean and max over the tokens (NaN without versions).

    Args:
      groups: the update's Groups.
      version: the version of the params the update starts from.
    """
    lags = [version - v for g in groups for c in g.completions for v in c.versions]
    if not lags:
        return {"lag_mean": NAN, "lag_max": NAN}
    return {"lag_mean": float(sum(lags)) / len(lags), "lag_max": float(max(lags))}


def episode_metrics(completions: Iterable[Any]) -> dict[str, float]:
    """Multi-turn rollouts (rl/envs): turns per episode, the first turn's reward (what a
    single-turn run would have scored) and observation tokens per episode; {} when single-turn."""
    episodes = [c for c in completions if c.turn_rewards]
    if not episodes:
        return {}
    return {
        "turns_mean": float(np.mean([len(c.turn_rewards) for c in episodes])),
        "first_turn_reward_mean": float(np.mean([c.turn_rewards[0] for c in episodes])),
        "observation_tokens_mean": float(np.mean([sum(c.observation_mask) for c in episodes])),
    }
