"""Stage-time models: closed forms, padding as the learner pads, least-squares fits, presets."""

import json

import numpy as np
import pytest

from learner.batching import make_batch
from rl.elastic.stage import StageModel
from rl.models import abstract_model, get_preset
from rl.models import param_count as model_param_count
from rl.sim.calibrate import Measurements, fit_stage_model
from rl.sim.presets import GPUS, gpu_preset, kv_bytes_per_token, param_count
from rl.types import Completion, Group, Request

MODEL = StageModel(
    decode_a=1e-3, decode_b=2e-5, decode_c=3e-8, call_overhead=4e-3, steps_per_call=4
)


def test_decode_calls_closed_form_equals_the_sum_of_calls():
    slots, context, calls, k = 7, 1234.0, 9, MODEL.steps_per_call
    by_call = sum(MODEL.decode_call_s(slots, context + k * slots * j) for j in range(calls))
    assert MODEL.decode_calls_s(calls, slots, context) == pytest.approx(by_call, rel=1e-12)
    by_step = calls * MODEL.call_overhead + sum(
        MODEL.decode_a + MODEL.decode_b * slots + MODEL.decode_c * (context + slots * s)
        for s in range(calls * k)
    )
    assert MODEL.decode_calls_s(calls, slots, context) == pytest.approx(by_step, rel=1e-12)
    assert MODEL.decode_calls_s(0, slots, context) == 0.0


def _group(uid, prompt_len, lengths):
    request = Request(uid=uid, prompt=(1,) * prompt_len, group_size=len(lengths))
    completions = tuple(
        Completion(
            uid=uid,
            round=0,
            sample=i,
            prompt=request.prompt,
            tokens=(2,) * n,
            logprobs=(0.0,) * n,
            versions=(0,) * n,
            finish_reason="stop",
            reward=float(i % 2),
        )
        for i, n in enumerate(lengths)
    )
    return Group(request=request, completions=completions)


@pytest.mark.parametrize("lengths", [[3, 9], [40, 12, 7], [96] * 8])
def test_padded_batch_tokens_match_learner_batching(lengths):
    model = StageModel(decode_a=1e-3, pad_rows=True, micro_batch_rows=16, min_length_bucket=32)
    groups = [_group(0, 11, lengths), _group(1, 5, lengths[::-1])]
    seqs = [(len(g.request.prompt), len(c.tokens)) for g in groups for c in g.completions]
    batch = make_batch(groups, [[0.0] * len(lengths)] * 2, rows=16, min_length_bucket=32)
    assert model.batch_tokens(seqs) == batch.inputs.size
    assert model.replace(pad_rows=False).batch_tokens(seqs) == sum(p + n for p, n in seqs)


def test_fit_recovers_known_coefficients_from_noiseless_timings():
    true = StageModel(
        decode_a=2e-3,
        decode_b=5e-5,
        decode_c=1e-7,
        call_overhead=3e-3,
        steps_per_call=4,
        prefill_fixed=4e-3,
        prefill_per_token=1e-5,
        learner_fixed=2e-2,
        learner_per_token=3e-5,
        update_s=7e-3,
        publish_fixed=1e-3,
        publish_per_byte=2e-10,
    )
    rng = np.random.default_rng(0)
    decode = []
    for k in (1, 4):
        m = true.replace(steps_per_call=k)
        for _ in range(40):
            n, ctx = int(rng.integers(1, 33)), float(rng.integers(10, 4000))
            decode.append((k, n, ctx, m.decode_call_s(n, ctx)))
    meas = Measurements(
        decode=decode,
        prefill=[(n, true.prefill_s(n)) for n in range(1, 17)],
        micro=[(t, true.micro_step_s(t)) for t in (512, 1024, 2048, 4096)],
        update=[7e-3] * 3,
        publish=[(b, true.publish_s(b)) for b in (10**5, 10**6, 10**7)],
    )
    fitted, report = fit_stage_model(
        meas,
        steps_per_call=4,
        micro_batch_rows=16,
        pad_rows=True,
        min_length_bucket=32,
        param_bytes=1000,
        source="test",
    )
    for name in (
        "decode_a",
        "decode_b",
        "decode_c",
        "call_overhead",
        "prefill_fixed",
        "prefill_per_token",
        "learner_fixed",
        "learner_per_token",
        "publish_fixed",
        "publish_per_byte",
        "update_s",
    ):
        assert getattr(fitted, name) == pytest.approx(getattr(true, name), rel=1e-6), name
    assert report["decode"]["rel_rms"] < 1e-9


def test_fit_rejects_missing_stages_and_bad_values():
    with pytest.raises(ValueError, match="needs measurements of every stage"):
        fit_stage_model(
            Measurements(decode=[], prefill=[], micro=[], update=[], publish=[]),
            steps_per_call=1,
            micro_batch_rows=1,
            pad_rows=False,
            min_length_bucket=1,
            param_bytes=0,
            source="",
        )
    with pytest.raises(ValueError, match="decode_b must be finite and >= 0; received -1"):
        StageModel(decode_a=1.0, decode_b=-1)
    with pytest.raises(ValueError, match="Unknown StageModel fields"):
        StageModel.from_dict({"decode_a": 1.0, "decode_q": 2.0})


def test_load_reads_profile_output(tmp_path):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"model": MODEL.to_dict(), "fit": {}}))
    assert StageModel.load(path) == MODEL


@pytest.mark.parametrize("name", ["tiny", "qwen3-1.7b", "qwen2.5-0.5b"])
def test_param_count_formula_matches_the_model(name):
    cfg = get_preset(name)
    assert param_count(cfg) == model_param_count(abstract_model(cfg))


def test_gpu_preset_is_the_documented_roofline():
    p = gpu_preset("qwen3-1.7b", "h200", sampler_tp=2, learner_gpus=4)
    g, n = GPUS["h200"], param_count(get_preset("qwen3-1.7b"))
    assert p.model.decode_a == pytest.approx(0.004 + 2 * n / (2 * g.hbm_bw * 0.7))
    kv = kv_bytes_per_token(get_preset("qwen3-1.7b"))
    assert kv == 2 * 28 * 8 * 128 * 2
    assert p.model.decode_c == pytest.approx(kv / (2 * g.hbm_bw * 0.7))
    assert p.model.learner_per_token == pytest.approx(8 * n / (4 * g.bf16_flops * 0.35))
    assert 8 <= p.slots <= 256
    with pytest.raises(ValueError, match="Unknown gpu 'a100'"):
        gpu_preset(gpu="a100")
