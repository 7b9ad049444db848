"""Each real-model config runs with its :smoke arg on a tiny random HF checkpoint and tiny JSONL.

The checkpoint (random Qwen2 / Qwen3 weights from transformers, a BPE tokenizer.json and a ChatML
chat template) and the data files are written by the test; the run loads both from local paths
exactly as on a GPU pod, through the configs' chat template.
"""

import json
import pathlib

import jax
import pytest
import torch  # in setup.py's [test] extras: if missing or broken, fail (never skip)
import transformers  # in setup.py's [test] extras: if missing or broken, fail (never skip)
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from configs import gsm8k_qwen, math_qwen
from learner.mesh import MeshConfig, make_meshes, replica_meshes
from rl.run import train
from rl.sections import from_section

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
GSM8K_ROWS = [
    {"question": f"Tom has {a} apples and buys {b} more. How many apples now?",
     "answer": f"{a} + {b} = <<{a}+{b}={a + b}>>{a + b}\n#### {a + b}"}
    for a, b in [(3, 4), (10, 5), (7, 8), (12, 30), (6, 6), (9, 1), (2, 40), (5, 11), (8, 13)]
]  # fmt: skip
MATH_ROWS = [
    {"problem": f"Compute ${a} \\cdot {b}$.", "solution": f"It is $\\boxed{{{a * b}}}$.",
     "level": "Level 1", "type": "Prealgebra"}
    for a, b in [(2, 3), (4, 5), (6, 7), (3, 9), (8, 2), (5, 5), (7, 4), (9, 9)]
] + [{"problem": "Simplify $\\sqrt{8}$.", "solution": "$\\boxed{2\\sqrt{2}}$"}]  # fmt: skip
BAD_LINE = '{"question": "a row with no answer"}'


def _write_jsonl(path: pathlib.Path, rows: list[dict], bad: str | None = None) -> str:
    lines = [json.dumps(r) for r in rows]
    if bad is not None:
        lines.insert(2, bad)  # line 3
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


def _tiny_hf_dir(path: pathlib.Path, family: str) -> str:
    """A random ~60k-parameter Qwen2/Qwen3 checkpoint with a BPE tokenizer and ChatML template."""
    path.mkdir()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [json.dumps(r) for r in GSM8K_ROWS + MATH_ROWS]
    corpus += [gsm8k_qwen.INSTRUCTION, math_qwen.SYSTEM, "user assistant system"]
    tok.train_from_iterator(
        corpus * 4,
        trainers.BpeTrainer(
            vocab_size=320,
            special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": None,
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "chat_template": CHATML,
            }
        )
    )
    config_cls, model_cls = {
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    }[family]
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(
        vocab_size=352,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    getattr(transformers, model_cls)(config).save_pretrained(str(path))
    return str(path)


@pytest.mark.parametrize(
    ("module", "family"), [(gsm8k_qwen, "qwen2"), (math_qwen, "qwen3")], ids=["gsm8k", "math"]
)
@pytest.mark.slow
def test_real_model_config_smoke_runs_on_local_checkpoint_and_jsonl(module, family, tmp_path):
    model_dir = _tiny_hf_dir(tmp_path / "model", family)
    config = module.get_config("smoke")
    config.workdir = str(tmp_path / "run")
    config.model.hf_path = model_dir
    config.tokenizer = ""  # the checkpoint's own tokenizer.json and chat template
    if module is gsm8k_qwen:
        config.data.train_path = _write_jsonl(tmp_path / "train.jsonl", GSM8K_ROWS, BAD_LINE)
        config.data.heldout_path = _write_jsonl(tmp_path / "test.jsonl", GSM8K_ROWS[:3])
        expected = {"train_rows": 9, "heldout_rows": 3, "skipped_malformed": 1, "non_numeric": 0}
    else:  # no held-out file: a seeded slice of the train file
        config.data.train_path = _write_jsonl(tmp_path / "train.jsonl", MATH_ROWS)
        # every row kept: the "math" reward checks "2\sqrt{2}" symbolically
        expected = {"train_rows": 5, "heldout_rows": 4, "skipped_malformed": 0, "non_numeric": 0}

    summary = train(config, stdout=False)

    assert config.data.template == "chat" and len(summary["rounds"]) == config.rounds == 2
    for r in summary["rounds"]:
        assert r["updates"] == config.driver.groups_per_round // config.driver.groups_per_update
    saved = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert {k: saved["data"][k] for k in expected} == expected
    assert saved["data"]["too_long"] == 0
    for key in ("heldout_acc_before", "heldout_acc_after"):
        assert 0.0 <= saved[key] <= 1.0
    assert saved["reward_errors"] == saved["reward_timeouts"] == 0


def test_jsonl_task_rejects_a_malformed_row_with_file_and_line(tmp_path):
    config = gsm8k_qwen.get_config("smoke")
    config.workdir = str(tmp_path / "run")
    config.data.train_path = _write_jsonl(tmp_path / "train.jsonl", GSM8K_ROWS, BAD_LINE)
    config.data.on_error = "raise"
    with pytest.raises(ValueError, match=f"{tmp_path / 'train.jsonl'}:3 is malformed"):
        train(config, stdout=False)


def test_jsonl_task_needs_a_train_path():
    with pytest.raises(ValueError, match="config.data.train_path is empty"):
        train(gsm8k_qwen.get_config("smoke"), stdout=False)


@pytest.mark.parametrize("module", [gsm8k_qwen, math_qwen], ids=["gsm8k", "math"])
def test_gpu_recipes_run_one_paged_replica_per_sampler_gpu(module):
    """On 8 GPUs the sampler's 4 are 4 replicas of data=1: a replica of data=4 would hold its
    whole page pool on each of its GPUs (sampler/cache.py). The smoke variant runs one."""
    config = module.get_config()
    mesh = from_section(MeshConfig, config.mesh, name="mesh")
    _, sampler = make_meshes(mesh, jax.devices()[:8])
    replicas = replica_meshes(sampler, mesh.sampler_replicas)
    assert config.engine.page_size > 0 and [r.shape["data"] for r in replicas] == [1, 1, 1, 1]
    assert module.get_config("smoke").mesh.sampler_replicas == 1
