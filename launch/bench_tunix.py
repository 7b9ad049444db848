"""Learner step vs Google Tunix's GRPO train step: loss tokens per second, one process, alternating.

    python -m launch.bench_tunix --json /tmp/bench_tunix.json  # needs `pip install google-tunix`

One process, one device, one model: the "tiny" preset (qwen3: vocab 259, d_model 64, 2 layers, 4
heads, 2 kv heads, head_dim 16, mlp 128, q/k norms, tied embeddings, float32) with rope_theta 1e6
(Tunix 0.1.7's Qwen3 attention ignores ModelConfig.rope_theta and always rotates with 1e6; the
FLOPs are the same). Our randomly initialised parameters are written as a Hugging Face directory
(rl.models.save_hf) and loaded into `tunix.models.qwen3` with Tunix's own safetensors loader, so
both sides start from the same weights and the first update's loss and gradient norm must agree.

Every update trains on fresh seeded groups: 8 prompts of 12-20 tokens x G = 8 completions of
uniform random length 1-64, sampler log-probs near a uniform policy's, 0/1 rewards -> GRPO
advantages (std with ddof 1 on both sides). The loss is PPO-clip (epsilon 0.2 both ways), no KL
(beta 0), old log-probs given (the sampler's: no extra forward on either side), aggregated per
sequence then over sequences (`--aggregation`, Tunix's GRPO default; `token_mean` is the other
choice), AdamW lr 1e-4 after global-norm clipping at 1.0 (the same optax chain on both sides), one
optimizer step per update on the whole update. Contestants, timed per update, in rotating order
(A, B, C; B, C, A; ...) so the machine's load falls on each:
  ours        Learner.begin_round(1) + add_groups(groups) + update() on a one-device mesh: GRPO
              advantages, packed micro-batches (learner.packing, default rows), device_put, the
              accumulate/apply jits, the metrics fetch ending every update.
  tunix       what GRPOLearner runs per update after rollout: the groups padded as Tunix pads them
              (prompts left-padded to 20, completions right-padded to 64, pad id 0), Tunix's
              advantage estimator, a `TrainExample`, then `rl.trainer.Trainer.train([example])`
              (RLCluster.update_actor's call, under the actor mesh) with the loss function
              GRPOLearner installs (`grpo_loss_fn`), then a block on the new parameters.
  tunix_step  the same example through Tunix's jitted train step alone (a second Trainer's
              `jit_train_and_eval_step`), loss and grad norm fetched: Tunix minus its Python loop.
`--micro_batch_rows` sets ours' micro-batch (rows of up to 128 positions; LearnerConfig's default
16: 2,048 positions, two micro-batches an update, the second of half the budget when what is left
fits: `--flush_halvings`, LearnerConfig's default 1), `--tunix_accumulation k` splits Tunix's update
into k micro-steps of 8 / k groups (gradient accumulation, as RLCluster's train_micro_batch_size
does; seq_mean_token_mean only, where the micro-steps' mean loss is the update's): on XLA:CPU both
sides run faster on smaller micro-batches, so compare them at the same granularity too.
The first `--warmup` updates are not timed (Tunix's Trainer traces its step twice: warm-up 2).
Reported per side: XLA programs compiled before the timed updates (tiny eager ops included) and
their seconds (jax.monitoring), start seconds (building, compiling, warm-up), median ms per update,
loss tokens (response tokens, counted identically) and model positions (the padded area: our
packed micro-batches, Tunix's 64 x 84 rows) per update, tokens/s, the first update's loss and
gradient norm. The headline is ours / tunix tokens/s over the timed updates ("per trained token"),
with the min / median / max of the per-update ratios; then that no compile happened while timing
(if one did, the program exits non-zero after its table, naming the count) and the largest loss
difference of the two trajectories (same weights, data and optimizer: about
1e-8 expected). Expect parity within the machine's noise on a shared 2-core CPU (0.8-1.2x pairs).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import jax
import numpy as np
from absl import app, flags
from flax import nnx

from launch import bench_util
from learner.config import LearnerConfig, OptimizerConfig
from learner.learner import Learner
from learner.mesh import MeshConfig, make_meshes
from learner.state import make_optimizer
from rl.losses import LossConfig, PpoClipOptions
from rl.models import ModelConfig, create_model, get_preset, save_hf
from rl.types import Completion, Group, Request, SamplingParams

_JSON = flags.DEFINE_string("json", "", "Write the results here as JSON; empty: don't.")
_UPDATES = flags.DEFINE_integer("updates", 16, "Timed updates per side (after the warm-up).")
_WARMUP = flags.DEFINE_integer("warmup", 2, "Untimed updates per side first (compiles).")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the model init and of the groups.")
_AGGREGATION = flags.DEFINE_enum(
    "aggregation",
    "seq_mean_token_mean",
    ["seq_mean_token_mean", "token_mean"],  # TUNIX_AGGREGATION's keys
    "Loss aggregation (ours; Tunix's loss_agg_mode of the same math).",
)
_TUNIX_STEP = flags.DEFINE_bool(
    "tunix_step", True, "Also time Tunix's jitted train step without its Trainer loop."
)
_ROWS = flags.DEFINE_integer(
    "micro_batch_rows",
    0,
    "Ours: learner.micro_batch_rows (a micro-batch holds this many rows of the longest row "
    "length, 128 here); 0: LearnerConfig's default.",
)
_FLUSH = flags.DEFINE_integer(
    "flush_halvings",
    -1,
    "Ours: learner.flush_halvings k (an update's last micro-batch may take any multiple of "
    "1/2^k of the budget); -1: LearnerConfig's default.",
)
_ENTROPY = flags.DEFINE_bool(
    "entropy_metric",
    True,
    "Ours: learner.entropy_metric (the policy entropy per token, a metric; one more pass over "
    "the vocabulary). Tunix's GRPO step computes no entropy: --noentropy_metric does equal work.",
)
_ACCUMULATION = flags.DEFINE_integer(
    "tunix_accumulation",
    1,
    "Tunix: micro-steps per update (TrainingConfig.gradient_accumulation_steps, optax.MultiSteps), "
    "each on GROUPS / this many groups; 1: the whole update in one step (GRPOLearner's default).",
)

GROUPS, GROUP_SIZE = 8, 8  # prompts per update, completions per prompt (Tunix num_generations)
PROMPT_TOKENS = (12, 20)  # prompt lengths, uniform; Tunix left-pads prompts to the maximum
MAX_RESPONSE = 64  # responses of 1..64 tokens; Tunix right-pads to this (max_tokens_to_generate)
PAD_ID = 0  # Tunix's pad id; tokens are drawn from 1..vocab-1
LR, CLIP_NORM, EPSILON = 1e-4, 1.0, 0.2
TUNIX_AGGREGATION = {"seq_mean_token_mean": "sequence-mean-token-mean", "token_mean": "token-mean"}


def model_config() -> ModelConfig:
    """The tiny preset with Tunix's fixed RoPE base (see the module docstring)."""
    return get_preset("tiny", rope_theta=1e6)


