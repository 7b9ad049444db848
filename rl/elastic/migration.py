"""Long-tail migration (JigsawRL): which running requests move to which sampler replica.

A pure, clock-free policy shared by the threaded replica sampler (rl.runtime.replicas) and the
simulator (rl.sim.sampler). At a decode-step boundary the runtime describes every replica
(`ReplicaView`: slots, free slots, its KV pages when paged, queued work, the requests running
there) and asks
`policy.moves(views)`; it gets `Move`s back and executes those whose source is the replica at its
boundary (a replica only gives work away between its own decode steps).

The unit of a move is a request (one group, `(round, uid)`): all its samples still running on the
source move together, KV cache and sampling state included, into free slots of the destination,
and the group completes there. Moving whole groups keeps a group's bookkeeping (tokens so far,
rewards in flight) on one replica; a group whose samples are not all started (per-sample
admission) or that was just adopted and has not decoded yet is not movable (`RunningView.movable`).

Paged KV (sampler/paged.py, rl/sim/paging.py): a paged replica runs many slots on a pool of
pages, so its pages, not its slots, are what runs out. A move fits a destination only if its free
slots take the request's sequences and its free pages (`ReplicaView.free_pages`: not held, not
owed to its swapped-out sequences or to moves on their way) take their KV (`RunningView.kv_pages`,
their live positions in pages) plus a margin: `grow_tokens` more positions for every sequence the
destination would then run, its own and the moved ones (each capped by its request's tokens_left),
so that a consolidated tail does not overflow the pool in its next `grow_tokens` decode steps and
swap sequences to host (each swapped one stops decoding until pages free up). A dense replica
(`pages` 0) has no page limit: its slots reserve their KV.

Policies (`make_migration_policy`, names in MIGRATION_POLICIES):
  off     never moves anything.
  tail    when a round's tail leaves little running (at most `max_running_fraction` of all slots
          and, on paged replicas, of all KV pages in use; no replica with queued work) spread over
          more replicas than needed to hold it, it empties the least-loaded replicas into the
          most-loaded ones (first fit, largest group first) that have the slots and pages (with
          the margin above). A replica is emptied only if every movable request on it fits and
          none is unmovable; requests with fewer than `min_tokens_left` tokens to go (when known)
          stay.
          With `on_demand` (a multiplexed pool: rl/sim/multiplex.py) it never consolidates by
          itself; instead an idle replica (one that joined from another pipeline) takes up to
          half the sequences of the most-loaded one, the requests with the most tokens left
          first, and a replica the pool recalls (`ReplicaView.leaving`, any `tail`) is emptied
          into the others with room, whatever the round's stage.
  always  every movable request moves to the next replica (in index order, wrapping) with the
          slots and pages for its KV (no margin), at every opportunity: the exactness test's
          forcing mode.

A consumer: consolidating a tail does not make it faster (each move adds the moved KV cache to
the destination's decode steps, which read it every step), it frees replicas. That pays only if
the freed replicas get work the static split would not have done: another pipeline's (JigsawRL's
multiplexing: rl/sim/multiplex.py turns `tail` on), or a learner that trains on part of the
sampler before the rollout drains. Neither exists in one pipeline, and the simulator at paper
scale shows what is left there: in round modes
`tail` gave 0.68-0.71x the static split's groups/s; under async 0.77-0.92x, because the next
requests a freed replica takes would have gone to the other replicas' free slots anyway (work
stealing, rl/runtime/replicas.py); a learner that borrows only a drained sampler took nothing
from it (0.59-0.63x). So `make_migration_policy` gives Off for `tail` unless the caller has a
consumer (`consumer=True`; the simulator's comparisons force it to measure what consolidating
costs).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol

MIGRATION_POLICIES = ("off", "tail", "always")
Key = tuple[int, int]  # a request's (round, uid)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunningView:
    """A request running on a replica, as the policy sees it.

    Attributes:
      key: the request's (round, uid).
      sequences: its samples running in slots there (the slots a move needs on the destination).
      tokens_left: the most tokens any of them may still produce (max_new_tokens - produced); an
        upper bound, None when unknown.
      movable: False for a request with unstarted samples or one not yet decoded after adoption.
      kv_pages: the KV pages its running sequences would take on a destination (their live
        positions in pages, at the pipeline's page size); 0 from a dense replica.
    """

    key: Key
    sequences: int
    tokens_left: int | None = None
    movable: bool = True
    kv_pages: int = 0

    def __post_init__(self):
        if self.sequences < 1 or self.kv_pages < 0:
            raise ValueError(
                f"RunningView {self.key}: expected sequences >= 1 and kv_pages >= 0; received "
                f"sequences={self.sequences}, kv_pages={self.kv_pages}."
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReplicaView:
    """One replica at a step boundary.

    Attributes:
      slots: its engine slots (0: the replica serves another pipeline now).
      free: slots a move may fill now (not running, not being freed or reserved).
      queued: whether requests wait for admission there.
      running: the requests running there.
      pages: its KV pool in pages; 0: a dense cache (its slots alone limit it).
      free_pages: pages a move may fill now: not held, nor owed to its swapped-out sequences or
        to moves on their way here.
      page: positions per page (0 when dense).
      leaving: the replica is wanted elsewhere (a multiplexed pool recalls it): `tail` moves
        what runs there to the others, whatever the round's stage.
    """

    slots: int
    free: int
    queued: bool = False
    running: tuple[RunningView, ...] = ()
    pages: int = 0
    free_pages: int = 0
    page: int = 0
    leaving: bool = False

    def __post_init__(self):
        used = sum(r.sequences for r in self.running)
        if self.slots < 0 or not 0 <= self.free <= self.slots - used:
            raise ValueError(
                f"ReplicaView: expected slots >= 0 and 0 <= free <= slots - running sequences; "
                f"received slots={self.slots}, free={self.free}, running sequences={used}."
            )
        if not 0 <= self.free_pages <= self.pages or (self.pages > 0) != (self.page > 0):
            raise ValueError(
                "ReplicaView: expected 0 <= free_pages <= pages and page > 0 exactly when paged "
                f"(pages > 0); received pages={self.pages}, free_pages={self.free_pages}, "
                f"page={self.page}."
            )

    @property
    def sequences(self) -> int:
        return sum(r.sequences for r in self.running)

    @property
    def paged(self) -> bool:
        return self.pages > 0

    def growth(self, run: RunningView, grow_tokens: int) -> int:
        """Pages `run`'s sequences take here to grow `grow_tokens` more positions each (capped by
        its tokens_left); 0 when dense."""
        if not self.paged:
            return 0
        grow = grow_tokens if run.tokens_left is None else min(grow_tokens, run.tokens_left)
        return run.sequences * -(-grow // self.page)

    def need(self, run: RunningView, grow_tokens: int = 0) -> int:
        """Free pages a move of `run` here needs: its KV and that growth; 0 when dense."""
        return run.kv_pages + self.growth(run, grow_tokens) if self.paged else 0


@dataclasses.dataclass(frozen=True)
class Move:
    """Request `key`'s running samples go from replica `src` to replica `dst`."""

    key: Key
    src: int
    dst: int


