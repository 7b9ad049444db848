"""Tests for rl/models/tokenizer.py: ByteTokenizer, and HFTokenizer against transformers."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import jinja2
import pytest
import tokenizers
import transformers  # in setup.py's [test] extras: if missing or broken, fail (never skip)
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

from rl.models.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>"]
CORPUS = [
    "Hello world, the quick brown fox jumps over the lazy dog.",
    "What is 2 + 2? The answer is 4.",
    "naïve café — 日本語のテキスト 🙂 emoji",
    "def f(x):\n    return x * 2\n",
] * 4
TEXTS = [
    "Hello world",
    "  leading spaces\n\ttabs and trailing   ",
    "naïve café — 日本語 🙂 unseen: ÆØÅ ß",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "",
]

# Qwen2.5's ChatML template, as shipped in its tokenizer_config.json (tools branch included).
QWEN_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# Undashed tags (exercise trim_blocks/lstrip_blocks), bos/eos variables, tojson with non-ASCII,
# raise_exception, loop controls and the {% generation %} tag.
PLAIN_TEMPLATE = """{{ bos_token }}
{% for message in messages %}
    {% if message['role'] not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('Unknown role: ' + message['role']) }}
    {% endif %}
    {% if loop.index0 >= 8 %}{% break %}{% endif %}
[{{ message['role'] }}] {{ message['content'] | tojson }}
    {% if message['role'] == 'assistant' %}
{% generation %}{{ message['content'] }}{{ eos_token }}{% endgeneration %}

    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
