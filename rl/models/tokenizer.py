"""Tokenizers: a built-in byte tokenizer for synthetic tasks and a local Hugging Face loader.

`load_tokenizer("byte")` needs no files; `load_tokenizer("/path/to/model")` reads a Hugging Face
tokenizer directory offline and matches `transformers.AutoTokenizer` on `encode(text,
add_special_tokens=False)`, `decode` and `apply_chat_template(..., tokenize=False)`.
"""

from __future__ import annotations

import datetime
import json
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import jinja2
import jinja2.ext
import jinja2.nodes
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

# The named special tokens transformers hands to chat templates (its SPECIAL_TOKENS_ATTRIBUTES);
# the first three must be in the vocabulary, since their ids are used.
_TOKEN_KEYS = tuple(f"{n}_token" for n in ("eos", "bos", "pad", "unk", "sep", "cls", "mask"))
Messages = Sequence[Mapping[str, str]]


@runtime_checkable
class Tokenizer(Protocol):
    """What the rest of the library needs from a tokenizer."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def bos_id(self) -> int | None: ...

    @property
    def eos_id(self) -> int: ...

    @property
    def pad_id(self) -> int: ...

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]: ...

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(self, messages: Messages, *, add_generation_prompt: bool = True) -> str:
        """Returns the rendered conversation as text; the caller encodes it."""
        ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, then pad=256, bos=257, eos=258 (vocab_size 259).

    Chat template: each message renders as "System: {content}\\n", "User: {content}\\n" or
    "Assistant: {content}\\n" by role; the generation prompt appends "Assistant:" (no trailing
    space), so `[{"role": "user", "content": "2+2?"}]` renders "User: 2+2?\\nAssistant:".
    """

    PAD_ID, BOS_ID, EOS_ID = 256, 257, 258
    _SPECIAL_TEXT = {PAD_ID: "<pad>", BOS_ID: "<bos>", EOS_ID: "<eos>"}
    _ROLE_PREFIX = {"system": "System", "user": "User", "assistant": "Assistant"}

    vocab_size: int = 259
    bos_id: int | None = BOS_ID
    eos_id: int = EOS_ID
    pad_id: int = PAD_ID

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
        """Returns the UTF-8 bytes of `text`, preceded by bos if `add_bos`."""
        return ([self.BOS_ID] if add_bos else []) + list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Decodes bytes with errors="replace"; specials are dropped or shown as "<eos>" etc."""
        pieces: list[str] = []
        buf = bytearray()
        for i in map(int, ids):
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"ByteTokenizer.decode got id {i}; expected 0 <= id < 259.")
            if i < 256:
                buf.append(i)
            elif not skip_special_tokens:
                pieces.append(buf.decode("utf-8", errors="replace") + self._SPECIAL_TEXT[i])
                buf = bytearray()
        return "".join(pieces) + buf.decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: Messages, *, add_generation_prompt: bool = True) -> str:
        """Renders `messages` in the fixed format of the class docstring."""
        turns = []
        for k, m in enumerate(messages):
            if m.get("role") not in self._ROLE_PREFIX or not isinstance(m.get("content"), str):
                raise ValueError(
                    f"ByteTokenizer.apply_chat_template: message {k} is {dict(m)!r}; expected a "
                    f"'role' in {sorted(self._ROLE_PREFIX)} and a string 'content'."
                )
            turns.append(f"{self._ROLE_PREFIX[m['role']]}: {m['content']}\n")
        return "".join(turns) + ("Assistant:" if add_generation_prompt else "")


class _GenerationTag(jinja2.ext.Extension):
    """transformers' `{% generation %}...{% endgeneration %}` tag; renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, **kwargs: Any) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, **kwargs)  # Unlike jinja's: no HTML escaping.


def _compile_template(source: str) -> jinja2.Template:
    """Compiles a chat template in the environment transformers uses."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(source)


def _read_json(path: pathlib.Path) -> dict[str, Any]:
    """Returns the JSON object in `path`, or {} if there is no such file."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"Could not parse {path} as JSON: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} holds a JSON {type(data).__name__}; expected an object.")
    return data


def _token_id(backend: tokenizers.Tokenizer, token: str, key: str, where: str) -> int:
    token_id = backend.token_to_id(token)
    if token_id is None:
        raise ValueError(f"{key} {token!r} named in {where} is not in the tokenizer vocabulary.")
    return token_id


