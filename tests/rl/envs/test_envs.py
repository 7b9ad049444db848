"""Environments: transcripts split into turns and observations, a Turn checked before it is used,
a failing or hanging step ends its episode (counted), the retry checker, and config wiring."""

import pathlib
import re
import time

import pytest

from configs import retry as retry_config
from rl.config_check import ConfigError, check_config
from rl.envs import ENDED, ENVIRONMENTS, EnvRunner, Transcript, Turn, check_turn, get_environment
from rl.models.tokenizer import ByteTokenizer
from rl.rewards import get_reward
from rl.runtime.compose import Setup, build_environment
from rl.types import Request


def test_a_transcript_splits_the_response_into_turns_and_observations():
    t = Transcript.of([1, 2, 9, 9, 3, 9, 4], [False, False, True, True, False, True, False])
    assert t.turns == ((1, 2), (3,), (4,)) and t.observations == ((9, 9), (9,))
    assert Transcript.of([5, 6], [False, False]) == Transcript(turns=((5, 6),), observations=())


def test_a_turn_is_checked_before_it_is_used():
    assert check_turn(Turn(observation=(1, 2), reward=1, done=False), 10) == Turn(
        observation=(1, 2), reward=1.0, done=False
    )
    assert check_turn(((3,), 0.5, False), 10) == Turn(observation=(3,), reward=0.5, done=False)
    assert check_turn(Turn(done=True), 10) == Turn()
    for bad in (
        Turn(observation=(10,), done=False),  # outside the vocabulary
        Turn(observation=(-1,), done=False),
        Turn(reward=float("nan")),
        Turn(observation=(), done=False),  # goes on with nothing to read
        Turn(observation=("a",), done=False),
        "turn",
        None,
    ):
        assert check_turn(bad, 10) is None, bad


class Slow:
    def step(self, request, transcript):
        if request.uid == 1:
            time.sleep(30)
        if request.uid == 2:
            raise ValueError("the tool failed")
        return Turn(observation=(4,), reward=0.25, done=False)


def test_a_failing_or_hanging_step_ends_the_episode_and_is_counted():
    req = lambda uid: Request(uid=uid, prompt=(1,))
    t = Transcript(turns=((1,),), observations=())
    with EnvRunner(Slow(), vocab_size=8, max_turns=2, timeout_s=0.2, workers=2) as runner:
        futures = [runner.submit(req(u), t) for u in (0, 1, 2)]
        assert [f.result(timeout=10) for f in futures] == [
            Turn(observation=(4,), reward=0.25, done=False),
            ENDED,
            ENDED,
        ]
        stats = runner.stats()
    assert (stats["calls"], stats["timeouts"], stats["errors"]) == (3, 1, 1)
    with pytest.raises(ValueError, match="max_turns must be an int >= 1"):
        EnvRunner(Slow(), vocab_size=8, max_turns=0)


def test_retry_checks_each_answer_and_restates_the_question():
    tok = ByteTokenizer()
    env = get_environment("retry")(tokenizer=tok, reward=get_reward("exact"), feedback="no:")
    q = tuple(tok.encode("12+3="))
    request = Request(uid=0, prompt=q, meta={"answer": "15"})
    right = Transcript(turns=(tuple(tok.encode("15")) + (tok.eos_id,),), observations=())
    assert env.step(request, right) == Turn(reward=1.0, done=True)
    wrong = Transcript(turns=(tuple(tok.encode("51")) + (tok.eos_id,),), observations=())
    assert env.step(request, wrong) == Turn(
        observation=tuple(tok.encode("no:")) + q, reward=0.0, done=False
    )
    with pytest.raises(ValueError, match="feedback is empty and restate is False"):
        get_environment("retry")(
            tokenizer=tok, reward=get_reward("exact"), feedback="", restate=False
        )


def test_the_config_builds_the_environment_with_its_options():
    config = retry_config.get_config("smoke")
    config.env.feedback = "wrong "
    runner = build_environment(config, Setup.from_config(config))
    try:
        assert runner.max_turns == 3
        assert runner.env.feedback == tuple(ByteTokenizer().encode("wrong "))
    finally:
        runner.close()
    config.env.name = ""
    assert build_environment(config, Setup.from_config(config)) is None


def test_bad_environment_fields_are_named():
    config = retry_config.get_config("smoke")
    config.env.name = "calculator"
    config.env.max_turns = 0
    config.overlong.cache_tokens = 4
    with pytest.raises(ConfigError) as e:
        check_config(config)
    text = str(e.value)
    assert "config.env.name: Unknown environment 'calculator'; expected one of" in text
    assert "config.env.max_turns=0; expected an integer >= 1" in text
    assert "config.overlong.cache_tokens=4 with config.env.name='calculator'" in text


def test_the_readme_environment_example_runs_as_written():
    text = pathlib.Path(__file__).resolve().parents[3].joinpath("README.md").read_text()
    marker = "<!-- readme-example: environment -->"
    assert text.count(marker) == 1
    code = re.match(r"\s*```python\n(.*?)\n```", text.split(marker, 1)[1], re.DOTALL)[1]
    ENVIRONMENTS.pop("parity_hint", None)
    try:
        exec(compile(code, "README.md", "exec"), {})
        tok = ByteTokenizer()
        env = get_environment("parity_hint")(tokenizer=tok, reward=get_reward("exact"))
        request = Request(uid=0, prompt=tuple(tok.encode("7+7=")), meta={"answer": "14"})
        turn = lambda text: Transcript(turns=(tuple(tok.encode(text)),), observations=())
        assert env.step(request, turn("14")) == Turn(reward=1.0, done=True)
        wrong = env.step(request, turn("13"))
        assert not wrong.done and tok.decode(wrong.observation) == "even7+7="
    finally:
        ENVIRONMENTS.pop("parity_hint", None)
