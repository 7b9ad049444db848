"""Export any checkpoint of a run as a Hugging Face directory that transformers loads.

    python -m launch.export --workdir=runs/x [--step=N] [--out=DIR] [--dtype=bfloat16]
    python -m launch.export --workdir=runs/old --config=configs/default.py   # no config.json

The run's config comes from workdir/config.json (every run writes it when it starts) or from
--config (the file the run was started with, and the same --config.field overrides); --step picks
a checkpoint (its number is the rounds done when it was saved; default: the newest intact one);
--out defaults to workdir/hf-step<N>. rl.export_run does the work. Bad input (no such workdir,
step or config; a checkpoint that does not match the model) is one `launch.export: ...` line and
exit 1; --verbose prints the traceback and the library logging.
"""

import os
import sys
import traceback

from absl import app, flags
from ml_collections import config_flags

from rl.export_run import export_checkpoint
from rl.logs import quiet_console

_WORKDIR = flags.DEFINE_string(
    "workdir", None, "The run's workdir (its checkpoints: workdir/ckpt)."
)
_STEP = flags.DEFINE_integer("step", None, "The checkpoint to export; default: the newest intact.")
_OUT = flags.DEFINE_string("out", None, "Output directory; default: workdir/hf-step<N>.")
_DTYPE = flags.DEFINE_enum(
    "dtype", "", ["", "float32", "bfloat16", "float16"], "Tensor dtype on disk; '': the run's."
)
_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "The run's config file, when its workdir holds no config.json."
)
_VERBOSE = flags.DEFINE_bool(
    "verbose", False, "Print library logging and the traceback of an error on the console."
)
flags.mark_flag_as_required("workdir")


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    quiet_console(verbose=_VERBOSE.value)  # library logging (orbax, JAX) off the console
    workdir = _WORKDIR.value
    try:
        if not os.path.isdir(workdir):
            raise FileNotFoundError(f"--workdir={workdir!r} is not a directory; expected a run's.")
        done = export_checkpoint(
            workdir, _OUT.value, step=_STEP.value, config=_CONFIG.value, dtype=_DTYPE.value
        )
    except (ValueError, OSError) as e:
        if _VERBOSE.value:
            traceback.print_exc()
        sys.exit(f"launch.export: {str(e).strip() or type(e).__name__} [{type(e).__name__}]")
    print(
        f"exported checkpoint {done['step']} (weights version {done['version']}) of {workdir} "
        f"to {done['out']}"
    )


if __name__ == "__main__":
    app.run(main)