def random_groups(rng: np.random.Generator, vocab: int, uid: int) -> list[Group]:
    """GROUPS complete groups of GROUP_SIZE: random prompts, responses, log-probs, 0/1 rewards."""
    out = []
    for g in range(GROUPS):
        n_prompt = int(rng.integers(PROMPT_TOKENS[0], PROMPT_TOKENS[1] + 1))
        prompt = tuple(int(t) for t in rng.integers(1, vocab, n_prompt))
        comps = []
        for s in range(GROUP_SIZE):
            n = int(rng.integers(1, MAX_RESPONSE + 1))
            comps.append(
                Completion(
                    uid=uid + g,
                    round=0,
                    sample=s,
                    prompt=prompt,
                    tokens=tuple(int(t) for t in rng.integers(1, vocab, n)),
                    logprobs=tuple(float(x) for x in -np.log(vocab) + rng.normal(0, 0.1, n)),
                    versions=(0,) * n,
                    finish_reason="stop",
                    reward=float(rng.integers(0, 2)),
                )
            )
        request = Request(
            uid=uid + g, prompt=prompt, group_size=GROUP_SIZE, params=SamplingParams()
        )
        out.append(Group(request=request, completions=tuple(comps)))
    return out


def loss_tokens(groups: list[Group]) -> int:
    """Response tokens of the groups: the loss tokens of an update, the same on both sides."""
    return sum(len(c.tokens) for g in groups for c in g.completions)


