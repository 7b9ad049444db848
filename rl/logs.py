"""Where a run's logging goes: the library chatter to a log file, the console kept for the run.

    quiet_console()                             # first: nothing chatters from here on
    ...                                         # check the config and data, decide the workdir
    flush_held_to(os.path.join(workdir, "run.log"))   # what was held back, and all after it
    to_file_only(traceback.format_exc())        # a traceback for the file alone

launch.train calls `quiet_console`; rl.run.train calls `flush_held_to` once the workdir may be
written (a run stopped by a bad config or data file leaves no trace in it), which does nothing
when nobody asked for a quiet console (a Colab cell keeps its logging). The console then shows the progress bars, the metrics lines and
the final table (stdout), plus warnings and errors of this project and of the user's own code
(stderr); INFO lines, everything installed libraries log (orbax's "CheckpointManager created ...",
JAX's backend probing) and Python warnings go to the file only. `verbose=True` shows everything on
the console too.
"""

from __future__ import annotations

import logging
import os
import sysconfig

from absl import logging as absl_logging

_LIBRARIES = tuple(
    os.path.realpath(p)
    for p in {sysconfig.get_paths()[k] for k in ("purelib", "platlib", "stdlib", "platstdlib")}
)
MAX_HELD = 10_000  # records held back before the log file is known; later ones are dropped


class _ConsoleFilter(logging.Filter):
    """Passes warnings and errors unless they come from an installed library or the stdlib."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return False
        return not os.path.realpath(record.pathname).startswith(_LIBRARIES)


class _Held(logging.Handler):
    """Keeps records until the log file exists (the config is checked before it is created)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if len(self.records) < MAX_HELD:
            self.records.append(record)


_state: dict[str, logging.Handler | None] = {"held": None, "file": None}


def quiet_console(*, verbose: bool = False) -> None:
    """Keeps INFO lines and library logging off the console; holds them for `log_to_file`.

    Args:
      verbose: keep showing everything on the console (INFO and up, libraries included).
    """
    root = logging.getLogger()
    root.setLevel(min(root.level or logging.INFO, logging.INFO))
    absl_logging.set_verbosity(absl_logging.INFO)
    console = absl_logging.get_absl_handler()
    for f in [f for f in console.filters if isinstance(f, _ConsoleFilter)]:
        console.removeFilter(f)
    if not verbose:
        console.addFilter(_ConsoleFilter())
    if _state["held"] is None and _state["file"] is None:
        _state["held"] = _Held()
        root.addHandler(_state["held"])
    logging.captureWarnings(True)


def log_to_file(path: str | os.PathLike, *, verbose: bool | None = None) -> str:
    """Sends all logging (INFO and up) to `path`, appended, starting with what was held back.

    Args:
      path: the log file; its directory is created.
      verbose: show every INFO line on the console too; None: as `quiet_console` was told.

    Returns:
      The log file's path.
    """
    if verbose is not None or _state["held"] is None:
        quiet_console(verbose=bool(verbose))
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    root = logging.getLogger()
    to_file = logging.FileHandler(path, mode="a", encoding="utf-8")
    to_file.setFormatter(absl_logging.PythonFormatter())
    to_file.setLevel(logging.INFO)
    held, old = _state["held"], _state["file"]
    if held is not None:
        root.removeHandler(held)
        for record in held.records:
            to_file.handle(record)
    if old is not None:
        root.removeHandler(old)
        old.close()
    root.addHandler(to_file)
    _state.update(held=None, file=to_file)
    return path


def flush_held_to(path: str | os.PathLike) -> str | None:
    """`log_to_file(path)` if `quiet_console` is holding records back, else nothing.

    Returns:
      The log file's path, or None.
    """
    return log_to_file(path) if _state["held"] is not None else None


def log_file() -> str | None:
    """The file logging goes to (`log_to_file`), or None."""
    handler = _state["file"]
    return handler.baseFilename if isinstance(handler, logging.FileHandler) else None


def to_file_only(message: str, level: int = logging.ERROR) -> None:
    """Writes `message` (e.g. a traceback) to the log file of `log_to_file`, not the console."""
    handler = _state["file"] or _state["held"]
    if handler is not None:
        handler.handle(logging.LogRecord("rl.logs", level, __file__, 0, message, None, None))
