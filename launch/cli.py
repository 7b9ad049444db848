"""What the launchers share: one-line flag and config errors, and SIGTERM as a stop request.

app.run(main, flags_parser=functools.partial(parse_flags, "launch.train"))
stop = stop_on_sigterm("launch.train")   # rl.run.train(config, stop=stop)
"""

from __future__ import annotations

import importlib.util
import os
import signal
import sys
import threading

from absl import flags

import configs
from rl.config_check import closest_field


def one_line(text: str) -> str:
    """A multi-line library message (ml_collections embeds tracebacks) as its first and last line."""
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    if len(lines) <= 1:
        return lines[0] if lines else ""
    return f"{lines[0].rstrip(':')}: {lines[-1]}"


def _config_file(argv: list[str]) -> object:
    """The config the --config flag names (default configs/default.py), without its overrides."""
    spec = os.path.join(os.path.dirname(configs.__file__), "default.py")
    for i, arg in enumerate(argv):
        if arg.startswith("--config="):
            spec = arg.split("=", 1)[1]
        elif arg == "--config" and i + 1 < len(argv):
            spec = argv[i + 1]
    path, _, config_arg = spec.partition(":")
    module_spec = importlib.util.spec_from_file_location("_launch_config", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.get_config(config_arg or None)


def parse_flags(program: str, argv: list[str]) -> list[str]:
    """absl's flag parsing; a bad flag or config field is one line (a typo names the closest)."""
    try:
        return flags.FLAGS(argv)
    except (AttributeError, KeyError) as e:  # ml_collections: an override of a missing field
        message = f"{type(e).__name__}: {e}"
        try:
            config = _config_file(argv)
            for arg in argv[1:]:
                if arg.startswith("--config.") and (
                    found := closest_field(config, arg[len("--config.") :].split("=", 1)[0])
                ):
                    message = f"{arg}: {found}"
                    break
        except Exception as inner:  # the config file itself is broken: say that instead
            message = f"{type(inner).__name__}: {inner}"
    except (flags.Error, ValueError, TypeError, OSError) as e:
        message = str(e)
    sys.exit(f"{program}: {one_line(message)}")


def stop_on_sigterm(program: str) -> threading.Event:
    """An Event set by SIGTERM (a preempted pod): the run saves at its next safe point and exits 0.

    A second SIGTERM stops at once (exit 143); the run resumes from its last checkpoint.
    """
    stop = threading.Event()

    def handler(signum: int, frame: object) -> None:
        if stop.is_set():
            sys.exit(128 + signum)
        stop.set()
        print(f"{program}: SIGTERM: stopping at the next safe point", file=sys.stderr)

    signal.signal(signal.SIGTERM, handler)
    return stop
