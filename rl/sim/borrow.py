"""Borrowing in the simulator: rl.elastic.borrowing's policy, its moves carried out on the clock.

The Simulator calls `check(now)` whenever the learner is between operations or the sampler turns
busy or idle, and `before_publish(now)` before a Publish; in round modes (sync, cgp), once per
round and direction, the policy decides from the simulator's state (PoolState: the sequences left
and their tokens from the workload's known lengths, so the sampler side is an oracle estimate where
the runtime has to guess; the learner's queued work and the round's groups not yet trained).

  learner borrows   the rollout has drained and updates remain: a "borrow" span of the switch cost
                    on the learner lane, then the per-token learner work left in the round (queued
                    and future) runs L / (L + S) as long; back to 1 at the round's Publish.
  sampler borrows   decided at the round's Submit (`before_submit`), as the runtime's lender
                    decides before it routes the round: `extra` replicas (learner devices / tp)
                    join and the submission waits half the switch cost, so the round spreads over
                    them; the learner's work waits; when the sampler drains they leave and the
                    learner resumes after the other half ("lend" span on the "elastic" lane).

Under async (BiDiRL's setting) both directions borrow, as in the runtime. The sampler: once per
update, while the learner waits for its next batch, the policy decides from that batch's groups
still sampling and the sequences queued (PoolState.ahead); the extra replicas join after half the
switch, and once the batch is complete (its update queued) they are taken back mid-rollout
(SimSampler.evict_replicas: what ran there is re-queued and re-prefilled with the tokens it made)
and the learner resumes after the other half. The learner: once the staleness bound has drained
the sampler, for the update it trains (`_borrow_drained`), back at the publish.

The switch cost is the policy's estimate (the configured prior; the simulator records each switch
at that cost, so it stays the prior).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from rl.elastic.borrowing import BorrowPolicy, Decision, PoolState
from rl.sim.learner import LearnerOp
from rl.sim.simulator import PoolHooks, Simulator
from rl.types import Request


class SimBorrower(PoolHooks):
    """Carries out a BorrowPolicy's moves in a Simulator; see the module docstring.

    Args:
      policy: the borrowing policy (its model's learner terms are for `learner_devices`).
      learner_devices: devices of the learner (L).
      replica_devices: devices per sampler replica (tp); the sampler has cfg.replicas of them.
    """

    def __init__(self, policy: BorrowPolicy, *, learner_devices: int, replica_devices: int = 1):
        if learner_devices < 1 or replica_devices < 1:
            raise ValueError(
                f"learner_devices and replica_devices must be >= 1; received {learner_devices}, "
                f"{replica_devices}."
            )
        self.policy, self.learner_devices, self.tp = policy, learner_devices, replica_devices
        self.sim: Simulator | None = None
        self.metrics: dict[int, dict[str, float]] = {}  # round -> decision metrics
        self.moves = {"learner": 0, "sampler": 0}
        self._decided: set[tuple[int, str]] = set()
        self._learner_round: int | None = None  # the round whose learner runs on borrowed devices
        self._lent: tuple[int, int, float] | None = None  # (round, extra replicas, since)
        self._submitting = False  # lent before a round's submission, which has not come yet

    def attach(self, sim: Simulator) -> None:
        if sim.cfg.routing != "shared" and self.policy.cfg.allows("sampler"):
            raise ValueError("Sampler borrowing in the simulator needs routing 'shared'.")
        self.sim = sim

    # ------------------------------------------------------------------------------- state

    def _round(self) -> int | None:
        sim = self.sim
        assert sim is not None
        open_rounds = sim.open_rounds()
        return open_rounds[0] if open_rounds else None

    def _state(self, r: int, waiting: bool, submitting: Sequence[Request] = ()) -> PoolState:
        """The pool now; `submitting`: requests about to be submitted (counted as pending)."""
        sim = self.sim
        assert sim is not None
        m, cfg = sim.model, sim.cfg
        seqs, tokens, longest, context = sim.sampler.remaining(submitting=submitting)
        queued = sum(op.scalable for op in sim.learner.ops)
        per_token = m.learner_per_token * sim.learner.scale
        learner_tokens = (queued / per_token if per_token else 0.0) + sim.round_tokens_unadded(r)
        learner_tokens += sim.sampler.remaining_learner_tokens(submitting)
        updates_left = max(sim.updates_planned - sim.updates_done(r), 0)
        rows = updates_left * cfg.groups_per_update * cfg.group_size
        return PoolState(
            learner_devices=self.learner_devices,
            sampler_replicas=cfg.replicas,
            replica_devices=self.tp,
            slots=cfg.slots,
            sequences=seqs,
            tokens_left=tokens,
            longest_left=longest,
            context=context,
            updates_left=updates_left,
            micro_batches_left=math.ceil(rows / max(m.micro_batch_rows, 1)),
            learner_tokens_left=learner_tokens,
            learner_waiting=waiting,
            overlap=cfg.mode != "sync",
        )

    def _record(self, r: int, d: Decision) -> None:
        self.metrics.setdefault(r, {}).update(d.metrics())

    # --------------------------------------------------------------------------- decisions

    def check(self, now: float) -> None:
        """Decides (once per round and direction) and moves; see the module docstring."""
        sim = self.sim
        assert sim is not None
        if sim.cfg.mode == "async":
            self._check_ahead(now)
            return
        if sim.learner.op is not None:
            return
        r = self._round()
        if r is None:
            return
        if self._lent is not None:
            if not self._submitting and not sim.sampler.outstanding and not sim.sampler.busy:
                self._return_sampler(now)
            return
        if self._learner_round is not None:
            return
        drained = not sim.sampler.outstanding
        if drained and (r, "learner") not in self._decided and self.policy.cfg.allows("learner"):
            if not sim.learner.ops:
                return  # nothing queued yet: decide when the learner has work
            self._decided.add((r, "learner"))
            d = self.policy.decide(self._state(r, waiting=False))
            self._record(r, d)
            if d.move:
                self._borrow_learner(r, d, now)

    def before_submit(self, round: int, requests: Sequence[Request], now: float) -> float:
        """Round modes, as the runtime's lender (SamplerLender.maybe_lend, before it routes the
        round): the sampler direction is decided once per round for the requests about to be
        submitted; on a move the extra replicas join and the submission waits half the switch,
        so the round spreads over them. Returns that wait."""
        sim = self.sim
        assert sim is not None
        if (
            sim.cfg.mode == "async"
            or self._lent is not None
            or self._learner_round is not None
            or (round, "sampler") in self._decided
            or not self.policy.cfg.allows("sampler")
        ):
            return 0.0
        self._decided.add((round, "sampler"))
        d = self.policy.decide(self._state(round, waiting=True, submitting=requests))
        if d.direction != "sampler":
            return 0.0
        self._record(round, d)
        if not d.move:
            return 0.0
        extra = d.devices // self.tp
        sim.learner.blocked = True
        sim.sampler.add_replicas(extra, now)  # idle until the round arrives
        self._lent, self._submitting = (round, extra, now), True
        self.moves["sampler"] += 1
        return d.switch_cost_s / 2

    def on_submit(self, now: float) -> None:
        self._submitting = False

    def _check_ahead(self, now: float) -> None:
        """async: lend while the learner waits for its next batch; take back once it is complete.
        Borrow the sampler's devices for an update once the staleness bound has drained it."""
        sim = self.sim
        assert sim is not None
        if self._lent is not None:
            if any(op.name == "update" for op in sim.learner.ops):
                self._return_sampler(now)
            return
        nxt = sim.schedule.updates_done
        if self._learner_round is not None:
            return
        if not sim.sampler.outstanding:
            self._borrow_drained(nxt, now)
            return
        busy = sim.learner.op is not None or sim.learner.ops
        if busy or (nxt, "sampler") in self._decided:
            return
        if not self.policy.cfg.allows("sampler"):
            return
        self._decided.add((nxt, "sampler"))
        r = self._round()
        if r is None:
            return
        d = self.policy.decide(self._ahead_state())
        if d.direction == "sampler":
            self._record(r, d)
            if d.move:
                self._lend_to_sampler(r, d, now)

    def _borrow_drained(self, update: int, now: float) -> None:
        """async: nothing is sampling (the staleness bound holds the next requests until this
        update is published) and the update's work is queued: the learner may borrow the idle
        sampler until the publish, as in a round mode once the rollout has drained."""
        sim = self.sim
        assert sim is not None
        ops = sim.learner.ops
        if (
            (update, "learner") in self._decided
            or not self.policy.cfg.allows("learner")
            or not any(op.name in ("micro_step", "update") for op in ops)
        ):
            return
        r = self._round()
        if r is None:
            return
        self._decided.add((update, "learner"))
        m, cfg = sim.model, sim.cfg
        per_token = m.learner_per_token * sim.learner.scale
        scalable = sim.learner.scalable_left(now)  # the operation in flight's rest included
        state = PoolState(
            learner_devices=self.learner_devices,
            sampler_replicas=cfg.replicas,
            replica_devices=self.tp,
            slots=cfg.slots,
            updates_left=1,
            micro_batches_left=sum(op.name == "micro_step" for op in ops),
            learner_tokens_left=scalable / per_token if per_token else 0.0,
        )
        d = self.policy.decide(state)
        self._record(r, d)
        if d.move:
            self._borrow_learner(r, d, now)

    def _ahead_state(self) -> PoolState:
        """async: the next update's groups still sampling, and the sequences waiting for a slot."""
        sim = self.sim
        assert sim is not None
        cfg = sim.cfg
        missing = sim.schedule.next_batch_missing()
        seqs, tokens, longest, context = sim.sampler.remaining(lambda r: r.key in missing)
        return PoolState(
            learner_devices=self.learner_devices,
            sampler_replicas=cfg.replicas,
            replica_devices=self.tp,
            slots=cfg.slots,
            sequences=seqs,
            tokens_left=tokens,
            longest_left=longest,
            context=context,
            updates_left=1,
            learner_waiting=True,
            ahead=True,
            queued=sim.sampler.queued,
        )

    def _borrow_learner(self, r: int, d: Decision, now: float) -> None:

        sim = self.sim
        assert sim is not None
        f = self.learner_devices / (self.learner_devices + d.devices)
        for op in sim.learner.ops:
            op.work -= op.scalable * (1 - f)
            op.scalable *= f
        sim.learner.scale = f
        if sim.learner.op is not None:  # async: between two micro-batches of the one in flight
            sim.learner.stretch(f, d.switch_cost_s, now)
        else:
            switch = LearnerOp("borrow", d.switch_cost_s, dict(round=r), scalable=0.0)
            sim.learner.ops.insert(0, switch)
        self._learner_round = r
        self.moves["learner"] += 1

    def _lend_to_sampler(self, r: int, d: Decision, now: float) -> None:
        sim = self.sim
        assert sim is not None
        extra = d.devices // self.tp
        sim.learner.blocked = True
        lend = self._lent = (r, 0, now)  # no replica joined yet
        self.moves["sampler"] += 1

        def join(t: float) -> None:
            if self._lent is not lend:  # taken back during the switch (async)
                return
            if sim.sampler.outstanding:
                sim.sampler.add_replicas(extra, t)
                self._lent = (r, extra, now)
            else:  # the rollout ended during the switch
                self._return_sampler(t)

        sim.at(now + d.switch_cost_s / 2, join)

    def _return_sampler(self, now: float) -> None:
        sim = self.sim
        assert sim is not None and self._lent is not None
        r, extra, since = self._lent
        self._lent = None
        if extra and sim.cfg.mode == "async":  # taken back mid-rollout
            sim.sampler.evict_replicas(extra, now)
        elif extra:
            sim.sampler.remove_replicas(extra)
        cost = self.policy.switch["sampler"].estimate
        self.policy.record_switch("sampler", cost)
        back = now + cost / 2
        sim.timeline.span("elastic", "lend", since, back, round=r, replicas=extra)

        def resume(t: float) -> None:
            sim.learner.blocked = False
            sim.learner.resume(t)

        sim.at(back, resume)

    def before_publish(self, now: float) -> None:
        """The learner's borrowed devices return before the weights are published."""
        sim = self.sim
        assert sim is not None
        if self._learner_round is not None:
            self._learner_round = None
            sim.learner.scale = 1.0
            self.policy.record_switch("learner", self.policy.switch["learner"].estimate)

    def round_metrics(self, r: int) -> dict[str, Any]:
        return dict(self.metrics.get(r, {}))