class MigrationPolicy(Protocol):
    def moves(self, replicas: Sequence[ReplicaView]) -> list[Move]:
        """The moves to make now (empty: none); at most one per request, into free slots."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class MigrationConfig:
    """config.elastic: the policy name and the `tail` thresholds."""

    policy: str = "off"  # off | tail | always
    max_running_fraction: float = 0.25  # tail: running sequences <= this * all slots
    min_tokens_left: int = 0  # tail: a request closer than this to its end (if known) stays
    grow_tokens: int = 512  # tail, paged KV: a destination keeps pages for this many more
    # positions per sequence it runs (module docstring)
    on_demand: bool = False  # tail: consolidate only replicas the pool recalls, and spread onto
    # idle replicas (a multiplexed pool's setting: rl/sim/multiplex.py)

    def __post_init__(self):
        if self.policy not in MIGRATION_POLICIES:
            raise ValueError(
                f"elastic.migration={self.policy!r}; expected one of {MIGRATION_POLICIES}."
            )
        if not 0 < self.max_running_fraction <= 1:
            raise ValueError(
                "elastic.max_running_fraction must be in (0, 1]; received "
                f"{self.max_running_fraction}."
            )
        if self.min_tokens_left < 0:
            raise ValueError(
                f"elastic.min_tokens_left must be >= 0; received {self.min_tokens_left}."
            )
        if self.grow_tokens < 0:
            raise ValueError(f"elastic.grow_tokens must be >= 0; received {self.grow_tokens}.")


class Off:
    """Never migrates."""

    def moves(self, replicas: Sequence[ReplicaView]) -> list[Move]:
        return []


class Always:
    """Every movable request moves to the next replica with room (the forcing mode)."""

    def moves(self, replicas: Sequence[ReplicaView]) -> list[Move]:
        free = [r.free for r in replicas]
        pages = [r.free_pages for r in replicas]
        out = []
        n = len(replicas)
        for i, rep in enumerate(replicas):
            for run in rep.running:
                if not run.movable:
                    continue
                for step in range(1, n):
                    j = (i + step) % n
                    need = replicas[j].need(run)
                    if free[j] >= run.sequences and pages[j] >= need:
                        free[j] -= run.sequences
                        pages[j] -= need
                        out.append(Move(run.key, i, j))
                        break
        return out


@dataclasses.dataclass(frozen=True)
class Tail:
    """Consolidates a round's tail onto the fewest replicas; see the module docstring."""

    config: MigrationConfig

    def moves(self, replicas: Sequence[ReplicaView]) -> list[Move]:
        busy = [i for i, r in enumerate(replicas) if r.running]
        if any(replicas[i].leaving for i in busy):
            return self._evacuate(replicas, busy)
        if not busy or any(r.queued for r in replicas):
            return []
        if self.config.on_demand:
            return self._spread(replicas, busy)
        if len(busy) < 2 or not self._few(replicas):
            return []
        grow = self.config.grow_tokens
        free, pages = self._room(replicas)
        # Keep the most-loaded replicas; empty the least-loaded first (fewest bytes move).
        order = sorted(busy, key=lambda i: (replicas[i].sequences, -i))
        out: list[Move] = []
        emptied: set[int] = set()
        received: set[int] = set()  # a replica that takes work is not emptied after
        for src in order:
            runs = replicas[src].running
            if src in received or any(not self._movable(r) for r in runs):
                continue
            targets = [i for i in busy if i != src and i not in emptied]
            trial, trial_pages, plan = list(free), list(pages), []
            for run in sorted(runs, key=lambda r: (-r.sequences, r.key)):
                dst = next(
                    (
                        j
                        for j in sorted(targets, key=lambda j: (-replicas[j].sequences, j))
                        if trial[j] >= run.sequences
                        and trial_pages[j] >= replicas[j].need(run, grow)
                    ),
                    None,
                )
                if dst is None:
                    break
                trial[dst] -= run.sequences
                trial_pages[dst] -= replicas[dst].need(run, grow)
                plan.append(Move(run.key, src, dst))
            else:
                free, pages, emptied = trial, trial_pages, emptied | {src}
                received |= {m.dst for m in plan}
                out.extend(plan)
            if len(emptied) >= len(busy) - 1:
                break
        return out

    def _room(self, replicas: Sequence[ReplicaView]) -> tuple[list[int], list[int]]:
        """Each replica's free slots, and its free pages less what its own sequences take to grow
        `grow_tokens` positions (what a move there may fill)."""
        grow = self.config.grow_tokens
        free = [r.free for r in replicas]
        pages = [r.free_pages - sum(r.growth(x, grow) for x in r.running) for r in replicas]
        return free, pages

    def _evacuate(self, replicas: Sequence[ReplicaView], busy: list[int]) -> list[Move]:
        """Every movable request on a leaving replica goes to the staying replica with the most
        free slots that holds it (and its pages with the growth margin)."""
        grow = self.config.grow_tokens
        stay = [i for i, r in enumerate(replicas) if r.slots and not r.leaving]
        free, pages = self._room(replicas)
        out: list[Move] = []
        for src in (i for i in busy if replicas[i].leaving):
            runs = [r for r in replicas[src].running if r.movable]
            for run in sorted(runs, key=lambda r: (-r.sequences, r.key)):
                fits = [
                    j
                    for j in stay
                    if free[j] >= run.sequences and pages[j] >= replicas[j].need(run, grow)
                ]
                if not fits:
                    continue
                dst = max(fits, key=lambda j: (free[j], -j))
                free[dst] -= run.sequences
                pages[dst] -= replicas[dst].need(run, grow)
                out.append(Move(run.key, src, dst))
        return out

    def _spread(self, replicas: Sequence[ReplicaView], busy: list[int]) -> list[Move]:
        """on_demand: each idle replica (nothing running, queued or arriving: one that just
        joined from another pipeline) takes up to half the sequences of the most-loaded one, the
        requests with the most tokens left first, so that both decode steps read half the KV."""
        idle = [
            i
            for i, r in enumerate(replicas)
            if r.slots and r.free == r.slots and not r.running and not r.leaving
        ]
        grow = self.config.grow_tokens
        out: list[Move] = []
        sources = sorted(busy, key=lambda i: (-replicas[i].sequences, i))
        for dst, src in zip(idle, sources, strict=False):  # the busiest sources first
            rep, to = replicas[src], replicas[dst]
            free = to.free
            pages = to.free_pages
            budget = rep.sequences // 2
            runs = [r for r in rep.running if self._movable(r)]
            for run in sorted(runs, key=lambda r: (-(r.tokens_left or 0), r.key)):
                need = to.need(run, grow)
                if run.sequences > min(budget, free) or need > pages:
                    continue
                budget, free, pages = budget - run.sequences, free - run.sequences, pages - need
                out.append(Move(run.key, src, dst))
        return out

    def _few(self, replicas: Sequence[ReplicaView]) -> bool:
        """Little runs: at most max_running_fraction of all slots hold sequences and, on the
        paged replicas, of all their pages are in use (free_pages: the rest)."""
        cap = self.config.max_running_fraction
        if sum(r.sequences for r in replicas) > cap * sum(r.slots for r in replicas):
            return False
        used = sum(r.pages - r.free_pages for r in replicas)
        return used <= cap * sum(r.pages for r in replicas)

    def _movable(self, run: RunningView) -> bool:
        left = run.tokens_left
        return run.movable and (left is None or left >= self.config.min_tokens_left)


