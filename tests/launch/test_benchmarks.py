"""Each launch/bench_*.py runs to its end on a tiny workload: it writes its JSON, compiles nothing
inside a timed region (compiles_timed 0), gives a spread over its repeats, and keeps the
invariants it checks (the same tokens where the schedule is the same). Counts and invariants only:
the timings of a shared machine are not asserted. launch.bench_rewards' run is in
test_reward_faults.py, launch.profile's in test_profile.py."""

import json
import os
import subprocess
import sys

import pytest

from launch import bench_util
from launch.packing_workload import run_workload

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_bench(module, flags, tmp_path, *, env=None):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", module, f"--json={out}", *flags]
    proc = subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200, env=env or os.environ.copy()
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


@pytest.mark.slow  # 1-2 minutes on 2 shared cores: two runtimes built, each mode twice
def test_bench_pipeline_builds_modes_one_at_a_time_and_compiles_nothing_while_timed(tmp_path):
    flags = [
        "--modes=sync,cgp+frontier+ordered",
        "--rounds=1",
        "--repeats=2",
        "--groups=2",
        "--group_size=2",
        "--groups_per_update=1",
        "--slots=8",
        "--max_new_tokens=8",
        "--short_min=2",
        "--short_max=4",
    ]
    out, stdout = run_bench("launch.bench_pipeline", flags, tmp_path)
    assert out["compiles_timed"] == 0 and "compiles timed: 0" in stdout
    assert list(out["modes"]) == ["sync", "cgp+frontier+ordered"]
    for mode, r in out["modes"].items():
        assert r["compiles_timed"] == 0, mode
        assert len(r["repeats"]) == 2 and r["spread"]["rollout_to_train_end_s"]["n"] == 2
        s = r["spread"]["rollout_to_train_end_s"]
        assert s["min"] <= r["rollout_to_train_end_s"] <= s["max"]
        assert r["same_tokens_each_repeat"]  # each repeat starts from the same weights
        assert r["memory_maps"]["after_release"] < r["memory_maps"]["held"]  # released
    assert out["modes"]["cgp+frontier+ordered"]["same_tokens_as_sync"]  # the same schedule


@pytest.mark.slow  # about 1 minute: six ways compiled on a tiny model
def test_bench_learner_fixed_batch_compiles_nothing_while_timed(tmp_path):
    flags = [
        "--steps=1",
        "--repeats=3",
        "--piece_repeats=2",
        "--run_updates=0",
        "--groups=2",
        "--group_size=2",
        "--prompt_tokens=8",
        "--min_response=4",
        "--max_response=16",
        "--d_model=32",
        "--mlp_dim=64",
        "--head_dim=8",
    ]
    out, _ = run_bench("launch.bench_learner", flags, tmp_path)
    assert out["compiles_timed"] == 0
    assert out["overhead_ratio_paired_spread"]["n"] == 3
    assert all(len(runs) == 3 for runs in out["seconds"]["runs"].values())
    first = out["first_update"]  # the same params and batch: the same first update
    assert first["learner"]["loss"] == pytest.approx(first["minimal"]["loss"], abs=1e-5)
    assert first["learner-unpacked"]["loss"] == pytest.approx(first["minimal"]["loss"], abs=1e-5)


@pytest.mark.slow  # about 1 minute: the loop and the decode comparison on a tiny engine
def test_bench_sampler_compiles_nothing_while_timed(tmp_path):
    flags = [
        "--groups=6",
        "--slots=16",
        "--max_new_tokens=16",
        "--short_tokens=4",
        "--prompt_max=12",
        "--repeats=3",
        "--decode_shapes=8x1x16",
        "--decode_new_tokens=8",
    ]
    out, _ = run_bench("launch.bench_sampler", flags, tmp_path)
    assert out["compiles_timed"] == 0 and out["new_compiles_while_timed"] == 0
    assert out["groups_with_different_outputs"] == 0  # continuous and static: the same tokens
    assert out["tokens"]["continuous"] == out["tokens"]["static"]
    assert out["tokens_per_s_spread"]["continuous"]["n"] == 3
    assert [len(r["seconds"]) for r in out["decode"]] == [3]
    assert all(r["compile_counts"] for r in out["decode"])


