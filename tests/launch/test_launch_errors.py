"""python -m launch.train as a user with bad luck meets it: a clean console, one-line errors, and a
finished run that no bad or careless second run can destroy."""

import hashlib
import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
ABSL_LINE = r"^[IWEF]\d{4} \d\d:\d\d:\d\d"  # absl's log prefix: "I1201 00:53:37.978 ..."
CHATTER = ("CheckpointManager", "_NonBlockingMetadataStore", "orbax", "xla_bridge")


def _env() -> dict[str, str]:
    """The test process's environment plus its XLA compile cache (rerun programs load, not compile)."""
    return dict(
        os.environ,
        PYTHONPATH=str(ROOT),
    )


def launch(workdir, *args: str, prelude: str = "") -> subprocess.CompletedProcess:
    """Runs the launcher on the smoke config; `prelude` runs first in the same process."""
    flags = ["--config=configs/smoke.py", f"--config.workdir={workdir}", *args]
    code = f"{prelude}\nimport sys\nfrom launch.train import cli\nsys.argv[1:] = {flags!r}\ncli()"
    cmd = (
        [sys.executable, "-c", code] if prelude else [sys.executable, "-m", "launch.train", *flags]
    )
    return subprocess.run(
        cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600, check=False
    )


def snapshot(workdir) -> dict[str, str]:
    """Every file under workdir (run.log included) -> its SHA-256."""
    out = {}
    for path in sorted(pathlib.Path(workdir).rglob("*")):
        if path.is_file():
            out[str(path.relative_to(workdir))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def one_line_error(proc: subprocess.CompletedProcess) -> str:
    """The launcher's one error line; anything before it may only be the run's own warnings."""
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    *before, last = [line for line in proc.stderr.splitlines() if line.strip()]
    assert last.startswith("launch.train: "), proc.stderr[-3000:]
    assert all(line.startswith("W") and "] " in line for line in before), proc.stderr[-3000:]
    return last


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished smoke run through the launcher: its workdir and its console output."""
    workdir = tmp_path_factory.mktemp("finished")
    proc = launch(workdir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dict(workdir=workdir, stdout=proc.stdout, stderr=proc.stderr)


def test_smoke_console_holds_bars_metrics_and_table_and_chatter_goes_to_run_log(finished):
    import re

    out, err = finished["stdout"], finished["stderr"]
    for expected in ("sft steps", "[sft] step 10", "[train] step 1 | round 1", "held-out accuracy"):
        assert expected in out
    for stream in (out, err):
        assert not re.search(ABSL_LINE, stream, re.MULTILINE), stream[-3000:]
        assert not any(word in stream for word in CHATTER), stream[-3000:]
    log = (finished["workdir"] / "run.log").read_text()
    assert "CheckpointManager created" in log and re.search(ABSL_LINE, log, re.MULTILINE)


@pytest.mark.slow  # three more launch.train processes (the finished run is shared)
@pytest.mark.parametrize(
    "override,message",
    [
        ("--config.driver.group_size=16", "exceeds config.engine.max_slots=8"),
        ("--config.engine.max_prefill_length=4", "prompts take up to"),
        ("--config.rounds=-1", "config.rounds=-1; expected an integer >= 0"),
    ],
    ids=["group_size", "max_length", "rounds"],
)
def test_invalid_config_leaves_a_finished_run_untouched(finished, override, message):
    # Found only after SFT had started, these used to delete summary.json and rewrite
    # metrics.jsonl of the finished run they were pointed at.
    before = snapshot(finished["workdir"])
    assert {"summary.json", "metrics.jsonl"} <= set(before)
    proc = launch(finished["workdir"], override)
    assert snapshot(finished["workdir"]) == before
    assert message in one_line_error(proc)


@pytest.mark.slow  # two launch.train processes (~19 s cold)
def test_fresh_run_into_a_finished_workdir_stops_unless_overwrite(finished, tmp_path):
    workdir = tmp_path / "copy"
    shutil.copytree(finished["workdir"], workdir)
    before = snapshot(workdir)
    line = one_line_error(launch(workdir))
    assert f"{workdir} holds a previous run's results (summary.json, metrics.jsonl" in line
    assert "pass --config.overwrite=True to replace them, or another --config.workdir" in line
    assert snapshot(workdir) == before
    proc = launch(
        workdir, "--config.overwrite=True", "--config.sft.max_steps=0", "--config.rounds=1"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert [(r["prefix"], r["step"]) for r in rows] == [("train", 0)]  # the old rows are gone


HANGING_REWARD = (
    "import time\nfrom rl.rewards import register_reward\n"
    "register_reward('test_hangs')(lambda request, text: time.sleep(60) or 1.0)"
)


@pytest.mark.parametrize(
    "args,prelude,message",
    [
        (
            ["--config.driver.mdoe=sync"],
            "",
            "launch.train: --config.driver.mdoe=sync: config.driver has no field 'mdoe'; did you "
            "mean config.driver.mode?",
        ),
        (
            [
                "--config.task.name=gsm8k",
                "--config.task.reward=gsm8k",
                "--config.data.train_path=.",
            ],
            "",
            "launch.train: GSM8K file '.' is a directory; expected a JSONL file",
        ),
        pytest.param(
            [
                "--config.learner.optimizer.lr=1e39",
                "--config.driver.groups_per_update=4",
                "--config.sft.max_steps=0",
                "--config.rounds=1",
            ],
            "",
            "launch.train: Non-finite values in params/",
            marks=pytest.mark.slow,  # ~17 s cold: a round before the non-finite update
        ),
        pytest.param(
            [
                "--config.task.reward=test_hangs",
                "--config.task.reward_timeout_s=0.01",
                "--config.sft.max_steps=0",
                "--config.rounds=4",
            ],
            HANGING_REWARD,
            "launch.train: Reward <lambda>: 33 calls are stuck past timeout_s=0.01",
            marks=pytest.mark.slow,  # a minute of stuck calls
        ),
    ],
    ids=["misspelled_key", "data_file_is_a_directory", "nan_update", "stuck_reward_calls"],
)
def test_a_stopped_run_prints_one_line(tmp_path, args, prelude, message):
    line = one_line_error(launch(tmp_path / "run", *args, prelude=prelude))
    assert line.startswith(message), line
    if "Non-finite" in message or "stuck" in message:  # stopped mid-run: traceback in run.log
        kind = "FloatingPointError" if "Non-finite" in message else "RuntimeError"
        assert line.endswith(f"[{kind}; traceback in {tmp_path / 'run' / 'run.log'}]")
        assert "Traceback (most recent call last)" in (tmp_path / "run" / "run.log").read_text()


def test_verbose_prints_the_traceback_too(tmp_path):
    proc = launch(
        tmp_path / "run", "--config.task.name=gsm8k", "--config.data.train_path=.", "--verbose"
    )
    assert proc.returncode == 1 and "Traceback (most recent call last)" in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("launch.train: GSM8K file '.' is a")