def import_tunix() -> SimpleNamespace:
    """Tunix's modules this benchmark uses; a clear error if Tunix is not installed."""
    try:
        from tunix.models.qwen3 import model as qwen3_model  # optional: imported only here
        from tunix.models.qwen3 import params as qwen3_params
        from tunix.rl import algo_core, trainer
        from tunix.rl.grpo import grpo_learner
        from tunix.sft import metrics_logger, peft_trainer, sharding_utils
    except ImportError as e:
        raise SystemExit(
            f"launch.bench_tunix needs Google Tunix (received ImportError: {e}); expected it "
            "installed: pip install google-tunix (in a venv with this repo's jax and flax)."
        ) from e
    return SimpleNamespace(
        qwen3_model=qwen3_model,
        qwen3_params=qwen3_params,
        algo_core=algo_core,
        trainer=trainer,
        grpo_learner=grpo_learner,
        metrics_logger=metrics_logger,
        peft_trainer=peft_trainer,
        sharding_utils=sharding_utils,
    )


def tunix_model_config(tx: SimpleNamespace, cfg: ModelConfig) -> Any:
    """`tunix.models.qwen3.ModelConfig` of the same architecture as `cfg`."""
    return tx.qwen3_model.ModelConfig(
        num_layers=cfg.n_layers,
        vocab_size=cfg.vocab_size,
        embed_dim=cfg.d_model,
        hidden_dim=cfg.mlp_dim,
        num_heads=cfg.n_heads,
        head_dim=cfg.head_dim,
        num_kv_heads=cfg.n_kv_heads,
        rope_theta=int(cfg.rope_theta),
        norm_eps=cfg.rms_eps,
        use_tied_embedding=cfg.tie_embeddings,
    )


def tunix_example(tx: SimpleNamespace, groups: list[Group]) -> Any:
    """The groups as GRPOLearner hands them to its trainer (after rollout and rewards).

    Prompts left-padded to PROMPT_TOKENS[1], completions right-padded to MAX_RESPONSE with PAD_ID,
    masks `!= PAD_ID`, advantages by Tunix's "grpo" estimator, old log-probs the sampler's (0 at
    padding), no reference log-probs (beta 0).
    """
    comps = [c for g in groups for c in g.completions]
    b, p = len(comps), PROMPT_TOKENS[1]
    prompt = np.full((b, p), PAD_ID, np.int32)
    completion = np.full((b, MAX_RESPONSE), PAD_ID, np.int32)
    old_logp = np.zeros((b, MAX_RESPONSE), np.float32)
    for i, c in enumerate(comps):
        prompt[i, p - len(c.prompt) :] = c.prompt
        completion[i, : len(c.tokens)] = c.tokens
        old_logp[i, : len(c.tokens)] = c.logprobs
    rewards = np.asarray([c.reward for c in comps], np.float32)
    advantages = tx.algo_core.compute_advantages(rewards, GROUP_SIZE)
    return tx.grpo_learner.TrainExample(
        prompt_ids=jax.numpy.asarray(prompt),
        prompt_mask=jax.numpy.asarray(prompt != PAD_ID),
        completion_ids=jax.numpy.asarray(completion),
        completion_mask=jax.numpy.asarray(completion != PAD_ID),
        advantages=jax.numpy.asarray(advantages, np.float32),
        ref_per_token_logps=None,
        old_per_token_logps=jax.numpy.asarray(old_logp),
    )


