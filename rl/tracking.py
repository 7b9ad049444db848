"""Weights & Biases tracking (config.log.wandb): a run's metrics, config, summary and pictures.

    tracking = tracking_config_from(config)   # config.log, checked (rl.config_check calls it too)
    with open_tracker(tracking, workdir=w, config=config, resume=False) as tracker:  # None: off
        writer = MetricsWriter(w, tracker=tracker)     # each write() is also one tracker.log()
        ...
        tracker.log_final(summary, pictures=[f"{w}/timeline.png", f"{w}/learning_curve.png"])

Rows: each `MetricsWriter.write(step, metrics, prefix)` is one W&B row of keys "prefix/key" and
"prefix/step" (the step), declared the x axis of that prefix's keys (`define_metric`), so the
series of "train" rounds and "sft" steps do not collide on W&B's own row counter. Non-finite values
are left out, as in TensorBoard. The config goes in flat ("learner.optimizer.lr"), summary.json's
dict becomes the W&B summary, and the run's pictures are logged as images.

A resumed run continues the same W&B run: its id is kept in workdir/wandb_run_id and passed with
resume="allow". W&B cannot delete logged rows, so the rows a resume rewinds from metrics.jsonl and
TensorBoard (rounds after the checkpoint, run again) stay there: those steps show twice.

wandb is an optional dependency (pip install -e ".[wandb]"), imported here only when tracking is
on. W&B's local files go to workdir/wandb, or to $WANDB_DIR when it is set; an offline run
(wandb_mode "offline", or $WANDB_MODE) needs no network and uploads later with `wandb sync`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
from collections.abc import Iterable, Mapping
from typing import Any

from rl.sections import from_section

WANDB_MODES = ("", "online", "offline", "disabled")  # "": $WANDB_MODE, else W&B's default
RUN_ID_FILE = "wandb_run_id"  # in the workdir: the W&B run a resumed run continues
WANDB_MISSING = (
    'config.log.wandb=True but wandb is not installed; expected it: pip install -e ".[wandb]"'
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrackingConfig:
    """config.log: where a run's metrics go besides metrics.jsonl and TensorBoard."""

    wandb: bool = False  # log to Weights & Biases
    wandb_project: str = "rolloutpipe"
    wandb_entity: str = ""  # "": the W&B default entity of the logged-in user
    wandb_mode: str = ""  # one of WANDB_MODES
    wandb_name: str = ""  # the run's display name; "": the workdir's basename

    def __post_init__(self) -> None:
        if not isinstance(self.wandb, bool):
            raise ValueError(f"config.log.wandb={self.wandb!r}; expected True or False.")
        for name in ("wandb_project", "wandb_entity", "wandb_mode", "wandb_name"):
            value = getattr(self, name)
            if not isinstance(value, str):
                raise ValueError(f"config.log.{name}={value!r}; expected a string.")
        if self.wandb_mode not in WANDB_MODES:
            raise ValueError(
                f"config.log.wandb_mode={self.wandb_mode!r}; expected one of {WANDB_MODES} "
                "('': $WANDB_MODE, else online)."
            )
        if self.wandb and not self.wandb_project.strip():
            raise ValueError(
                f"config.log.wandb_project={self.wandb_project!r}; expected a W&B project name."
            )


def tracking_config_from(config: Mapping[str, Any]) -> TrackingConfig:
    """config.log as a TrackingConfig (defaults when the config has no `log` section)."""
    return from_section(TrackingConfig, config.get("log"), name="log")


def wandb_installed() -> bool:
    """Whether `import wandb` would find the package (nothing is imported)."""
    return importlib.util.find_spec("wandb") is not None


def flat_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """A nested config's leaves by dotted path: {"learner.optimizer.lr": 1e-06, ...}."""
    out: dict[str, Any] = {}

    def walk(node: Mapping[str, Any], path: str) -> None:
        for key, value in node.items():
            name = f"{path}.{key}" if path else str(key)
            if hasattr(value, "items"):
                walk(value, name)
            else:
                out[name] = value

    walk(config.to_dict() if hasattr(config, "to_dict") else config, "")
    return out


