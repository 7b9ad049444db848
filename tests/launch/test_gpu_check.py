"""launch.gpu_check runs unchanged on CPU with the tiny preset; the peak tables match device kinds."""

import json
import os
import subprocess
import sys

import pytest

from launch.gpu_check import PEAK_BF16_FLOPS, PEAK_HBM_BYTES_S, peak


@pytest.mark.parametrize(
    "kind,hbm,flops",
    [
        ("NVIDIA H100 80GB HBM3", 3.35e12, 989e12),
        ("NVIDIA H100 PCIe", 2.0e12, 756e12),
        ("NVIDIA H200", 4.8e12, 989e12),
        ("NVIDIA A100-SXM4-80GB", 2.039e12, 312e12),
        ("NVIDIA A100-SXM4-40GB", 1.555e12, 312e12),
        ("TPU v5 lite", 819e9, 197e12),
        ("TPU v4", 1.2e12, 275e12),
        ("cpu", None, None),
        ("NVIDIA GeForce RTX 4090", None, None),
    ],
)
def test_peak_tables_match_device_kinds(kind, hbm, flops):
    assert peak(PEAK_HBM_BYTES_S, kind) == hbm
    assert peak(PEAK_BF16_FLOPS, kind) == flops


@pytest.mark.slow  # the GPU check end to end on CPU (~25 s cold)
@pytest.mark.parametrize("kernel", ["xla", "pallas_tpu"])  # (JAX's TPU kernel interpreted)
def test_gpu_check_tiny_preset_runs_on_cpu(tmp_path, kernel):
    out = tmp_path / "gpu_check.json"
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
    )
    cmd = [sys.executable, "-m", "launch.gpu_check", "--preset=tiny", f"--json={out}"]
    cmd.append(f"--attention_kernel={kernel}")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "not in the peak tables: fractions unknown" in proc.stdout
    result = json.loads(out.read_text())
    assert result["device"]["platform"] == "cpu" and result["preset"] == "tiny"
    assert result["attention_kernel"] == kernel and f"decode attention {kernel}" in proc.stdout
    (m,) = result["models"]
    assert m["model"] == "tiny" and m["params"] > 0
    for part, key in (
        ("decode", "tokens_per_s"),
        ("decode", "achieved_bytes_per_s"),
        ("learner", "tokens_per_s"),
        ("publish", "gb_per_s"),
    ):
        assert m[part][key] > 0, (part, key)
    assert m["decode"]["hbm_fraction"] is None and m["learner"]["mfu"] is None
    assert m["decode"]["bytes_per_step"] > m["publish"]["bytes"]  # weights + the KV cache read
    for mode in ("sync", "cgp+frontier+ordered"):
        assert m["round"][mode]["rollout_to_train_end_s"] > 0
    assert m["round"]["cgp_vs_sync"] == pytest.approx(
        m["round"]["cgp+frontier+ordered"]["rollout_to_train_end_s"]
        / m["round"]["sync"]["rollout_to_train_end_s"]
    )
