"""Tests for rl/tasks/pipeline.py (and the templates it renders with, rl/tasks/templates.py)."""

from __future__ import annotations

import itertools
import json

import grain
import pytest

from rl.models.tokenizer import ByteTokenizer
from rl.tasks.pipeline import prompt_dataset, records_fingerprint
from rl.tasks.synthetic import addition_records, countdown_records
from rl.tasks.templates import render_prompt
from rl.types import UID_LIMIT, Prompt

TOK = ByteTokenizer()
BOS = ByteTokenizer.BOS_ID
N = 100  # grain's index_shuffle costs ~70 ms an epoch for small N: keep epochs few


class NoBosTokenizer(ByteTokenizer):
    bos_id = None


class BosTemplateTokenizer(ByteTokenizer):
    """A chat template that writes bos itself (like Llama 3's); bos is encoded from its text."""

    def apply_chat_template(self, messages, *, add_generation_prompt=True):
        return "<bos>" + super().apply_chat_template(messages, add_generation_prompt=True)

    def encode(self, text, *, add_bos=False):
        ids = super().encode(text.removeprefix("<bos>"), add_bos=add_bos)
        return [self.BOS_ID, *ids] if text.startswith("<bos>") else ids


def take(ds_or_it, k: int | None = None) -> list[Prompt]:
    it = iter(ds_or_it)
    return list(it) if k is None else list(itertools.islice(it, k))


# Templates.


def test_plain_template():
    record = {"id": 0, "question": "12+3="}
    assert render_prompt(record, TOK) == (BOS, *b"12+3=")
    assert render_prompt(record, TOK, instruction="Add. ") == (BOS, *b"Add. 12+3=")
    assert render_prompt(record, NoBosTokenizer()) == tuple(b"12+3=")


def test_chat_template():
    record = {"id": 0, "question": "2+2?"}
    assert render_prompt(record, TOK, template="chat") == (BOS, *b"User: 2+2?\nAssistant:")
    got = render_prompt(record, TOK, template="chat", system="Be brief.", instruction="Q: ")
    assert got == (BOS, *b"System: Be brief.\nUser: Q: 2+2?\nAssistant:")
    assert render_prompt(record, NoBosTokenizer(), template="chat") == tuple(
        b"User: 2+2?\nAssistant:"
    )
    # The template's own bos is kept and not doubled.
    assert render_prompt(record, BosTemplateTokenizer(), template="chat") == (
        BOS,
        *b"User: 2+2?\nAssistant:",
    )


def test_template_errors():
    with pytest.raises(ValueError, match=r"template must be one of .*received 'jinja'"):
        render_prompt({"id": 0, "question": "q"}, TOK, template="jinja")
    with pytest.raises(ValueError, match=r"system='S' needs template='chat'"):
        render_prompt({"id": 0, "question": "q"}, TOK, system="S")
    with pytest.raises(
        ValueError, match=r"string 'question'; received id=4 with keys \['id', 'q'\]"
    ):
        render_prompt({"id": 4, "q": "x"}, TOK)


# Pipeline.


def test_epochs_cover_every_record_once_in_shuffled_order():
    records = addition_records(N, seed=0)
    prompts = take(prompt_dataset(records, TOK, seed=3, num_epochs=3))
    assert len(prompts) == 3 * N  # a finite stream ends
    orders = [[p.meta["id"] for p in prompts[e * N : (e + 1) * N]] for e in range(3)]
    for e, order in enumerate(orders):
        assert sorted(order) == list(range(N))
        assert [p.uid for p in prompts[e * N : (e + 1) * N]] == [e * N + i for i in order]
    assert orders[0] != list(range(N)) and len({tuple(o) for o in orders}) == 3  # reshuffled
    for p in prompts:
        record = records[p.meta["id"]]
        assert p.tokens == render_prompt(record, TOK)
        assert p.meta == {"id": record["id"], "answer": record["answer"]}
    # Same seed, same order; another seed, another order; no shuffle, file order.
    assert take(prompt_dataset(records, TOK, seed=3, num_epochs=3)) == prompts
    assert take(prompt_dataset(records, TOK, seed=4, num_epochs=1)) != prompts[:N]
    unshuffled = take(prompt_dataset(records, TOK, shuffle=False, num_epochs=2))
    assert [p.uid for p in unshuffled] == list(range(2 * N))