def our_learner(model: Any, mesh: Any, aggregation: str, **overrides: Any) -> Learner:
    """Our Learner for the workload: PPO-clip, no KL, the sampler's log-probs, packed rows; any
    other LearnerConfig field in `overrides` (micro_batch_rows, flush_halvings; else defaults)."""
    return Learner(
        model,
        LearnerConfig(
            **overrides,
            optimizer=OptimizerConfig(lr=LR, grad_clip_norm=CLIP_NORM),
            loss=LossConfig(ppo_clip=PpoClipOptions(clip_low=EPSILON, clip_high=EPSILON)),
            policy_loss="ppo_clip",
            aggregation=aggregation,
            old_logprobs="sampler",
            max_length=PROMPT_TOKENS[1] + MAX_RESPONSE,
        ),
        mesh=mesh,
    )


def tunix_trainer(
    tx: SimpleNamespace,
    hf_dir: str,
    cfg: ModelConfig,
    mesh: Any,
    aggregation: str,
    accumulation: int = 1,
) -> Any:
    """A Tunix RL Trainer as RLCluster builds the actor's, with GRPOLearner's loss installed
    (`accumulation` > 1: that many micro-steps per optimizer step, as RLCluster sets it from
    train_micro_batch_size)."""
    model = tx.qwen3_params.create_model_from_safe_tensors(
        hf_dir, tunix_model_config(tx, cfg), mesh=mesh
    )
    algo = tx.grpo_learner.GRPOConfig(
        num_generations=GROUP_SIZE,
        num_iterations=1,
        beta=0.0,
        epsilon=EPSILON,
        loss_agg_mode=TUNIX_AGGREGATION[aggregation],
    )
    algo.temperature = 1.0  # GRPOLearner sets it from the rollout config
    trainer = tx.trainer.Trainer(
        model=model,
        optimizer=make_optimizer(OptimizerConfig(lr=LR, grad_clip_norm=CLIP_NORM)),
        training_config=tx.peft_trainer.TrainingConfig(
            eval_every_n_steps=1 << 30,
            metrics_prefix="actor",
            pbar_description=None,
            gradient_accumulation_steps=accumulation if accumulation > 1 else None,
        ),
        custom_checkpoint_metadata_fn=lambda: {"role": "actor"},
    )
    trainer.is_managed_externally = True  # as RLLearner sets it

    def loss_fn(model: Any, train_example: Any, algo_config: Any) -> Any:
        return tx.algo_core.grpo_loss_fn(
            model, train_example, algo_config=algo_config, pad_id=PAD_ID, eos_id=cfg.vocab_size - 1
        )

    trainer.with_loss_fn(loss_fn, has_aux=True)
    trainer.with_gen_model_input_fn(lambda x: {"train_example": x, "algo_config": algo})
    trainer.with_rl_metrics_to_log({"kl": np.mean, "pg_clipfrac": np.mean})
    return trainer