def make_migration_policy(config: MigrationConfig, *, consumer: bool = False) -> MigrationPolicy:
    """The policy `config.policy` names; `tail` only with a consumer for the replicas it frees
    (module docstring: none in one pipeline), else Off. `always`, the forcing mode, moves
    regardless."""
    if config.policy == "tail":
        return Tail(config) if consumer else Off()
    if config.policy == "always":
        return Always()
    return Off()


def check_moves(replicas: Sequence[ReplicaView], moves: Sequence[Move]) -> None:
    """Raises ValueError unless `moves` is executable on `replicas`: each names a movable request
    running on its source, at most once, and the destinations' free slots and free pages (paged)
    hold what arrives (its KV; the growth margin is the policy's, not checked here)."""
    running = {
        (i, run.key): run for i, rep in enumerate(replicas) for run in rep.running if run.movable
    }
    free = [r.free for r in replicas]
    pages = [r.free_pages for r in replicas]
    seen = set()
    for m in moves:
        run = running.get((m.src, m.key))
        if run is None or m.key in seen or not 0 <= m.dst < len(replicas) or m.dst == m.src:
            raise ValueError(
                f"Migration move {m} is not executable: expected a movable request running on "
                f"replica {m.src}, moved once, to another of the {len(replicas)} replicas."
            )
        seen.add(m.key)
        free[m.dst] -= run.sequences
        pages[m.dst] -= replicas[m.dst].need(run)
        if free[m.dst] < 0 or pages[m.dst] < 0:
            raise ValueError(
                f"Migration moves overfill replica {m.dst} ({replicas[m.dst].free} free slots, "
                f"{replicas[m.dst].free_pages} free KV pages)."
            )
