"""The learner worker seen from the Driver's process: the Learner's interface over Ray.

`LearnerClient` gives the Driver the Learner's methods over the learner worker group
(rl.runtime.ray_learner.LearnerWorker; one worker per host, rank 0 answers), and while the learner
borrows the replicas' devices runs the same calls in them. Around it, what lives on the worker
handled from here: its params (`RemoteParams`, published by rl.runtime.ray_weights.RaySync, a
WeightSync), the SFT warm start (`RemoteSft`) and checkpoints (`RemoteCheckpoints`); the sampler
replicas it hosts on its devices while it lends them are rl.runtime.ray_host.HostedReplica
handles. A dead worker raises `LearnerDied`, a lender dying while the learner trains on its
devices `LenderDied`: the run stops, resume continues from the last checkpoint.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable
from typing import Any

import ray
from ray.exceptions import RayActorError

from rl.types import Group


class LearnerDied(RuntimeError):
    """The learner worker died: the run stops; resume continues from the last checkpoint."""


def learner_died(e: BaseException) -> LearnerDied:
    """The error that stops the run when a call to the learner worker raised `e` (RayActorError)."""
    return LearnerDied(
        f"The learner worker died ({type(e).__name__}: {str(e).splitlines()[0]}); the run "
        "stopped. Expected it to live: resume with --config.resume=True continues from the last "
        "checkpoint in <workdir>/ckpt."
    )


@dataclasses.dataclass(frozen=True)
class RemoteParams:
    """The learner's params, left where they live (the learner worker)."""

    client: LearnerClient


MIRRORED = ("add_groups", "update", "give_back")  # the lenders' Learner makes these calls too


class LenderDied(RuntimeError):
    """A replica died while the learner trained on its devices: the run stops (resume continues
    from the last checkpoint)."""


class LearnerClient:
    """The Learner's interface over the learner worker group (one worker per host; rank 0 answers).

    With `lenders` (elastic.borrowing learner / both: replicas in the learner's jax.distributed
    job), `borrow` extends the learner's mesh over their devices: each lender joins with the
    learner worker's borrow_snapshot, and until `give_back` every add_groups and update runs in
    the lenders too (the same calls, one SPMD program over the extended mesh). `usable` says
    whether every lender lives (a borrow is declined otherwise).
    """

    def __init__(self, workers: list[Any], lenders: list[Any] = (), *, total_updates: int = 0):
        self.workers, self.lenders = workers, list(lenders)
        self.total_updates = total_updates
        self.borrowing = False
        self.usable: Any = lambda: True
        self._step = self._call("step")

    def _call(self, method: str, *args: Any) -> Any:
        if self.borrowing and method not in (*MIRRORED, "step"):
            raise RuntimeError(
                f"LearnerClient.{method} while the learner borrows the replicas' devices; "
                "expected it after give_back (the driver gives them back before publishing)."
            )
        lenders = self.lenders if self.borrowing and method in MIRRORED else []
        refs = [getattr(w, method).remote(*args) for w in self.workers]
        return self._get(refs, [getattr(r, f"learner_{method}").remote(*args) for r in lenders])

    def _get(self, refs: list[Any], lender_refs: list[Any] = ()) -> Any:
        try:
            out = ray.get(refs)[0]
        except RayActorError as e:
            raise learner_died(e) from None
        try:
            ray.get(list(lender_refs))
        except RayActorError as e:
            raise LenderDied(
                f"A sampler replica died while the learner trained on its devices "
                f"({type(e).__name__}: {str(e).splitlines()[0]}); the run stopped. Expected it "
                "to live: resume with --config.resume=True continues from the last checkpoint."
            ) from None
        return out

    @property
    def step(self) -> int:
        return self._step

    @property
    def params(self) -> RemoteParams:
        return RemoteParams(self)

    @property
    def state(self) -> Any:
        """The TrainState, fetched as host arrays."""
        return self._call("state")

    def begin_round(self, updates: int) -> None:
        self._step = self._call("begin_round", updates)

    def add_groups(
        self, groups: Iterable[Group], *, before_batch: Callable[[], None] | None = None
    ) -> None:
        """The worker accumulates the whole Add in one call, so `before_batch` (async borrowing:
        rl/driver.py) is asked once, before it, not between its micro-batches."""
        if before_batch is not None:
            before_batch()
        self._step = self._call("add_groups", list(groups))

    def update(self) -> dict[str, float]:
        metrics, self._step = self._call("update")
        return metrics

    def publish(self, version: int) -> tuple[Any, int]:
        """(an ObjectRef of the params, the bytes put)."""
        ref, nbytes = self._call("publish", version)
        return ref, nbytes

    def compile_stats(self) -> dict[str, dict[str, float]]:
        return self._call("compile_stats")

    def start_compile_budget(self) -> None:
        self._call("start_compile_budget")

    def export_hf(self, path: str) -> None:
        self._call("export_hf", path)

    # ------------------------------------------------- borrowing the replicas' devices (BiDiRL)

    def prepare_borrow(self, ids: list[int]) -> None:
        """Compiles the extended mesh's steps in the learner worker and in every lender."""
        self._get(
            [self.workers[0].prepare_borrow.remote(ids)],
            [r.learner_prepare.remote(ids, self.total_updates) for r in self.lenders],
        )

    def borrow(self, ids: list[int]) -> None:
        """The learner's mesh extended over the lenders' devices `ids`; declined (borrowing
        stays False) when a lender has died."""
        if not self.usable():
            logging.warning("A replica lending its devices died: the learner does not borrow.")
            return
        snapshot = self._get([self.workers[0].borrow_snapshot.remote()])[0]
        self._get(
            [self.workers[0].borrow.remote(ids, snapshot)],
            [r.learner_borrow.remote(ids, snapshot) for r in self.lenders],
        )
        self.borrowing = True

    def give_back(self) -> None:
        self._call("give_back")
        self.borrowing = False


class RemoteSft:
    """learner.sft.SftTrainer's interface over the learner worker, where the SFT state lives."""

    def __init__(self, learner: LearnerClient, records: list[Any]):
        self.learner = learner
        learner._call("sft_begin", records)

    def step(self) -> None:
        self.learner._call("sft_step")

    def loss(self) -> float:
        return self.learner._call("sft_loss")

    def commit(self) -> None:
        self.learner._call("sft_commit")


class RemoteCheckpoints:
    """Checkpoints written by the learner worker (where the state lives)."""

    def __init__(self, learner: LearnerClient, directory: str):
        self.learner = learner
        learner._call("open_checkpoints", directory)

    def save(self, step: int, meta: dict[str, Any]) -> None:
        self.learner._call("save", step, meta)

    def restore(self, *, strict: bool) -> dict[str, Any]:
        meta = self.learner._call("restore", strict)
        self.learner._step = self.learner._call("step")
        return meta

    def close(self) -> None:
        try:
            self.learner._call("close_checkpoints")
        except LearnerDied:
            pass  # the error that stopped the run is what the caller sees
