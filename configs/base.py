"""Base config: every field the launchers read, with its default.

Launch:  python -m launch.train --config=configs/base.py
         python -m launch.train --config=configs/base.py:smoke   (shrunk to run on CPU in seconds)
Expect:  the model summary (parameter count, layout) and one forward pass over a prompt.

A real model is a local Hugging Face directory: --config.model.hf_path=/models/Qwen2.5-1.5B-Instruct
(weights, shapes and, with config.tokenizer "", the tokenizer); configs/gsm8k_qwen.py is a recipe.
"""

import ml_collections

from rl.models.sharding import DEFAULT_RULES


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()
    config.seed = 0  # one seed for parameter init and all sampling streams
    config.workdir = "runs/base"  # logs, checkpoints, summaries

    config.model = ml_collections.ConfigDict()
    config.model.preset = "qwen3-0.6b"  # rl.models.PRESETS name; shapes only
    # Local Hugging Face directory (config.json, *.safetensors, tokenizer.json): its weights replace
    # the preset, and with config.tokenizer "" its tokenizer is used. Nothing is downloaded.
    config.model.hf_path = ""
    config.model.param_dtype = "bfloat16"  # parameter storage dtype: float32 | bfloat16
    config.model.dtype = "bfloat16"  # activation compute dtype: float32 | bfloat16
    config.model.remat = "full"  # per-layer rematerialisation: none | full | dots
    config.model.logits_chunk = 512  # sequence chunk for log-prob computation
    # Shape overrides on top of the preset (0: the preset's value); ignored with hf_path.
    config.model.d_model = 0
    config.model.n_layers = 0
    config.model.n_heads = 0
    config.model.n_kv_heads = 0
    config.model.head_dim = 0
    config.model.mlp_dim = 0
    # Output head shared with the token embedding: preset | tied | untied; ignored with hf_path.
    config.model.tie_embeddings = "preset"
    config.model.init_std = 0.0  # normal std of a fresh init's weights; 0: the preset's (0.02)
    # LoRA (rl/models/lora.py): rank > 0 trains, checkpoints and publishes only low-rank adapters
    # on the `targets` projections (comma-separated among q,k,v,o,gate,up,down); scale alpha/rank
    config.model.lora = ml_collections.ConfigDict()
    config.model.lora.rank = 0
    config.model.lora.alpha = 16.0
    config.model.lora.targets = "q,k,v,o,gate,up,down"

    config.mesh = ml_collections.ConfigDict()
    config.mesh.learner_devices = 0  # 0: half of the devices (all when colocated)
    config.mesh.learner_tp = 1  # learner tensor parallelism; fsdp = learner_devices / learner_tp
    # devices of each sampler replica; 0: the other half (all when colocated) split over the
    # replicas (runtime=ray: each replica actor's first N devices, 0: all it sees)
    config.mesh.sampler_devices = 0
    config.mesh.sampler_tp = 1  # sampler tensor parallelism; data = sampler_devices / sampler_tp
    # sampler replicas, an Engine + SamplerLoop each on its own devices: threads in this process
    # (runtime=threads) or Ray actors (runtime=ray)
    config.mesh.sampler_replicas = 1
    config.mesh.sampler_routing = "round_robin"  # request -> replica: round_robin | least_loaded
    config.mesh.colocated = False  # learner and sampler share devices (one GPU, Colab, CPU)
    # fixed: the device counts above; plan: open, rl/device_split.py picks learner_devices and
    # sampler_devices (leave both 0) from config.elastic.stage_model (README "Elastic devices")
    config.mesh.split = "fixed"

    # Elastic devices (rl/elastic; README "Elastic devices"). BiDiRL borrowing: the idle pool lends
    # its devices to the bottleneck when the stage-time models predict a gain above the switch cost.
    config.elastic = ml_collections.ConfigDict()
    # learner: the learner trains on sampler devices too once the rollout has drained;
    # sampler: extra engine replicas (mesh.sampler_devices each) on the learner's devices while the
    # learner waits for a round's groups (both runtimes; under Ray the learner worker hosts
    # them); both: either, as predicted (both runtimes)
    config.elastic.borrowing = "off"  # off | learner | sampler | both
    config.elastic.switch_cost_s = 1.0  # prior cost of one switch (there and back); then measured
    config.elastic.margin = 1.0  # borrow only when predicted gain > margin x switch cost
    # stage-time models to predict with: a launch.profile JSON, or "preset:<model>:<gpu>" (e.g.
    # "preset:qwen3-1.7b:h100"); needed by borrowing and mesh.split="plan"
    config.elastic.stage_model = ""
    config.elastic.median_tokens = 0.0  # planner workload: median response length; 0: cap / 4
    # Long-tail migration (JigsawRL, rl/elastic/migration.py): at decode-step boundaries the
    # last running requests move, KV cache included, onto fewer sampler replicas (mesh.
    # sampler_replicas > 1; under Ray through the object store, ray.migration_poll_s; tokens
    # unchanged)
    config.elastic.migration = "off"  # off | tail | always (every step: the exactness test's mode)
    config.elastic.max_running_fraction = 0.25  # tail: migrate once running <= this * all slots
    config.elastic.min_tokens_left = 0  # tail: requests with fewer tokens to go stay put
    # tail, paged KV: a destination keeps pages for this many more positions per sequence
    config.elastic.grow_tokens = 512

    config.learner = ml_collections.ConfigDict()
    config.learner.policy_loss = "ppo_clip"  # ppo_clip | gspo | tis_reinforce | decoupled_ppo
    config.learner.aggregation = "token_mean"  # token_mean | seq_mean_token_mean | seq_mean_token_sum | seq_mean_token_sum_norm
    config.learner.norm_constant = (
        0.0  # seq_mean_token_sum_norm: Dr. GRPO constant (max response length)
    )
    config.learner.advantage = "grpo"  # grpo | drgrpo | rloo
    config.learner.overlong_filter = False  # DAPO: truncated responses get no loss (rl/overlong.py)
    config.learner.old_logprobs = "snapshot"  # later updates of a round: snapshot | sampler
    # rows of the longest row length per micro-batch, a token budget: shorter rows come in more
    # rows of the same tokens (learner/micro_batches.py); divisible by fsdp
    config.learner.micro_batch_rows = 16
    # an update's last micro-batch may take 1/2 .. 1/2^k of that budget: k more compiled shapes
    config.learner.flush_halvings = 1
    # row lengths: powers of two from here up to engine.max_length's bucket, each compiled at start
    config.learner.min_length_bucket = 32
    config.learner.packing = True  # several sequences per row, first-fit by length
    config.learner.entropy_metric = True  # per-token policy entropy as a metric
    config.learner.optimizer = ml_collections.ConfigDict()
    config.learner.optimizer.lr = 1e-6  # peak learning rate
    config.learner.optimizer.schedule = "constant"  # constant | cosine
    config.learner.optimizer.warmup_steps = 0  # linear warmup (updates)
    config.learner.optimizer.total_steps = 0  # cosine horizon (updates); 0: the whole run
    config.learner.optimizer.weight_decay = 0.0  # AdamW decoupled weight decay
    config.learner.optimizer.grad_clip_norm = 1.0  # global-norm clipping; 0: off
    config.learner.optimizer.end_lr_ratio = 0.0  # cosine: final lr / peak lr
    config.learner.optimizer.b1 = 0.9  # Adam first-moment decay
    config.learner.optimizer.b2 = 0.999  # Adam second-moment decay
    config.learner.optimizer.eps = 1e-8  # Adam denominator epsilon
    config.learner.loss = ml_collections.ConfigDict()
    config.learner.loss.kl_coef = 0.0  # KL-to-reference coefficient; 0: no reference model
    config.learner.loss.kl_estimator = "k3"  # k1 | k2 | k3
    # Each policy loss's own options (rl/losses.py), read only when it is learner.policy_loss.
    config.learner.loss.ppo_clip = ml_collections.ConfigDict()
    config.learner.loss.ppo_clip.clip_low = 0.2  # ratio clip below 1
    config.learner.loss.ppo_clip.clip_high = 0.28  # ratio clip above 1 (DAPO clip-higher)
    config.learner.loss.gspo = ml_collections.ConfigDict()
    config.learner.loss.gspo.clip_low = 3e-4  # sequence-ratio clip below 1 (GSPO paper)
    config.learner.loss.gspo.clip_high = 4e-4  # sequence-ratio clip above 1
    config.learner.loss.tis_reinforce = ml_collections.ConfigDict()
    config.learner.loss.tis_reinforce.clip = 5.0  # importance weight cap c (PipelineRL)
    config.learner.loss.decoupled_ppo = ml_collections.ConfigDict()
    config.learner.loss.decoupled_ppo.clip_low = 0.2  # proximal ratio clip below 1
    config.learner.loss.decoupled_ppo.clip_high = 0.28  # proximal ratio clip above 1
    config.learner.loss.decoupled_ppo.behav_clip = 5.0  # behaviour importance weight cap

    # DAPO soft overlong punishment (rl/overlong.py): a reward term falling linearly from 0 at
    # max_new_tokens - cache_tokens response tokens to -factor at max_new_tokens (and truncation)
    config.overlong = ml_collections.ConfigDict()
    config.overlong.cache_tokens = 0  # L_cache; 0: off
    config.overlong.factor = 1.0  # the penalty at max_new_tokens

    # The learner as one jax.distributed job of several processes (one per host), its mesh over
    # all their devices (learner/distributed.py; README "A learner over several hosts"). Every
    # process runs the same command; only process_id differs.
    config.learner.distributed = ml_collections.ConfigDict()
    # process 0's "host:port"; "": $JAX_COORDINATOR_ADDRESS (needed with num_processes > 1)
    config.learner.distributed.coordinator_address = ""
    config.learner.distributed.num_processes = 0  # 0: $JAX_NUM_PROCESSES, else 1 (one process)
    config.learner.distributed.process_id = -1  # this process's rank; -1: $JAX_PROCESS_ID, else 0
    config.learner.distributed.initialization_timeout_s = 300  # wait for every process to join

    config.tokenizer = ""  # "byte" or a local tokenizer directory; default: model.hf_path

    # logical axis -> mesh axes; one table serves the learner (fsdp, tp) and sampler (data, tp) meshes
    config.sharding_rules = [list(rule) for rule in DEFAULT_RULES]

    config.rounds = 100  # RL rounds to run (in total, counting rounds before a resume)
    config.checkpoint_every = 10  # rounds between checkpoints in workdir/ckpt; 0: never
    # timeline.png draws the last N rounds, where the bubble is visible (0: the whole run);
    # timeline.json (Perfetto) always holds the whole run.
    config.timeline_rounds = 3
    config.resume = True  # continue from the newest intact checkpoint in workdir/ckpt, if any
    config.resume_strict = False  # a damaged newest checkpoint stops the run (no fall-back)
    # driver.mode=async at a checkpoint: "exact" drains the pipeline first (a resume continues the
    # exact trajectory; a bubble every checkpoint_every rounds); "no_bubble" keeps sampling and
    # records the prompts in flight, which a resume samples again first (each trained once).
    config.async_resume = "exact"
    # A fresh run into a workdir holding a previous run's results (summary.json, metrics.jsonl,
    # tb/, ckpt/, pictures) replaces them only with overwrite; otherwise it stops before any work.
    config.overwrite = False
    config.task = ml_collections.ConfigDict()
    # A name in rl.tasks.registry.TASKS: addition | countdown (generated) | gsm8k | math (local
    # data files, config.data), or one registered with rl.tasks.register_task; its options are
    # config.task.<option> (the built-in ones below; an option left out takes the task's
    # registered default).
    config.task.name = "addition"
    config.task.digits = 3  # addition: operands of up to this many digits
    config.task.pad_operands = False  # addition: zero-padded "007+095=" -> "0102"
    config.task.reverse_answer = False  # addition: the sum least-significant digit first ("2010")
    config.task.reverse_operands = False  # addition: operands units digit first ("700+590=")
    config.task.count = 4  # countdown: numbers per problem
    config.task.max_number = 100  # countdown: numbers uniform in [1, max_number]
    config.task.max_target = 0  # countdown: bound on the target and intermediate values; 0: none
    config.task.style = "words"  # countdown question: words (TinyZero's) | compact ("3 5 2 -> 16:")
    config.task.train_size = 20000  # synthetic training problems (never in the held-out split)
    config.task.reward = "exact"  # a name in rl.rewards.REWARDS: exact | math | gsm8k | countdown
    config.task.reward_timeout_s = 5.0  # a reward call past this scores 0 and is counted
    # Reward calls run at once, off the decode thread (rl.rewards.RewardRunner).
    config.task.reward_workers = 4
    # thread (any function) | process (a registered, picklable one; a hung call is
    # killed: for CPU-bound verifiers such as sympy)
    config.task.reward_backend = "thread"

    # Multi-turn episodes (rl/envs): each sample answers, the environment replies with
    # observation tokens appended to its KV cache (zero loss weight), and it answers again; its
    # reward is the sum of its turns' rewards (config.task.reward is then the environment's to use).
    config.env = ml_collections.ConfigDict()
    config.env.name = ""  # a name in rl.envs.ENVIRONMENTS (retry), or "": single-turn
    config.env.max_turns = 3  # the model's turns per episode at most
    config.env.timeout_s = 5.0  # an environment step past this ends its episode (turn reward 0)
    config.env.workers = 4  # environment steps run at once, off the decode thread
    config.env.feedback = "no:"  # retry: the checker's answer to a wrong turn
    config.env.restate = True  # retry: the question again after the feedback

    # Local data for the file tasks, and the prompt format of every task (rl/tasks/data.py).
    config.data = ml_collections.ConfigDict()
    # gsm8k | math: the training data (required for them), read offline by its path: a .parquet
    # or .arrow file, a directory of datasets' save_to_disk (pip install -e ".[datasets]"), else
    # a JSONL file (rl/tasks/hf_datasets.py).
    config.data.train_path = ""
    config.data.heldout_path = ""  # held-out data, as train_path; "": a seeded slice of train_path
    config.data.split = "train"  # train_path a DatasetDict directory: the split read
    config.data.heldout_split = "test"  # heldout_path a DatasetDict directory: the split read
    # The key (JSONL) or column holding the question / the answer text; "": the task's own
    # (gsm8k: "question" / "answer", math: "problem" / "solution").
    config.data.question_field = ""
    config.data.answer_field = ""
    config.data.on_error = "skip"  # malformed rows: skip (counted, file:line logged) | raise
    # Drop rows whose answer is not one number (the "gsm8k" reward reads numbers only; "math"
    # checks other answers symbolically).
    config.data.numeric_answers_only = False
    config.data.template = "plain"  # prompt template: plain | chat (the tokenizer's chat template)
    config.data.system = ""  # chat template's system message; "": no system turn
    config.data.instruction = ""  # text put before each question

    config.sft = ml_collections.ConfigDict()
    config.sft.max_steps = 0  # supervised warm-start steps before RL; 0: none
    config.sft.batch_size = 64  # records per SFT step
    # records one after another in an SFT row, attending across (> 1: the model learns to answer
    # after earlier problems in its context, as multi-turn episodes need; rl/envs)
    config.sft.examples_per_row = 1
    config.sft.lr = 1e-3  # SFT learning rate (Adam)
    config.sft.warmup_steps = 0  # linear SFT lr warmup (steps)
    config.sft.eval_every = 100  # SFT steps between held-out evaluations
    config.sft.target_accuracy = 0.25  # stop SFT once held-out greedy accuracy reaches this

    config.eval = ml_collections.ConfigDict()
    # Held-out problems, never in the training split; file tasks: the first N rows of
    # data.heldout_path (0: all) or N seeded rows of data.train_path, removed from training.
    config.eval.heldout_size = 200
    config.eval.every_rounds = 10  # RL rounds between held-out evaluations; 0: start and end only
    # pass@k beside greedy accuracy: k, and n >= k samples per problem at sampling.temperature
    # (the unbiased estimator of the Codex paper, rl/passk.py); pass_k <= 1: greedy only
    config.eval.pass_k = 0
    config.eval.pass_n = 0  # samples per problem for pass@k; 0: pass_k

    # The final policy as a Hugging Face directory, workdir/hf (config.json, safetensors, and the
    # tokenizer's files when a Hugging Face tokenizer was loaded); transformers loads it.
    config.export = ml_collections.ConfigDict()
    config.export.hf = False
    config.export.dtype = ""  # tensor dtype on disk: float32 | bfloat16; "": as trained

    # Experiment tracking besides metrics.jsonl and TensorBoard (rl/tracking.py): Weights & Biases
    # gets every metrics row ("train/...", "sft/..."), the config, summary.json and the pictures;
    # a resumed run continues the same W&B run (workdir/wandb_run_id).
    config.log = ml_collections.ConfigDict()
    config.log.wandb = False  # log to W&B; needs the extra: pip install -e ".[wandb]"
    config.log.wandb_project = "rolloutpipe"  # W&B project
    config.log.wandb_entity = ""  # W&B team or user; "": the logged-in user's default entity
    # online | offline (no network; `wandb sync <workdir>/wandb/offline-run-*` uploads it later) |
    # disabled; "": $WANDB_MODE, else online
    config.log.wandb_mode = ""
    config.log.wandb_name = ""  # W&B run name; "": the workdir's basename

    config.driver = ml_collections.ConfigDict()
    config.driver.mode = "cgp"  # sync (rollout, then train) | cgp (pipelined) | async
    config.driver.max_staleness = 0  # async: sampler runs <= this many versions ahead; 0: on-policy
    config.driver.admission = "frontier"  # fcfs | frontier
    config.driver.batching = "ordered"  # fifo | ordered
    config.driver.groups_per_round = 64  # R prompts per round
    config.driver.groups_per_update = 8  # U groups per optimizer update (S = R / U)
    config.driver.group_size = 8  # G samples per prompt
    config.driver.queue_size = 0  # complete groups buffered before the sampler blocks; 0: unbounded
    config.driver.group_atomic = True  # False: per-sample admission of the G samples (slime/SGLang)
    config.driver.recompute_kv = False  # async: re-prefill running samples on new weights (AReaL)
    config.driver.poll_s = 0.2  # how often a waiting learner checks the sampler for an error
    # DAPO dynamic sampling (sync, cgp): discard groups whose rewards are all equal and draw fresh
    # prompts in their place until the round has R informative groups
    config.driver.dynamic_sampling = False
    config.driver.max_oversample = 3.0  # dynamic sampling: prompts drawn per round <= this * R
    config.driver.tail = (
        ml_collections.ConfigDict()
    )  # tail batching (RollPacker), rl/round_planner.py
    config.driver.tail.enabled = (
        False  # short rounds over-provision; long prompts wait for long rounds
    )
    config.driver.tail.eta = (
        1.25  # short rounds launch ceil(eta * R) prompts, train the first R done
    )
    config.driver.tail.long_max_new_tokens = 0  # long rounds' response cap; 0: sampling's
    config.driver.tail.epoch_end = "flush"  # flush (train the long queue) | carry (keep it)
    config.driver.tail.response_eta = 1.0  # > 1: ceil(eta_r * G) samples, keep the first G (biased)

    config.sampling = ml_collections.ConfigDict()
    # The one temperature: the sampler draws with it and the loss recomputes log-probs with it
    # (0: greedy sampling, log-probs at 1.0).
    config.sampling.temperature = 1.0
    config.sampling.top_k = 0  # 0: off
    config.sampling.top_p = 1.0  # 1.0: off
    config.sampling.max_new_tokens = 512  # response length cap

    config.engine = ml_collections.ConfigDict()
    config.engine.max_slots = 64  # concurrent sequences per sampler replica
    config.engine.max_length = 1024  # KV positions per slot: prompt + response
    config.engine.max_prefill_length = 512  # longest prompt
    config.engine.steps_per_call = 8  # decode steps fused per generate call
    config.engine.min_prefill_bucket = 16  # prompts pad to powers of two from here
    config.engine.max_stop_tokens = 4  # stop token ids per request
    config.engine.cache_dtype = ""  # KV cache dtype; "": the model's compute dtype
    # Per-device bytes for params + KV cache, checked when the engine is built; 0: the
    # device's own limit.
    config.engine.memory_budget_bytes = 0
    # A paged KV cache (sampler/paged.py): pages of page_size positions, kv_pages of them per
    # replica (0: what max_slots x max_length would fill); a slot holds the pages of what it has
    # written, a group's prompt pages are shared. page_size 0: a dense max_length row per slot.
    config.engine.page_size = 16
    config.engine.kv_pages = 0
    # Decode attention reads only the live blocks of this many positions (paged: rounded up to
    # whole pages), gathered once per generate call; 0: the whole cache every step.
    config.engine.attention_block = 64
    config.engine.attention_kernel = "xla"  # decode attention: xla | pallas | pallas_tpu (paged)
    config.sampler_dtype = (
        "bfloat16"  # dtype of the weights published to the sampler; "": as trained
    )

    # Where the run's components run: threads (one process) | ray (a learner worker and sampler
    # replica actors; one host or a cluster; rl/runtime/ray_runtime.py)
    config.runtime = "threads"
    config.ray = ml_collections.ConfigDict()
    config.ray.address = ""  # "": start a local Ray cluster; "auto" or host:port joins one
    config.ray.num_cpus = 0  # CPUs of a local cluster; 0: every core
    # learner actors (one per host) forming one jax.distributed job, its mesh over all their
    # devices; the runtime assigns their learner.distributed fields (coordinator, rank)
    config.ray.learner_workers = 1
    config.ray.on_replica_failure = "resample"  # a dead replica: resample (on the others) | stop
    config.ray.learner_gpus = 0  # GPUs of the learner worker (its devices: mesh.learner_devices)
    config.ray.replica_gpus = 0  # GPUs of each sampler replica (mesh.sampler_devices of them)
    config.ray.learner_cpus = 0  # CPUs Ray reserves for the learner worker
    config.ray.replica_cpus = 0  # CPUs Ray reserves for each replica
    # seconds between the long-tail migration policy's looks at the replicas (elastic.migration)
    config.ray.migration_poll_s = 0.01
    config.ray.log_to_driver = False  # True: workers' output and Ray's logs in this terminal
    # How publishes reach the replicas: transfer (each replica pulls from the learner worker's
    # devices, jax.experimental.transfer) | object_store (host arrays, put once, got by each) |
    # auto (transfer where the learner worker's transfer server starts)
    config.ray.weights = "auto"

    config.prompt = "The answer to 12 + 30 is"  # text for the model check (rl.models.summary)

    if arg == "smoke":
        shrink_for_smoke(config)
    elif arg:
        raise ValueError(f"Unknown config argument {arg!r}; expected 'smoke' or nothing.")
    return config


