"""Supervised warm start: next-token cross-entropy on (prompt, answer) records.

A from-scratch model has nothing for RL to reinforce; a few hundred SFT steps on the task's
training split give it a non-zero held-out accuracy to start from. `SftTrainer` runs it on a
Learner's params with its own optimizer and hands the result back (`commit`), so the RL phase
continues from it; it lives where the learner lives (this process, or the Ray learner worker) and
rl.run drives it step by step in either runtime.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from learner.batching import Batch, length_bucket
from learner.config import OptimizerConfig
from learner.state import TrainState, create_train_state, make_optimizer
from rl.models.tokenizer import Tokenizer
from rl.tasks.templates import render_prompt


def sft_batch(
    records: Sequence[Mapping[str, Any]],
    tokenizer: Tokenizer,
    *,
    min_length_bucket: int = 32,
    examples_per_row: int = 1,
    **prompt_kwargs: Any,
) -> Batch:
    """Rows of prompt + answer + eos; the loss mask covers each answer and its eos.

    With `examples_per_row` k > 1, each row holds k records one after another, attending across
    them (one sequence, not packed segments): the model learns to answer after earlier problems
    and answers in its context, as it must in a multi-turn episode (rl/envs). `prompt_kwargs`
    (template, system, instruction) go to rl.tasks.templates.render_prompt.
    """
    if not records:
        raise ValueError("sft_batch received no records; expected at least one.")
    if examples_per_row < 1:
        raise ValueError(f"examples_per_row must be >= 1; received {examples_per_row}.")
    rows: list[tuple[list[int], list[float]]] = []
    for i, r in enumerate(records):
        if "answer" not in r:
            raise ValueError(f"SFT record id={r.get('id')} has no 'answer'; keys: {sorted(r)}.")
        prompt = list(render_prompt(r, tokenizer, **prompt_kwargs))
        answer = [*tokenizer.encode(str(r["answer"])), tokenizer.eos_id]
        if i % examples_per_row == 0:
            rows.append(([], []))
        tokens, weights = rows[-1]
        tokens += prompt + answer
        weights += [0.0] * len(prompt) + [1.0] * len(answer)
    b = len(rows)
    t = length_bucket(max(len(tokens) - 1 for tokens, _ in rows), min_length_bucket)
    out = Batch(
        *(np.zeros((b, t), np.int32) for _ in range(4)),
        loss_mask=np.zeros((b, t), np.float32),
        advantages=np.zeros((b,), np.float32),
        behavior_logp=np.zeros((b, t), np.float32),
    )
    for i, (tokens, weights) in enumerate(rows):
        seq = np.asarray(tokens, np.int32)
        n = len(seq) - 1
        out.inputs[i, :n], out.targets[i, :n] = seq[:-1], seq[1:]
        out.positions[i, :n], out.segments[i, :n] = np.arange(n), 1
        out.loss_mask[i, :n] = weights[1:]  # target j is token j + 1
    return out


def sft_step(
    state: TrainState,
    batch: Batch,
    frozen: Any = None,
    *,
    graphdef: nnx.GraphDef,
    tx: optax.GradientTransformation,
) -> tuple[TrainState, dict[str, jax.Array]]:
    """One cross-entropy update on the answer tokens (token mean) of `state.params` (every
    parameter, or the LoRA adapters over the `frozen` base)."""
    frozen = nnx.State({}) if frozen is None else frozen

    def loss_fn(params: Any) -> jax.Array:
        logp = nnx.merge(graphdef, params, frozen).token_logprobs(
            batch.inputs, batch.positions, batch.segments, batch.targets
        )
        return -jnp.sum(logp * batch.loss_mask) / jnp.maximum(jnp.sum(batch.loss_mask), 1.0)

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    new = TrainState(
        params=optax.apply_updates(state.params, updates),
        opt_state=opt_state,
        step=state.step + 1,
    )
    return new, {"loss": loss, "grad_norm": optax.tree.norm(grads)}


def sft_batches(
    records: Sequence[Mapping[str, Any]],
    tokenizer: Tokenizer,
    *,
    batch_size: int,
    seed: int = 0,
    min_length_bucket: int = 32,
    examples_per_row: int = 1,
    **prompt_kwargs: Any,
) -> Iterator[Batch]:
    """Endless shuffled batches (one shuffle per epoch, seeded); the rest as sft_batch."""
    rng = np.random.default_rng(seed)
    while True:
        order = rng.permutation(len(records))
        for i in range(0, len(order) - batch_size + 1, batch_size):
            batch = [records[j] for j in order[i : i + batch_size]]
            yield sft_batch(
                batch,
                tokenizer,
                min_length_bucket=min_length_bucket,
                examples_per_row=examples_per_row,
                **prompt_kwargs,
            )


def make_sft_step(
    graphdef: nnx.GraphDef, tx: optax.GradientTransformation, shardings: Any = None
) -> Any:
    """The jitted step, donating the state (shardings: a TrainState of NamedShardings, or None)."""
    out = {} if shardings is None else dict(out_shardings=(shardings, None))
    return jax.jit(
        functools.partial(sft_step, graphdef=graphdef, tx=tx), donate_argnums=(0,), **out
    )


class SftTrainer:
    """The SFT warm start of a Learner: steps on its params with an own Adam; `commit` gives the
    learner the result (its RL optimizer state is untouched).

    Args:
      learner: a learner.learner.Learner (its params, graphdef, mesh and rules).
      records: training records with "answer"; at least `batch_size` of them.
      tokenizer: the run's tokenizer.
      batch_size, lr, warmup_steps: config.sft's.
      seed: the batches' shuffle seed.
      min_length_bucket: rows are padded to length buckets from this size (as in RL).
      examples_per_row: records one after another in a row (`sft_batch`).
      prompt_kwargs: rl.tasks.templates.render_prompt's (template, system, instruction).
    """

    def __init__(
        self,
        learner: Any,
        records: Sequence[Mapping[str, Any]],
        tokenizer: Tokenizer,
        *,
        batch_size: int,
        lr: float,
        warmup_steps: int,
        seed: int,
        min_length_bucket: int,
        examples_per_row: int = 1,
        **prompt_kwargs: Any,
    ):
        if len(records) < batch_size:
            raise ValueError(
                f"config.sft.batch_size={batch_size} exceeds the {len(records)} training "
                "records; expected a smaller batch or config.sft.max_steps=0."
            )
        self.learner = learner
        tx = make_optimizer(OptimizerConfig(lr=lr, warmup_steps=warmup_steps))
        self.state, shardings = create_train_state(  # the learner's trained params only
            learner.state.params, tx, mesh=learner.mesh, rules=learner.rules
        )
        self._step = make_sft_step(learner.graphdef, tx, shardings)
        self._batches = sft_batches(
            records,
            tokenizer,
            batch_size=batch_size,
            seed=seed,
            min_length_bucket=min_length_bucket,
            examples_per_row=examples_per_row,
            **prompt_kwargs,
        )
        self._loss: jax.Array | None = None

    def step(self) -> None:
        """One SFT update (dispatched; nothing waits for it)."""
        self.state, metrics = self._step(self.state, next(self._batches), self.learner.frozen)
        self._loss = metrics["loss"]

    def loss(self) -> float:
        """The last step's loss."""
        if self._loss is None:
            raise RuntimeError("SftTrainer.loss() before any step; expected step() first.")
        return float(self._loss)

    def commit(self) -> None:
        """The learner takes the SFT params (and its KL reference follows them)."""
        self.learner.set_params(self.state.params)