def test_meta_fields_and_chat_template():
    records = countdown_records(4, count=3, max_number=20, max_target=50)
    ds = prompt_dataset(records, TOK, template="chat", system="S", num_epochs=1, shuffle=False)
    for p, r in zip(take(ds), records, strict=True):
        assert p.meta == {
            "id": r["id"],
            "answer": r["answer"],
            "numbers": tuple(r["numbers"]),
            "target": r["target"],
        }
        assert p.tokens == render_prompt(r, TOK, template="chat", system="S")
    ds = prompt_dataset(records, TOK, num_epochs=1, meta_fields=("target", "missing"))
    assert all(set(p.meta) == {"id", "target"} for p in take(ds))


@pytest.mark.parametrize("shard_count", [1, 3, 4])
def test_shards_are_disjoint_and_cover_the_stream(shard_count):
    records = addition_records(N, seed=0)
    full = take(prompt_dataset(records, TOK, seed=1, num_epochs=2))
    shards = [
        take(
            prompt_dataset(
                records, TOK, seed=1, num_epochs=2, shard_index=s, shard_count=shard_count
            )
        )
        for s in range(shard_count)
    ]
    for s, shard in enumerate(shards):
        assert shard == full[s::shard_count]
    uids = [p.uid for shard in shards for p in shard]
    assert len(uids) == len(set(uids)) == 2 * N and set(uids) == {p.uid for p in full}


def test_infinite_stream_uids_are_unique_and_bounded():
    prompts = take(prompt_dataset(addition_records(N, seed=0), TOK, seed=2), 4 * N)
    uids = [p.uid for p in prompts]
    assert len(set(uids)) == len(uids) and all(0 <= u < UID_LIMIT for u in uids)
    for e in range(4):
        assert sorted(p.meta["id"] for p in prompts[e * N : (e + 1) * N]) == list(range(N))


@pytest.mark.parametrize(
    "kwargs", [{}, {"num_epochs": 2}, {"shard_index": 1, "shard_count": 3}, {"shuffle": False}]
)
def test_iterator_state_round_trips_through_json(kwargs):
    ds = prompt_dataset(addition_records(N, seed=0), TOK, seed=5, **kwargs)
    reference = take(ds, 2 * N if "num_epochs" not in kwargs else None)
    for cut in (0, N - 1, N + 3):  # around the first epoch boundary
        it = iter(ds)
        head = take(it, cut)
        state = json.loads(json.dumps(it.get_state()))
        resumed = iter(prompt_dataset(addition_records(N, seed=0), TOK, seed=5, **kwargs))
        resumed.set_state(state)
        tail = take(resumed, len(reference) - cut)
        assert head + tail == reference, cut
        assert take(it, len(reference) - cut) == tail  # the original iterator goes on the same


def test_read_options_and_dataset_type():
    ds = prompt_dataset(
        addition_records(N), TOK, num_epochs=1, read_options=grain.ReadOptions(num_threads=1)
    )
    assert isinstance(ds, grain.IterDataset) and len(take(ds)) == N


@pytest.mark.parametrize(
    "records, kwargs, match",
    [
        ([], {}, r"non-empty sequence of records; received 0 records"),
        ([{"id": 0}], {}, r"Record 0 must be a mapping with an 'id' and a string 'question'"),
        ([{"question": "q"}], {}, r"Record 0 must .*received \['question'\]"),
        ([{"id": 0, "question": "q"}], {"shard_index": 2, "shard_count": 2},
         r"shard_index must be an int in \[0, 2\); received 2"),
        ([{"id": 0, "question": "q"}], {"shard_count": 0}, r"shard_count must be an int >= 1"),
        ([{"id": 0, "question": "q"}], {"num_epochs": 0}, r"num_epochs must be None .* received 0"),
        ([{"id": 0, "question": "q"}], {"seed": -1}, r"seed must be an int in \[0, 2\*\*32\)"),
        ([{"id": 0, "question": "q"}], {"template": "x"}, r"template must be one of"),
    ],
)  # fmt: skip
def test_bad_arguments(records, kwargs, match):
    with pytest.raises(ValueError, match=match):
        prompt_dataset(records, TOK, **kwargs)


def test_records_fingerprint():
    records = countdown_records(20, count=3, max_number=20)
    fp = records_fingerprint(records)
    assert len(fp) == 16 and fp == records_fingerprint(
        countdown_records(20, count=3, max_number=20)
    )
    assert fp != records_fingerprint(records[::-1])
    assert fp != records_fingerprint([*records[:-1], {**records[-1], "target": -1}])