class HFTokenizer:
    """A `tokenizers.Tokenizer` with the special tokens and chat template of a Hugging Face dir.

    `encode(text)` equals transformers' `encode(text, add_special_tokens=False)`; `add_bos=True`
    prepends bos when the tokenizer has one. `pad_id` falls back to `eos_id`.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        special_tokens: Mapping[str, str],
        chat_template: str | None = None,
        source: str = "<in-memory tokenizer>",
    ):
        """Wraps a loaded backend.

        Args:
            backend: The `tokenizers.Tokenizer` that encodes and decodes.
            special_tokens: Token texts by name ("eos_token" required; "bos_token", "pad_token",
                "unk_token", ... optional); all are passed to the chat template, and eos, bos and
                pad must be in the vocabulary.
            chat_template: Jinja chat template source, or None if there is none.
            source: Where the tokenizer came from, for error messages.
        """
        if "eos_token" not in special_tokens:
            raise ValueError(
                f"special_tokens is {dict(special_tokens)}; expected an 'eos_token' entry."
            )
        ids = {
            k: _token_id(backend, v, k, source)
            for k, v in special_tokens.items()
            if k in _TOKEN_KEYS[:3]
        }
        self._backend, self._source, self._chat_template = backend, source, chat_template
        self._special_tokens = dict(special_tokens)
        self._eos_id: int = ids["eos_token"]
        self._bos_id: int | None = ids.get("bos_token")
        self._pad_id: int = ids.get("pad_token", self._eos_id)
        self._compiled: jinja2.Template | None = None

    @classmethod
    def from_dir(cls, path: str | pathlib.Path) -> HFTokenizer:
        """Loads `tokenizer.json` and the optional config files of a Hugging Face directory.

        Special tokens come from tokenizer_config.json, then special_tokens_map.json for missing
        ones (strings or {"content": ...} dicts); eos falls back to generation_config.json's
        `eos_token_id`. The chat template is chat_template.jinja if present, else
        tokenizer_config.json's `chat_template` (a string, or a list of {"name", "template"} whose
        "default" is used).

        Args:
            path: The directory.

        Returns:
            The loaded tokenizer.
        """
        d = pathlib.Path(path)
        if not d.is_dir():
            what = "is not a directory" if d.exists() else "does not exist"
            raise (ValueError if d.exists() else FileNotFoundError)(
                f"Tokenizer path {d} {what}; expected a Hugging Face tokenizer directory."
            )
        tok_file = d / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(
                f"{tok_file} not found: a Hugging Face tokenizer directory needs tokenizer.json "
                f"(found: {sorted(p.name for p in d.iterdir())})."
            )
        try:
            backend = tokenizers.Tokenizer.from_file(str(tok_file))
        except Exception as e:  # tokenizers raises a bare Exception on malformed files.
            raise ValueError(f"Could not parse {tok_file} as a tokenizers file: {e}") from e

        names = ("tokenizer_config.json", "special_tokens_map.json", "generation_config.json")
        config_file, map_file, gen_file = (d / n for n in names)
        config = _read_json(config_file)
        tokens: dict[str, str] = {}
        for file, data in ((config_file, config), (map_file, _read_json(map_file))):
            for key in _TOKEN_KEYS:
                value = data.get(key)
                text = value.get("content") if isinstance(value, dict) else value
                if key not in tokens and isinstance(text, str):
                    tokens[key] = text
                    if key in _TOKEN_KEYS[:3]:
                        _token_id(backend, text, key, f"{file} (vocabulary of {tok_file})")
        if "eos_token" not in tokens:
            eos = _read_json(gen_file).get("eos_token_id")
            eos = eos[0] if isinstance(eos, list) and eos else eos
            if not isinstance(eos, int) or backend.id_to_token(eos) is None:
                raise ValueError(
                    f"No eos token for {d}: expected 'eos_token' in {config_file.name} or "
                    f"{map_file.name}, or an in-vocabulary 'eos_token_id' in {gen_file.name}; "
                    f"got eos_token_id={eos!r}."
                )
            tokens["eos_token"] = backend.id_to_token(eos)

        template = config.get("chat_template")
        if isinstance(template, list):
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        if (d / "chat_template.jinja").is_file():
            template = (d / "chat_template.jinja").read_text(encoding="utf-8")
        template = template if isinstance(template, str) else None
        return cls(backend, special_tokens=tokens, chat_template=template, source=str(d))

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_id(self) -> int | None:
        return self._bos_id

    @property
    def eos_id(self) -> int:
        return self._eos_id

    @property
    def pad_id(self) -> int:
        return self._pad_id

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
        """Encodes `text` without post-processor specials; prepends bos if asked and defined."""
        ids = self._backend.encode(text, add_special_tokens=False).ids
        return [self._bos_id, *ids] if add_bos and self._bos_id is not None else ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Decodes `ids`, dropping special tokens if `skip_special_tokens`."""
        return self._backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Messages, *, add_generation_prompt: bool = True) -> str:
        """Renders `messages` like transformers' `apply_chat_template(..., tokenize=False)`.

        Args:
            messages: Dicts with "role" and "content"; keys whose value is None are dropped.
            add_generation_prompt: Whether to append the header that opens an assistant turn.

        Returns:
            The rendered text (it holds any bos the template adds; encode it with `encode`).
        """
        if self._chat_template is None:
            raise ValueError(
                f"Tokenizer {self._source} has no chat template: expected chat_template.jinja or "
                "a 'chat_template' (string, or list with a 'default') in tokenizer_config.json."
            )
        if not messages:
            raise ValueError("apply_chat_template got no messages; expected at least one.")
        if self._compiled is None:
            self._compiled = _compile_template(self._chat_template)
        chat = [{k: v for k, v in m.items() if v is not None} for m in messages]
        return self._compiled.render(
            messages=chat,
            tools=None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **self._special_tokens,
        )


def load_tokenizer(spec: str) -> Tokenizer:
    """Returns `ByteTokenizer()` for "byte", else `HFTokenizer.from_dir(spec)`.

    Args:
        spec: "byte", or the local path of a Hugging Face tokenizer directory.

    Returns:
        The tokenizer.
    """
    if spec == "byte":
        return ByteTokenizer()
    if not pathlib.Path(spec).exists():
        raise FileNotFoundError(
            f"Tokenizer spec {spec!r} is neither 'byte' nor an existing path; expected 'byte' or "
            "the local path of a Hugging Face tokenizer directory."
        )
    return HFTokenizer.from_dir(spec)