[assistant]
{% endif %}"""

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [
        {"role": "system", "content": "You are terse. Réponds en français — 日本語 OK."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Bonjour 🙂"},
        {"role": "user", "content": 'Say "x" & <y>'},
    ],
]


@pytest.fixture(scope="module")
def backend() -> tokenizers.Tokenizer:
    tok = tokenizers.Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def _write_dir(
    path: pathlib.Path, backend: tokenizers.Tokenizer, config: dict[str, Any] | None, **files: Any
) -> pathlib.Path:
    """Writes tokenizer.json, tokenizer_config.json (unless config is None) and other files."""
    path.mkdir(parents=True, exist_ok=True)
    backend.save(str(path / "tokenizer.json"))
    if config is not None:
        (path / "tokenizer_config.json").write_text(
            json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", **config})
        )
    for name, content in files.items():
        text = content if isinstance(content, str) else json.dumps(content)
        (path / name.replace("__", ".")).write_text(text, encoding="utf-8")
    return path


def _qwen_config(template: Any = QWEN_TEMPLATE) -> dict[str, Any]:
    return {
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "chat_template": template,
        "model_max_length": 32768,
    }


def _hf(path: pathlib.Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(str(path))


@pytest.fixture(scope="module")
def qwen_dir(
    backend: tokenizers.Tokenizer, tmp_path_factory: pytest.TempPathFactory
) -> pathlib.Path:
    return _write_dir(tmp_path_factory.mktemp("qwen"), backend, _qwen_config())


def test_byte_tokenizer_round_trip_and_specials():
    tok = ByteTokenizer()
    assert isinstance(tok, Tokenizer)
    assert (tok.vocab_size, tok.pad_id, tok.bos_id, tok.eos_id) == (259, 256, 257, 258)
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == list(text.encode("utf-8")) and all(0 <= i < 256 for i in ids)
        assert tok.decode(ids) == text
    ids = tok.encode("héllo", add_bos=True) + [tok.eos_id, tok.pad_id]
    assert ids[0] == 257
    assert tok.decode(ids) == "héllo"
    assert tok.decode(ids, skip_special_tokens=False) == "<bos>héllo<eos><pad>"
    assert tok.decode([0xC3]) == "\ufffd"  # A truncated UTF-8 sequence is replaced, not raised.
    with pytest.raises(ValueError, match="id 259"):
        tok.decode([259])


def test_byte_tokenizer_chat_template():
    tok = ByteTokenizer()
    assert tok.apply_chat_template(CONVERSATIONS[0]) == "User: What is 2 + 2?\nAssistant:"
    msgs = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "U"},
        {"role": "assistant", "content": "A"},
    ]
    assert (
        tok.apply_chat_template(msgs, add_generation_prompt=False)
        == "System: S\nUser: U\nAssistant: A\n"
    )
    with pytest.raises(ValueError, match="'tool'"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])


def test_hf_encode_decode_match_transformers(qwen_dir: pathlib.Path):
    ours, hf = HFTokenizer.from_dir(qwen_dir), _hf(qwen_dir)
    assert isinstance(ours, Tokenizer)
    assert ours.vocab_size == len(hf)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == hf.encode(text, add_special_tokens=False), text
        assert ours.encode(text, add_bos=True) == ids  # No bos token: add_bos is a no-op.
        assert ours.decode(ids, skip_special_tokens=False) == text
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(
                ids, skip_special_tokens=skip
            )
    assert ours.decode(ours.encode("<|im_start|>hi<|im_end|>")) == "hi"


def test_hf_special_ids_match_transformers(qwen_dir: pathlib.Path):
    ours, hf = HFTokenizer.from_dir(qwen_dir), _hf(qwen_dir)
    assert ours.eos_id == hf.eos_token_id == hf.convert_tokens_to_ids("<|im_end|>")
    assert ours.pad_id == hf.pad_token_id == hf.convert_tokens_to_ids("<|endoftext|>")
    assert ours.bos_id is None and hf.bos_token_id is None


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_hf_chat_template_matches_transformers(
    qwen_dir: pathlib.Path, conversation, add_generation_prompt
):
    ours, hf = HFTokenizer.from_dir(qwen_dir), _hf(qwen_dir)
    got = ours.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt)
    want = hf.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert got == want
    assert got.startswith("<|im_start|>system\n")
    assert got.endswith("<|im_start|>assistant\n") == add_generation_prompt
    assert ours.encode(got) == hf.encode(got, add_special_tokens=False)


def test_hf_bos_dict_tokens_and_plain_template_match_transformers(backend, tmp_path: pathlib.Path):
    config = {
        # The older layout: AddedToken dicts instead of strings.
        "bos_token": {"__type": "AddedToken", "content": "<s>", "lstrip": False, "rstrip": False},
        "eos_token": {"__type": "AddedToken", "content": "<|endoftext|>", "special": True},
        "chat_template": PLAIN_TEMPLATE,
    }
    d = _write_dir(tmp_path, backend, config)
    ours, hf = HFTokenizer.from_dir(d), _hf(d)
    assert (ours.bos_id, ours.eos_id) == (hf.bos_token_id, hf.eos_token_id)
    assert ours.pad_id == ours.eos_id and hf.pad_token_id is None  # pad falls back to eos.
    assert ours.encode("Hello", add_bos=True) == [ours.bos_id, *ours.encode("Hello")]
    for conversation in CONVERSATIONS:
        for gen in (True, False):
            want = hf.apply_chat_template(conversation, tokenize=False, add_generation_prompt=gen)
            assert ours.apply_chat_template(conversation, add_generation_prompt=gen) == want
    assert "日本語" in ours.apply_chat_template(CONVERSATIONS[1])  # tojson keeps non-ASCII.
    with pytest.raises(jinja2.TemplateError, match="Unknown role: tool"):
        ours.apply_chat_template([{"role": "tool", "content": "x"}])


def test_hf_template_sources(backend, tmp_path: pathlib.Path):
    listed = [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": "DEFAULT"}]
    d = _write_dir(tmp_path / "listed", backend, _qwen_config(listed))
    assert HFTokenizer.from_dir(d).apply_chat_template(CONVERSATIONS[0]) == "DEFAULT"
    # chat_template.jinja (the newer layout) takes precedence over tokenizer_config.json.
    d = _write_dir(
        tmp_path / "jinja",
        backend,
        _qwen_config(),
        chat_template__jinja="{{ messages[0].content }}!",
    )
    assert HFTokenizer.from_dir(d).apply_chat_template(CONVERSATIONS[0]) == "What is 2 + 2?!"
    assert _hf(d).apply_chat_template(CONVERSATIONS[0], tokenize=False) == "What is 2 + 2?!"


def test_hf_eos_fallbacks(backend, tmp_path: pathlib.Path):
    d = _write_dir(
        tmp_path / "map", backend, {}, special_tokens_map__json={"eos_token": "<|im_end|>"}
    )
    assert HFTokenizer.from_dir(d).eos_id == backend.token_to_id("<|im_end|>")
    eos_id = backend.token_to_id("<|endoftext|>")
    d = _write_dir(
        tmp_path / "gen", backend, None, generation_config__json={"eos_token_id": [eos_id, 0]}
    )
    tok = HFTokenizer.from_dir(d)
    assert tok.eos_id == tok.pad_id == eos_id and tok.bos_id is None


def test_load_tokenizer(qwen_dir: pathlib.Path):
    assert isinstance(load_tokenizer("byte"), ByteTokenizer)
    tok = load_tokenizer(str(qwen_dir))
    assert isinstance(tok, HFTokenizer) and tok.encode("Hello") == HFTokenizer.from_dir(
        qwen_dir
    ).encode("Hello")


def test_error_missing_path(tmp_path: pathlib.Path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match="neither 'byte' nor"):
        load_tokenizer(str(missing))
    with pytest.raises(FileNotFoundError, match=str(missing)):
        HFTokenizer.from_dir(missing)


def test_error_not_a_directory(tmp_path: pathlib.Path):
    f = tmp_path / "tokenizer.json"
    f.write_text("{}")
    with pytest.raises(ValueError, match=f"{f} is not a directory"):
        load_tokenizer(str(f))


def test_error_no_tokenizer_json(tmp_path: pathlib.Path):
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(FileNotFoundError) as e:
        HFTokenizer.from_dir(tmp_path)
    assert str(tmp_path / "tokenizer.json") in str(e.value) and "Hugging Face" in str(e.value)


def test_error_unparsable_files(backend, tmp_path: pathlib.Path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "tokenizer.json").write_text('{"model": broken')
    with pytest.raises(ValueError, match=str(tmp_path / "a" / "tokenizer.json")):
        HFTokenizer.from_dir(tmp_path / "a")
    d = _write_dir(tmp_path / "b", backend, _qwen_config())
    (d / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ValueError, match=str(d / "tokenizer_config.json")):
        HFTokenizer.from_dir(d)


def test_error_eos_not_in_vocab(backend, tmp_path: pathlib.Path):
    d = _write_dir(tmp_path, backend, {**_qwen_config(), "eos_token": "<|nope|>"})
    with pytest.raises(ValueError) as e:
        HFTokenizer.from_dir(d)
    assert "<|nope|>" in str(e.value) and str(d / "tokenizer_config.json") in str(e.value)
    d = _write_dir(tmp_path / "none", backend, None)
    with pytest.raises(ValueError, match="No eos token"):
        HFTokenizer.from_dir(d)


def test_error_no_chat_template(backend, tmp_path: pathlib.Path):
    d = _write_dir(tmp_path, backend, _qwen_config(template=None))
    tok = HFTokenizer.from_dir(d)
    assert tok.encode("Hello")  # Everything but the chat template works.
    with pytest.raises(ValueError, match=f"{d} has no chat template"):
        tok.apply_chat_template(CONVERSATIONS[0])
