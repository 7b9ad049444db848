"""Export: a trained run's final policy as a Hugging Face directory that transformers loads, with
logits equal to the trained params' (float32), and the tokenizer's files when one was loaded."""

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
import tokenizers
import torch  # in setup.py's [test] extras: if missing or broken, fail (never skip)
import transformers  # in setup.py's [test] extras: if missing or broken, fail (never skip)
from flax import nnx

from configs import smoke
from rl.models import create_model, get_preset
from rl.models.export import export_hf
from rl.models.tokenizer import load_tokenizer
from rl.run import train

TOL = 1e-4  # max abs logit difference, float32


def _batch(vocab):
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, vocab, size=(2, 9))
    mask = (np.arange(9)[None, :] < np.array([9, 5])[:, None]).astype(np.int64)
    positions = np.broadcast_to(np.arange(9), (2, 9)).copy()
    return tokens, positions, mask


def _logits_match(model, path):
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    tokens, positions, mask = _batch(model.config.vocab_size)
    with torch.no_grad():
        ref = hf(
            input_ids=torch.tensor(tokens),
            attention_mask=torch.tensor(mask),
            position_ids=torch.tensor(positions),
        ).logits.numpy()
    ours = np.asarray(model(jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(mask)))
    valid = mask.astype(bool)
    np.testing.assert_allclose(ref[valid], ours[valid], atol=TOL, rtol=0)


@pytest.mark.slow  # a whole launch.train run, an export, a rerun that exports again (~25 s cold)
def test_a_trained_run_exports_its_final_policy_and_a_finished_run_does_on_a_rerun(tmp_path):
    config = smoke.get_config()
    config.workdir = str(tmp_path / "run")
    config.rounds = 1
    config.sft.max_steps = 0
    config.eval.pass_k = 2  # pass@2 from 3 samples beside greedy accuracy
    config.eval.pass_n = 3
    config.export.hf = True
    config.checkpoint_every = 1
    config.resume = True
    summary = train(config, stdout=False)
    assert summary["export_hf"] == str(tmp_path / "run" / "hf")
    assert 0.0 <= summary["heldout_pass@2_after"] <= 1.0
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if r["prefix"] == "train"]
    assert train_rows[-1]["heldout_pass@2"] == summary["heldout_pass@2_after"]  # logged per eval
    state = summary["state"]
    assert int(state.step) == 2  # R / U = 2 updates: the exported params are trained ones
    model = create_model(get_preset("tiny"), seed=123)  # its values are replaced
    nnx.update(model, state.params)
    _logits_match(model, summary["export_hf"])
    saved = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert saved["export_hf"] == summary["export_hf"]
    # A finished run rerun with export.hf exports its final checkpoint (and runs nothing).
    shutil.rmtree(summary["export_hf"])
    again = train(config, stdout=False)
    assert again["rounds"] == [] and again["export_hf"] == summary["export_hf"]
    _logits_match(model, again["export_hf"])


def test_export_copies_a_loaded_tokenizers_files_and_its_special_ids(tmp_path):
    words = ["<pad>", "<eos>", "a", "b", "c", "[UNK]"]
    backend = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]")
    )
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    src = tmp_path / "tok"
    src.mkdir()
    backend.save(str(src / "tokenizer.json"))
    (src / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": "<eos>",
                "pad_token": "<pad>",
                "bos_token": None,
            }
        )
    )
    tok = load_tokenizer(str(src))
    model = create_model(get_preset("tiny", param_dtype="float32", dtype="float32"), seed=4)
    out = tmp_path / "hf"
    copied = export_hf(model, str(out), tokenizer=tok, tokenizer_dir=str(src))
    assert copied == ["tokenizer.json", "tokenizer_config.json"]
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(out))
    assert hf_tok("a c b")["input_ids"] == tok.encode("a c b") == [2, 4, 3]
    config = json.loads((out / "config.json").read_text())
    assert (config["eos_token_id"], config["pad_token_id"]) == (1, 0)
    assert "bos_token_id" not in config or config["bos_token_id"] is None
    _logits_match(model, out)
    with pytest.raises(ValueError, match="holds no tokenizer.json; expected the Hugging Face"):
        export_hf(model, str(tmp_path / "x"), tokenizer_dir=str(tmp_path))