def shrink_for_smoke(config: ml_collections.ConfigDict) -> None:
    """Shrinks any config in place to a tiny float32 model with the byte tokenizer (CPU, seconds)."""
    config.workdir = "runs/smoke"
    config.model.preset = "tiny"
    config.model.hf_path = ""
    config.model.param_dtype = "float32"
    config.model.dtype = "float32"
    config.model.remat = "none"
    config.tokenizer = "byte"
    config.mesh.colocated = True
    config.mesh.learner_devices = 1  # smoke runs use one device even where more exist
    config.mesh.sampler_devices = 1
    config.mesh.sampler_replicas = 1
    config.learner.micro_batch_rows = 8
    config.learner.optimizer.lr = 1e-3
    config.rounds = 2
    config.driver.groups_per_round = 4
    config.driver.groups_per_update = 2
    config.driver.group_size = 4
    config.sampling.max_new_tokens = 8
    config.engine.max_slots = 8
    config.engine.max_length = 32
    config.engine.max_prefill_length = 16
    config.engine.steps_per_call = 4
    config.sampler_dtype = ""
    config.task.train_size = 1000
    config.sft.max_steps = 20
    config.sft.batch_size = 16
    config.sft.eval_every = 10
    config.eval.heldout_size = 8
    config.eval.every_rounds = 1
    config.checkpoint_every = 0  # smoke runs are throwaway: no checkpoints, no resume
    config.resume = False