def run(
    *,
    updates: int = 16,
    warmup: int = 2,
    seed: int = 0,
    aggregation: str = "seq_mean_token_mean",
    tunix_step: bool = True,
    ours: dict[str, Any] | None = None,
    tunix_accumulation: int = 1,
) -> dict[str, Any]:
    """Builds every side, runs `warmup` + `updates` updates in rotating order, returns figures.

    Args:
      updates: timed updates per side.
      warmup: untimed updates per side before them (their compiles and time go to start_s).
      seed: of the model's initial weights and of the groups.
      aggregation: "seq_mean_token_mean" or "token_mean" (Tunix's loss_agg_mode of the same math).
      tunix_step: also time Tunix's jitted train step called without its Trainer loop (one
        step per update: not with tunix_accumulation > 1).
      ours: LearnerConfig fields of ours beyond the workload's (micro_batch_rows, flush_halvings;
        None: the defaults).
      tunix_accumulation: Tunix's micro-steps per update (gradient accumulation), each on
        GROUPS / tunix_accumulation whole groups.

    Returns:
      Per side: compiles, their seconds, start seconds, median ms, loss tokens and model positions
      per update, tokens/s, first loss and gradient norm; ours / each Tunix side's tokens/s and the
      spread of the per-update ratios; the loss trajectories' largest difference; the config.
    """
    if updates < 1 or warmup < 1:
        raise ValueError(
            f"updates={updates}, warmup={warmup}; expected both >= 1 (the warm-up holds Tunix's "
            "first-call compile, which must not be timed)."
        )
    if aggregation not in TUNIX_AGGREGATION:
        raise ValueError(
            f"aggregation={aggregation!r}; expected one of {sorted(TUNIX_AGGREGATION)} (those "
            "Tunix's loss_agg_mode also has)."
        )
    if tunix_accumulation < 1 or GROUPS % tunix_accumulation:
        raise ValueError(
            f"tunix_accumulation={tunix_accumulation}; expected a divisor of the {GROUPS} groups "
            "of an update."
        )
    if tunix_accumulation > 1 and aggregation != "seq_mean_token_mean":
        raise ValueError(
            f"tunix_accumulation={tunix_accumulation} with aggregation={aggregation!r}: Tunix "
            "averages its micro-steps' losses, which equals the whole update's only for "
            "seq_mean_token_mean (equal sequences per micro-step); expected that aggregation."
        )
    if tunix_accumulation > 1 and tunix_step:
        raise ValueError(
            "tunix_step times one jitted step per update; expected tunix_accumulation 1."
        )
    tx = import_tunix()
    cfg = model_config()
    model = create_model(cfg, seed=seed)
    mesh, _ = make_meshes(MeshConfig(learner_devices=1, learner_tp=1, colocated=True))
    clock = bench_util.CompileWatch()  # XLA compiles, booked to each side's label
    jax.monitoring.register_event_duration_secs_listener(clock)
    start_s: dict[str, float] = {}

    names = ["ours", "tunix"] + (["tunix_step"] if tunix_step else [])
    trainers, step_fn = {}, None
    with tempfile.TemporaryDirectory() as hf_dir, warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # Tunix enters meshes with `with mesh`
        save_hf(model, hf_dir)  # Tunix loads our initial weights
        for name in names[1:]:
            clock.label = name
            t = time.perf_counter()
            with mesh:
                trainers[name] = tunix_trainer(
                    tx, hf_dir, cfg, mesh, aggregation, tunix_accumulation
                )
                if name == "tunix_step":  # the function Trainer.train calls, cached the same way
                    step_fn = trainers[name].jit_train_and_eval_step(cache_nnx_graph=True)[0]
            start_s[name] = time.perf_counter() - t

    clock.label = "ours"
    t = time.perf_counter()
    learner = our_learner(model, mesh, aggregation, **(ours or {}))
    learner.precompile(updates_per_round=1)
    start_s["ours"] = time.perf_counter() - t
    first: dict[str, dict[str, float]] = {}
    our_losses: list[float] = []
    our_positions: list[int] = []  # model positions (the micro-batches' area) of each update

    def ours(groups: list[Group]) -> None:
        learner.begin_round(updates=1)
        learner.add_groups(groups)
        m = learner.update()
        if m["tokens"] != loss_tokens(groups):
            raise AssertionError(
                f"ours counted {m['tokens']} loss tokens; expected {loss_tokens(groups)} (the "
                "responses' tokens)."
            )
        first.setdefault("ours", {"loss": m["loss"], "grad_norm": m["grad_norm"]})
        our_losses.append(m["loss"])
        our_positions.append(int(m["positions"]))

    def tunix(groups: list[Group]) -> None:
        per = GROUPS // tunix_accumulation
        examples = [tunix_example(tx, groups[i : i + per]) for i in range(0, GROUPS, per)]
        with mesh:
            trainers["tunix"].train(examples)
        jax.block_until_ready(nnx.state(trainers["tunix"].model))

    def tunix_bare(groups: list[Group]) -> None:
        with mesh:
            example = tx.sharding_utils.shard_input(tunix_example(tx, groups), ("fsdp",))
            loss, _, grad_norm = step_fn(example)
        loss, grad_norm = jax.device_get((loss, grad_norm))
        first.setdefault("tunix_step", {"loss": float(loss), "grad_norm": float(grad_norm)})

    sides: dict[str, Callable[[list[Group]], None]] = {
        "ours": ours,
        "tunix": tunix,
        "tunix_step": tunix_bare,
    }
    rng = np.random.default_rng(seed)
    seconds: dict[str, list[float]] = {n: [] for n in names}
    tokens: list[int] = []
    positions = dict.fromkeys(names, 0)  # model positions (padded area) of the timed updates
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        for k in range(warmup + updates):
            groups = random_groups(rng, cfg.vocab_size, uid=k * GROUPS)
            shift = k % len(names)
            for name in names[shift:] + names[:shift]:
                clock.label = name if k < warmup else bench_util.TIMED
                t = time.perf_counter()
                sides[name](groups)
                dt = time.perf_counter() - t
                if k < warmup:
                    start_s[name] += dt
                else:
                    seconds[name].append(dt)
            if k >= warmup:
                tokens.append(loss_tokens(groups))
                sequences = sum(len(g.completions) for g in groups)
                for name in names:
                    positions[name] += (
                        our_positions[-1]
                        if name == "ours"
                        else sequences * (PROMPT_TOKENS[1] + MAX_RESPONSE)
                    )
    jax.monitoring.unregister_event_duration_listener(clock)
    trainers["tunix"].close()  # writes the last step's deferred metrics
    history = trainers["tunix"].metrics_logger.get_metric_history
    tunix_losses = history("actor", "loss", tx.metrics_logger.Mode.TRAIN)
    first["tunix"] = {
        "loss": float(tunix_losses[0]),
        "grad_norm": float(history("actor", "grad_norm", tx.metrics_logger.Mode.TRAIN)[0]),
    }
    total = sum(tokens)
    per_side = {
        n: {
            "compile_s": clock.seconds.get(n, 0.0),
            "compiles": clock.counts.get(n, 0),
            "start_s": start_s[n],
            "median_ms": 1e3 * statistics.median(s),
            "tokens_per_update": total / len(s),
            "positions_per_update": positions[n] / len(s),
            "tokens_per_s": total / sum(s),
            "first_loss": first.get(n, {}).get("loss"),
            "first_grad_norm": first.get(n, {}).get("grad_norm"),
        }
        for n, s in seconds.items()
    }
    pairs = {
        n: [b / a for a, b in zip(seconds["ours"], seconds[n], strict=True)] for n in names[1:]
    }
    return {
        "ratio": {n: per_side["ours"]["tokens_per_s"] / per_side[n]["tokens_per_s"] for n in pairs},
        "ratio_pairs": {
            n: {"min": min(p), "median": statistics.median(p), "max": max(p)}
            for n, p in pairs.items()
        },
        "sides": per_side,
        "compiles_timed": clock.compiles_timed,
        "compiled_while_timed": clock.timed_names(),
        # same initial weights, data and optimizer: the two trajectories should stay together
        "loss_max_abs_diff": float(np.max(np.abs(np.asarray(our_losses) - tunix_losses))),
        "loss_tokens": total,
        "seconds": seconds,
        "config": dict(
            updates=updates,
            warmup=warmup,
            seed=seed,
            groups=GROUPS,
            group_size=GROUP_SIZE,
            prompt_tokens=list(PROMPT_TOKENS),
            max_response=MAX_RESPONSE,
            aggregation=aggregation,
            tunix_aggregation=TUNIX_AGGREGATION[aggregation],
            model=dataclasses.asdict(cfg),
            lr=LR,
            grad_clip_norm=CLIP_NORM,
            epsilon=EPSILON,
            ours_row_lengths=list(learner.micro_batches.lengths),
            ours_micro_batch_rows=learner.cfg.micro_batch_rows,
            ours_flush_halvings=learner.cfg.flush_halvings,
            tunix_accumulation=tunix_accumulation,
            backend=jax.default_backend(),
        ),
    }


