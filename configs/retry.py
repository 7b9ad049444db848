"""The default run's task with a checker tool: a wrong answer is told "no:" and asked again.

Launch:  python -m launch.train --config=configs/retry.py
         python -m launch.train --config=configs/retry.py:single   (the same run, one turn)
The model, its SFT warm start (single-turn answers) and the GRPO schedule are the default run's
(configs/default.py); RL rounds are multi-turn episodes in the "retry" environment (rl/envs/retry.py):
up to 3 answers, each checked, the question restated after a wrong one, reward 1 when one is
right. Held-out accuracy is the episode's (an answer right within 3 turns, greedy); `:single` is
the single-turn baseline of the same budget (README, Multi-turn environments).
"""

import ml_collections

from configs import default


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    smoke = arg is not None and arg.endswith("smoke")
    config = default.get_config("smoke" if smoke else None)
    config.workdir = "runs/retry" + ("_smoke" if smoke else "")
    single = arg is not None and arg.startswith("single")
    if arg not in (None, "smoke", "single", "single_smoke"):
        raise ValueError(f"Unknown config argument {arg!r}; expected smoke, single or nothing.")
    # SFT rows of 3 problems one after another: the model learns to answer after earlier problems
    # and answers in its context (a retry's second and third turns), at the positions they take.
    config.sft.examples_per_row = 3
    if single:
        return config
    # 3 turns of <= 5 tokens and 2 observations of "no:" + the 9-token question
    config.sampling.max_new_tokens = 40
    config.engine.max_length = 64
    config.env.name = "retry"
    config.env.max_turns = 3
    config.env.feedback = "no:"
    return config