class WandbTracker:
    """One W&B run: the writer's rows (`log`), the results (`log_final`); finished on exit.

    Used as a context manager: leaving it finishes the W&B run, marked failed (exit code 1) when
    an exception is leaving too.
    """

    def __init__(self, run: Any, wandb: Any) -> None:
        self.run = run
        self._wandb = wandb
        self._defined: set[str] = set()  # keys whose x axis is declared

    @classmethod
    def start(
        cls,
        tracking: TrackingConfig,
        *,
        workdir: str | os.PathLike,
        config: Mapping[str, Any],
        resume: bool,
    ) -> WandbTracker:
        """Starts (or, with `resume`, continues) the workdir's W&B run.

        Args:
          tracking: config.log (its `wandb` need not be True: the caller decides).
          workdir: the run's workdir (exists): wandb_run_id, and W&B's files without $WANDB_DIR.
          config: the run's config, logged flat.
          resume: continue the W&B run named in workdir/wandb_run_id, if any; else a new one.

        Raises:
          ImportError: wandb is not installed (the message names the extra to install).
        """
        try:
            import wandb  # an optional dependency: only a run that tracks needs it
        except ImportError as e:
            raise ImportError(WANDB_MISSING) from e
        workdir = os.fspath(workdir)
        id_path = os.path.join(workdir, RUN_ID_FILE)
        run_id = None
        if resume and os.path.isfile(id_path):
            with open(id_path, encoding="utf-8") as f:
                run_id = f.read().strip() or None
        # $WANDB_MODE and $WANDB_DIR are read here, at each start: W&B itself reads the
        # environment once per process (a notebook's second run would miss a change).
        run = wandb.init(
            project=tracking.wandb_project,
            entity=tracking.wandb_entity or None,
            name=tracking.wandb_name or os.path.basename(os.path.abspath(workdir)),
            mode=tracking.wandb_mode or os.environ.get("WANDB_MODE") or None,  # None: online
            dir=os.environ.get("WANDB_DIR") or workdir,
            id=run_id,
            resume="allow" if run_id else None,
            config=flat_config(config),
            reinit="create_new",  # beside a W&B run of the caller's own (a notebook), not over it
        )
        with open(id_path, "w", encoding="utf-8") as f:
            f.write(run.id)
        return cls(run, wandb)

    def log(self, step: int, values: Mapping[str, float | None], prefix: str = "") -> None:
        """One row: "prefix/key" for each finite value and "prefix/step" = step, its x axis."""
        join = (lambda k: f"{prefix}/{k}") if prefix else (lambda k: k)
        step_key = join("step")
        row = {join(k): v for k, v in values.items() if v is not None}
        for key in row.keys() - self._defined:
            self.run.define_metric(key, step_metric=step_key)
            self._defined.add(key)
        self.run.log({step_key: int(step), **row})

    def log_final(self, summary: Mapping[str, Any], pictures: Iterable[str] = ()) -> None:
        """summary.json's dict as the W&B summary; each picture that exists as an image."""
        images = {
            os.path.splitext(os.path.basename(path))[0]: self._wandb.Image(path)
            for path in pictures
            if os.path.isfile(path)
        }
        if images:
            self.run.log(images)
        self.run.summary.update(dict(summary))

    def close(self, failed: bool = False) -> None:
        """Finishes the W&B run (uploads what is left, online); later calls do nothing."""
        if self.run is not None:
            run, self.run = self.run, None
            run.finish(exit_code=1 if failed else 0)

    def __enter__(self) -> WandbTracker:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self.close(failed=exc_type is not None)


def open_tracker(
    tracking: TrackingConfig,
    *,
    workdir: str | os.PathLike,
    config: Mapping[str, Any],
    resume: bool,
) -> contextlib.AbstractContextManager[WandbTracker | None]:
    """A WandbTracker with `tracking.wandb` (see `WandbTracker.start`), else a context of None."""
    if not tracking.wandb:
        return contextlib.nullcontext()
    return WandbTracker.start(tracking, workdir=workdir, config=config, resume=resume)
