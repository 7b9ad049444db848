"""SFT warm start: masks cover the answer, training raises held-out accuracy measured by the engine."""

import numpy as np
import pytest

from learner.config import OptimizerConfig
from learner.sft import make_sft_step, sft_batch, sft_batches
from learner.state import create_train_state, make_optimizer
from rl.evaluate import evaluate
from rl.models import ByteTokenizer, create_model, get_preset
from rl.rewards import RewardRunner, get_reward
from rl.tasks.synthetic import addition_records
from sampler.engine import Engine, EngineConfig

TOK = ByteTokenizer()


def test_sft_batch_masks_answer_and_eos_only():
    batch = sft_batch([{"id": 0, "question": "1+2=", "answer": "3"}], TOK)
    n = len("1+2=") + 1  # bos + question
    assert batch.loss_mask[0].tolist()[: n + 2] == [0.0] * (n - 1) + [1.0, 1.0, 0.0]
    assert batch.targets[0, n - 1] == ord("3") and batch.targets[0, n] == TOK.eos_id
    with pytest.raises(ValueError, match="has no 'answer'"):
        sft_batch([{"id": 5, "question": "x"}], TOK)
    assert batch.inputs.shape == (1, 32)  # padded to the default bucket
    rows = [{"id": i, "question": "1+2=", "answer": "3"} for i in range(4)]
    small = next(sft_batches(rows, TOK, batch_size=2, min_length_bucket=8))
    assert small.inputs.shape == (2, 8)  # as the RL learner pads (learner.min_length_bucket)


def test_sft_rows_of_several_examples_attend_across_and_train_every_answer():
    """examples_per_row=2: one sequence (one segment, positions 0..n-1) holding both records, the
    loss on each answer and its eos: the second answer is learned after the first problem."""
    recs = [{"id": i, "question": f"{i}+1=", "answer": str(i + 1)} for i in (1, 2, 3)]
    batch = sft_batch(recs, TOK, examples_per_row=2, min_length_bucket=8)
    assert batch.inputs.shape == (2, 16)  # rows [1, 2] and [3]
    one = [TOK.bos_id, *TOK.encode("1+1="), *TOK.encode("2"), TOK.eos_id]
    two = [TOK.bos_id, *TOK.encode("2+1="), *TOK.encode("3"), TOK.eos_id]
    seq = one + two
    n = len(seq) - 1
    assert batch.inputs[0, :n].tolist() == seq[:-1] and batch.targets[0, :n].tolist() == seq[1:]
    assert batch.positions[0, :n].tolist() == list(range(n)) and set(batch.segments[0, :n]) == {1}
    trained = [
        TOK.decode([t]) if t != TOK.eos_id else "<e>"
        for t, m in zip(batch.targets[0], batch.loss_mask[0], strict=True)
        if m
    ]
    assert trained == ["2", "<e>", "3", "<e>"]
    assert batch.loss_mask[1].sum() == 2  # the last row: record 3 alone
    with pytest.raises(ValueError, match="examples_per_row must be >= 1"):
        sft_batch(recs, TOK, examples_per_row=0)


@pytest.mark.slow
def test_sft_raises_heldout_accuracy():
    import jax
    from flax import nnx

    model = create_model(get_preset("tiny", d_model=128, head_dim=32, mlp_dim=384), seed=0)
    graphdef, params = nnx.split(model)
    tx = make_optimizer(OptimizerConfig(lr=3e-3))
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"))
    state, shardings = create_train_state(params, tx, mesh=mesh)
    train = addition_records(80, digits=1, seed=0, split="train")
    heldout = addition_records(6, digits=1, seed=0, split="heldout")
    engine = Engine(model, EngineConfig(max_slots=16, max_length=32, max_prefill_length=16))
    reward = RewardRunner(get_reward("exact"), decode=TOK.decode, timeout_s=5.0)

    def accuracy(p):
        return evaluate(engine, p, heldout, TOK, reward, max_new_tokens=4, k=4)

    before = accuracy(params)
    step = make_sft_step(graphdef, tx, shardings)
    batches = sft_batches(train, TOK, batch_size=30, seed=0)
    for _ in range(150):
        state, metrics = step(state, next(batches))
    after = accuracy(state.params)
    reward.close()
    assert before["accuracy"] == 0.0
    assert after["accuracy"] >= 0.5, after
    assert after["pass@4"] >= 0.5
    assert float(metrics["loss"]) < 1.0