def print_table(r: dict[str, Any]) -> None:
    """The per-side table and the ours / Tunix ratios."""
    c = r["config"]
    print(
        f"workload: {c['updates']} timed updates (+{c['warmup']} warm-up) x {c['groups']} prompts "
        f"x G={c['group_size']}, prompts {c['prompt_tokens'][0]}-{c['prompt_tokens'][1]} tokens, "
        f"responses 1-{c['max_response']}; tiny qwen3 (rope 1e6), ppo-clip {c['epsilon']}, "
        f"{c['aggregation']} / {c['tunix_aggregation']}, AdamW {c['lr']:g}, {c['backend']}; "
        f"ours {c['ours_micro_batch_rows']} rows of up to {c['ours_row_lengths'][-1]} per "
        f"micro-batch (flush_halvings {c['ours_flush_halvings']}), Tunix {c['tunix_accumulation']} micro-step(s) per update"
    )
    print(
        f"{'side':<11}{'compiles':>9}{'compile s':>10}{'start s':>8}{'median ms':>10}"
        f"{'tokens/upd':>11}{'positions/upd':>14}{'tokens/s':>9}{'first loss':>11}{'grad norm':>10}"
    )
    for n, s in r["sides"].items():
        print(
            f"{n:<11}{s['compiles']:>9}{s['compile_s']:>10.1f}{s['start_s']:>8.1f}"
            f"{s['median_ms']:>10.1f}{s['tokens_per_update']:>11.0f}"
            f"{s['positions_per_update']:>14.0f}{s['tokens_per_s']:>9.0f}"
            f"{s['first_loss']:>11.6f}{s['first_grad_norm']:>10.5f}"
        )
    for n, ratio in r["ratio"].items():
        p = r["ratio_pairs"][n]
        print(
            f"ours / {n} per trained token: {ratio:.2f}x (per-update pairs: min {p['min']:.2f} / "
            f"median {p['median']:.2f} / max {p['max']:.2f})"
        )
    print(
        f"compiles during the timed updates: {r['compiles_timed']}; loss, ours vs tunix, over all "
        f"{c['warmup'] + c['updates']} updates: max |difference| {r['loss_max_abs_diff']:.2e}"
    )


def main(argv: list[str]) -> None:
    del argv
    ours = {}
    if _ROWS.value:
        ours["micro_batch_rows"] = _ROWS.value
    if _FLUSH.value >= 0:
        ours["flush_halvings"] = _FLUSH.value
    if not _ENTROPY.value:
        ours["entropy_metric"] = False
    r = run(
        updates=_UPDATES.value,
        warmup=_WARMUP.value,
        seed=_SEED.value,
        aggregation=_AGGREGATION.value,
        tunix_step=_TUNIX_STEP.value and _ACCUMULATION.value == 1,
        ours=ours,
        tunix_accumulation=_ACCUMULATION.value,
    )
    print_table(r)
    if _JSON.value:
        with open(_JSON.value, "w") as f:
            json.dump(r, f, indent=2)
        print(f"wrote {_JSON.value}")
    bench_util.fail_if_compiled(
        "launch.bench_tunix", r["compiles_timed"], r["compiled_while_timed"]
    )


if __name__ == "__main__":
    app.run(main)
