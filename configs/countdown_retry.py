"""Countdown with the checker tool: a wrong expression is told "no:" and the question is restated.

Launch:  python -m launch.train --config=configs/countdown_retry.py
         python -m launch.train --config=configs/countdown_retry.py:smoke   (seconds, for tests)
Its single-turn baseline is the same warm start without the environment:
         python -m launch.train --config=configs/countdown_retry.py --config.env.name=''
Countdown (configs/countdown.py) with SFT rows of 3 problems one after another (a retry's later
turns follow an earlier problem and answer in the context, which rows of one problem never teach),
then GRPO on episodes of up to 3 answers in the "retry" environment (rl/envs/retry.py), reward 1
when one of them reaches the target. Held-out accuracy is the episode's (greedy, within 3 turns).
"""

import ml_collections

from configs import countdown


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    config = countdown.get_config(arg)
    config.workdir = "runs/countdown_retry" + ("_smoke" if arg else "")
    config.sft.examples_per_row = 3
    config.env.name = "retry"
    config.env.max_turns = 3
    config.env.feedback = "no:"
    # 3 turns of <= 11 tokens and 2 observations of "no:" + the <= 12-token question
    config.sampling.max_new_tokens = 64
    config.engine.max_length = 96
    # plain rounds, as its README table (tool vs single-turn) was measured; Countdown's own recipe
    # refills rounds with informative groups (dynamic sampling)
    config.driver.dynamic_sampling = False
    return config
