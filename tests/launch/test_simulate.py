"""launch.simulate writes the comparison JSON; validation against a run reproduces itself."""

import json
import math
import subprocess
import sys

import pytest

from rl.elastic.stage import StageModel
from rl.sim.compare import run_modes, validate
from rl.sim.workload import WorkloadConfig


def simulate(tmp_path, *flags, timeout=600):
    """Runs launch.simulate with `flags` and --json; returns (its JSON, its stdout)."""
    out = tmp_path / "sim.json"
    cmd = [sys.executable, "-m", "launch.simulate", f"--json={out}", *flags]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(out.read_text()), proc.stdout


SMALL = ("--setups=8", "--rounds=2", "--max_new_tokens=512", "--median_tokens=100")


def test_simulate_writes_the_documented_keys(tmp_path):
    out = tmp_path / "sim.json"
    cmd = [
        sys.executable,
        "-m",
        "launch.simulate",
        f"--json={out}",
        "--setups=8,16",
        "--rounds=3",
        "--max_new_tokens=512",
        "--median_tokens=100",
        "--plan_budgets=4",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    for block in ("setups", "paper_balance"):
        for setup in ("R8", "R16"):
            modes = result[block][setup]["modes"]
            assert list(modes)[0] == "sync" and "cgp+frontier+tail" in modes
            assert {
                "async+frontier+s1",
                "async+frontier+s1+fill",
                "async+frontier+s4+fill",
                "async+shuffled+s4+fill",
            } <= set(modes)
            for m in modes.values():
                for key in (
                    "rollout_to_train_end_s",
                    "first_dispatch_s",
                    "trainer_wait_ratio",
                    "reduction_vs_sync",
                    "groups_per_s",
                    "throughput_vs_sync",
                ):
                    assert isinstance(m[key], float)
            for name, s in (("async+frontier+s1", 1), ("async+frontier+s4+fill", 4)):
                assert 0 < modes[name]["lag_max"] <= s  # the staleness bound holds at scale too
            # +fill: the smallest divisor of R whose window keeps the slots busy, or R
            assert modes["async+frontier+s4+fill"]["groups_per_update"] >= 2
    assert result["paper_balance"]["R8"]["modes"]["sync"]["trainer_wait_ratio"] == pytest.approx(
        0.5, abs=0.02
    )
    assert result["plan"]["4"]["choice"] in {r["split"] for r in result["plan"]["4"]["rows"]}
    assert "<- planner" in proc.stdout


def test_validate_against_a_run_of_the_simulator_itself_has_no_error():
    model = StageModel(
        decode_a=2e-3,
        call_overhead=3e-3,
        steps_per_call=4,
        prefill_fixed=3e-3,
        learner_per_token=1e-4,
        update_s=6e-3,
        micro_batch_rows=16,
        pad_rows=True,
        contention=0.5,
    )
    lengths = [96, 12, 14, 9, 16, 10, 96, 8] * 4
    workload = WorkloadConfig(
        max_new_tokens=96, fixed_lengths=tuple(lengths), prompt_min=4, prompt_max=12
    )
    fields = dict(
        groups_per_round=8,
        groups_per_update=2,
        group_size=8,
        max_new_tokens=96,
        slots=32,
        epoch_size=len(lengths),
    )
    rows = run_modes(["sync", "cgp+frontier+fifo"], model, workload, rounds=100, skip=1, **fields)
    config = dict(
        max_new_tokens=96,
        lengths=lengths,
        prompt_min=4,
        prompt_max=12,
        seed=0,
        groups=8,
        groups_per_update=2,
        group_size=8,
        slots=32,
        eta=1.25,
    )
    real = dict(config=config, modes=rows)
    out = validate(real, model)
    assert out["sync"]["error_rollout_to_train_end_s"] == pytest.approx(0.0, abs=1e-12)
    assert out["cgp+frontier+fifo"]["error_first_dispatch_s"] == pytest.approx(0.0, abs=1e-12)
    assert out["cgp+frontier+fifo/no_contention"]["error_rollout_to_train_end_s"] < 0


def test_simulate_borrowing_alone_writes_the_comparison(tmp_path):
    result, stdout = simulate(tmp_path, *SMALL, "--borrowing=off,both", "--balance_wait=0")
    assert "setups" not in result  # --borrowing alone skips the mode comparison
    rows = result["borrowing"]["R8"]
    assert set(rows) == {"sync", "cgp+frontier+fifo", "async+frontier+s4+fill"}
    for by in rows.values():
        assert list(by) == ["off", "both"] and by["off"]["throughput_vs_static"] == 1.0
        assert by["both"]["groups_per_s"] > 0 and by["off"]["moves_learner"] == 0
        assert by["off"]["pooling_bound"] >= 1.0
    assert rows["sync"]["off"]["predrain_bound"] == 1.0  # sync trains after the drain
    assert rows["cgp+frontier+fifo"]["off"]["predrain_bound"] >= 1.0
    assert math.isnan(rows["async+frontier+s4+fill"]["off"]["predrain_bound"])
    assert "BiDiRL reports up to 1.94x" in stdout and "pre-drain" in stdout


def test_simulate_multiplex_alone_writes_each_pipeline_count(tmp_path):
    flags = ("--multiplex=2,3", "--multiplex_modes=sync", "--balance_wait=0")
    result, stdout = simulate(tmp_path, *SMALL, *flags)
    assert "setups" not in result  # --multiplex alone skips the mode comparison
    rows = result["multiplexing"]
    assert set(rows) == {"R8/sync/2", "R8/sync/3"}
    for key, row in rows.items():
        assert row["pipelines"] == int(key[-1]) and row["groups"] == row["pipelines"] * 2 * 8
        assert 0 < row["vs_static"] <= row["bound_vs_static"] + 1e-9
    assert "multiplexing, 4 replicas" in stdout


def test_simulate_papers_writes_the_headline_contract(tmp_path):
    result, stdout = simulate(tmp_path, "--papers", "--rounds=1", timeout=900)
    rows = result["papers"]
    assert set(rows) == {
        "rolloutpipe_cgp",
        "pipelinerl_async",
        "rollpacker_tail",
        "bidirl_borrowing",
        "jigsawrl_migration",
        "jigsawrl_multiplexing",
    }
    for row in rows.values():
        assert set(row) == {"paper", "ours", "metric", "setting"}
    assert all(isinstance(row["ours"], float) for row in rows.values())
    assert "pipelinerl_async" in stdout


def test_kv_layouts_compares_dense_and_paged_at_the_same_hbm(tmp_path):
    result, stdout = simulate(
        tmp_path,
        "--kv_layouts=dense,paged",
        "--kv_modes=sync",
        "--setups=8",
        "--rounds=2",
        "--max_new_tokens=4096",
        "--median_tokens=300",
        "--sampler_gpus=1",
    )
    rows = result["kv_layouts"]["R8"]["sync"]
    assert list(rows) == ["dense", "paged"] and "setups" not in result
    assert rows["dense"]["kv_pages"] == 0 and rows["paged"]["kv_pages"] > 0
    assert rows["dense"]["slots"] < rows["paged"]["slots"] == 256
    assert rows["dense"]["vs_dense"] == 1.0 and rows["paged"]["vs_dense"] > 0
    assert "KV layouts at the same HBM" in stdout and "vs dense" in stdout