@pytest.mark.slow  # about 1-2 minutes: two replica engines, then two tiny runtimes
def test_bench_elastic_compiles_nothing_while_timed(tmp_path):
    flags = [
        "--replicas=2",
        "--long_tokens=32",
        "--short_tokens=8",
        "--repeats=2",
        "--rounds=2",
        "--groups=4",
        "--max_new_tokens=8",
    ]
    out, _ = run_bench("launch.bench_elastic", flags, tmp_path)
    assert out["compiles_timed"] == 0
    rows = out["migration"]["replicas2"]
    assert set(rows) == {"off", "tail"}
    assert all(
        r["round_s_range"][0] <= r["round_s"] <= r["round_s_range"][1] for r in rows.values()
    )
    borrowing = out["borrowing"]
    assert borrowing["off"]["tokens_digest"] == borrowing["learner"]["tokens_digest"]
    assert borrowing["learner"]["r2t_vs_static_per_round"]["n"] == 2


@pytest.mark.slow  # about 1 minute: three modes of the threads runtime (Ray's run is not here)
def test_bench_runtime_threads_compiles_nothing_while_timed(tmp_path):
    flags = ["--runtimes=threads", "--rounds=2", "--groups=4", "--max_new_tokens=8"]
    out, _ = run_bench("launch.bench_runtime", flags, tmp_path)
    assert out["compiles_timed"] == 0
    runs = out["runs"]
    assert list(runs) == ["threads/sync", "threads/cgp+ordered", "threads/cgp+fifo"]
    assert len({r["tokens_digest"] for r in runs.values()}) == 1  # every mode: the same tokens
    assert all(r["speedup_vs_sync_per_round"]["n"] == 2 for r in runs.values())


@pytest.mark.slow  # about 1 minute; needs Google Tunix (pip install google-tunix)
def test_bench_tunix_compiles_nothing_while_timed(tmp_path):
    pytest.importorskip("tunix")
    out, _ = run_bench("launch.bench_tunix", ["--updates=2", "--warmup=2"], tmp_path)
    assert out["compiles_timed"] == 0 and out["compiled_while_timed"] == {}
    assert out["loss_max_abs_diff"] < 1e-5  # the same weights, data and optimizer
    assert set(out["ratio_pairs"]) == {"tunix", "tunix_step"}


@pytest.mark.slow  # about 1 minute: three learners' start compiles
def test_packing_run_compiles_nothing_after_its_start():
    with bench_util.CompileWatch() as watch:
        bench_util.release()  # as bench_learner before its run: jax's caches empty
        r = run_workload(
            updates=2, groups=2, max_response=64, d_model=32, min_length_bucket=32, watch=watch
        )
    assert r["compiles_timed"] == 0, watch.timed_names()  # the eager ops too: warmed up
    assert r["compiles_after_start"] == 0
    assert r["padded_fraction"]["packed"] <= r["padded_fraction"]["unpacked"]
    assert r["padded_fraction"]["packed"] <= r["padded_fraction"]["no_flush"]
    # the flush shape (half the budget: 1 row of the longest length) is one more program
    assert r["learner_programs"]["packed"] == r["learner_programs"]["no_flush"] + 1


@pytest.mark.slow  # about 1 minute: a warm-up, two pipelines back to back, then multiplexed
def test_bench_sweep_multiplexed_pipelines_train_their_back_to_back_parameters(tmp_path):
    flags = [
        "--pipelines=2",
        "--rounds=2",
        "--groups=4",
        "--repeats=1",
        f"--workdir={tmp_path / 'runs'}",
    ]
    out, stdout = run_bench("launch.bench_sweep", flags, tmp_path)
    assert out["same_params"] and out["compiles_after_start"] == 0
    runs = out["runs"]
    assert runs["multiplexed"][0]["digests"] == runs["back to back"][0]["digests"]
    assert len(set(runs["multiplexed"][0]["digests"])) == 2  # two different pipelines
    assert out["speedup_vs_back_to_back"]["n"] == 1
    assert "bitwise its back-to-back run's: True" in stdout


@pytest.mark.slow  # about 1 minute: a local Ray cluster, a learner worker and 2 replicas
def test_bench_publish_moves_nothing_through_the_object_store_by_transfer(tmp_path):
    flags = ["--replicas=2", "--publishes=2", "--d_model=64", "--n_layers=2"]
    out, stdout = run_bench("launch.bench_publish", flags, tmp_path)
    transfer, store = out["transfer"], out["object_store"]
    assert transfer["object_store_mb"] == 0 and transfer["mb_per_replica"] > 0
    assert store["object_store_mb"] == store["mb_per_replica"] == transfer["mb_per_replica"]
    assert transfer["seconds"]["n"] == store["seconds"]["n"] == 2
    assert "object store / transfer" in stdout
