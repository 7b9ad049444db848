"""RewardRunner: errors and timeouts score 0.0, are counted and logged once; capacity is kept."""

import threading
import time

import numpy as np
import pytest

from rl.rewards import RewardRunner, get_reward
from rl.rewards import runner as runner_lib
from rl.types import Completion, Request


def decode(tokens) -> str:
    return "".join(map(chr, tokens))


def _request(uid: int = 3, **meta) -> Request:
    return Request(uid=uid, round=2, prompt=(1,), meta=meta)


def _completion(text: str) -> Completion:
    tokens = tuple(map(ord, text))
    return Completion(
        uid=3,
        round=2,
        sample=0,
        prompt=(1,),
        tokens=tokens,
        logprobs=(0.0,) * len(tokens),
        versions=(0,) * len(tokens),
        finish_reason="stop",
    )


@pytest.fixture
def warnings(monkeypatch):
    """The messages RewardRunner logs with absl's logging.warning, formatted."""
    logged: list[str] = []
    monkeypatch.setattr(runner_lib.logging, "warning", lambda msg, *a: logged.append(msg % a))
    return logged


def test_normal_calls():
    with RewardRunner(get_reward("exact"), decode=decode) as run:
        assert run(_request(answer=42), _completion(" 42\n")) == 1.0
        assert run(_request(answer=42), _completion("41")) == 0.0
        assert run.stats() == {"calls": 2, "errors": 0, "timeouts": 0, "stuck": 0, "replaced": 0}


def test_errors_score_zero_counted_logged_once(warnings):
    def flaky(request: Request, text: str) -> float:
        if text == "boom":
            raise KeyError("answer")
        if text == "timeout-error":
            raise TimeoutError("raised by the function, not a timeout")
        return 1.0

    with RewardRunner(flaky, decode=decode, timeout_s=5.0) as run:
        assert run(_request(uid=11), _completion("boom")) == 0.0
        assert run(_request(uid=12), _completion("boom")) == 0.0
        assert run(_request(uid=13), _completion("timeout-error")) == 0.0
        assert run(_request(), _completion("fine")) == 1.0
        assert (run.calls, run.errors, run.timeouts) == (4, 3, 0)
    assert len(warnings) == 1
    assert (
        "flaky" in warnings[0] and "uid=11" in warnings[0] and "KeyError('answer')" in warnings[0]
    )


def test_decode_errors_are_counted():
    def bad_decode(tokens) -> str:
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")

    with RewardRunner(get_reward("exact"), decode=bad_decode) as run:
        assert run(_request(answer=1), _completion("1")) == 0.0
        assert run.errors == 1


@pytest.mark.parametrize("value", [None, "1.0", float("nan"), float("inf"), [1.0], 1j])
def test_invalid_values_are_errors(value, warnings):
    with RewardRunner(lambda request, text: value, decode=decode) as run:
        assert run(_request(), _completion("a")) == 0.0
        assert run(_request(), _completion("b")) == 0.0
        assert run.errors == 2
    assert len(warnings) == 1 and "expected a finite real number" in warnings[0]


@pytest.mark.parametrize("value, expected", [(True, 1.0), (np.float32(0.5), 0.5), (3, 3.0)])
def test_numeric_values(value, expected):
    with RewardRunner(lambda request, text: value, decode=decode) as run:
        reward = run(_request(), _completion("a"))
        assert reward == expected and type(reward) is float and run.errors == 0


def test_timeout_scores_zero_quickly_and_keeps_capacity(warnings):
    def slow(request: Request, text: str) -> float:
        if text == "slow":
            time.sleep(2.0)
        return 1.0

    # One worker: without a replacement for the stuck one, the next calls would time out too.
    with RewardRunner(slow, decode=decode, timeout_s=0.2, workers=1) as run:
        start = time.monotonic()
        assert run(_request(uid=21), _completion("slow")) == 0.0
        assert run(_request(uid=22), _completion("slow")) == 0.0
        assert time.monotonic() - start < 2.0  # neither waited for its sleep to end
        for _ in range(3):
            assert run(_request(), _completion("fast")) == 1.0
        stats = run.stats()
    assert stats["calls"] == 5 and stats["timeouts"] == 2 and stats["errors"] == 0
    assert stats["replaced"] == 2
    assert len(warnings) == 1 and "uid=21" in warnings[0] and "timeout_s=0.2" in warnings[0]


def test_abandoned_thread_leaves_when_its_call_returns():
    release = threading.Event()

    def hang(request: Request, text: str) -> float:
        if text == "hang":
            release.wait(10.0)
        return 1.0

    run = RewardRunner(hang, decode=decode, timeout_s=0.1, workers=2)
    try:
        assert run(_request(), _completion("hang")) == 0.0
        assert run.stats()["stuck"] == 1
        assert run(_request(), _completion("ok")) == 1.0
        release.set()

        def workers() -> int:
            return sum(".hang-" in t.name for t in threading.enumerate())

        deadline = time.monotonic() + 5.0
        while (run.stats()["stuck"] or workers() > 2) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert run.stats()["stuck"] == 0
        assert workers() == 2  # the replacement and the other worker; the stuck one has left
    finally:
        release.set()
        run.close()


def test_too_many_stuck_calls_raise():
    release = threading.Event()
    run = RewardRunner(lambda r, t: release.wait(10.0), decode=decode, timeout_s=0.05, max_stuck=1)
    try:
        assert run(_request(uid=31), _completion("a")) == 0.0
        with pytest.raises(
            RuntimeError, match=r"2 calls are stuck .* expected at most max_stuck=1"
        ):
            run(_request(uid=32), _completion("b"))
    finally:
        release.set()
        run.close()


def test_close_and_arguments():
    run = RewardRunner(lambda r, t: 1.0, decode=decode)
    run.close()
    run.close()  # idempotent
    with pytest.raises(RuntimeError, match="is closed"):
        run(_request(), _completion("a"))
    with pytest.raises(ValueError, match="timeout_s must be a finite number > 0; received 0"):
        RewardRunner(lambda r, t: 1.0, decode=decode, timeout_s=0)
    with pytest.raises(ValueError, match="workers must be >= 1; received 0"):
        RewardRunner(lambda r, t: 1.0, decode=decode, workers=0)


def _sleep_20ms(request: Request, text: str) -> float:
    time.sleep(0.02)
    return 1.0


def test_submit_returns_at_once_and_calls_run_in_parallel():
    with RewardRunner(_sleep_20ms, decode=decode, timeout_s=5.0, workers=4) as run:
        run(_request(), _completion("warm"))  # the lanes are up
        start = time.monotonic()
        futures = [run.submit(_request(uid=i), _completion("a")) for i in range(8)]
        submitted = time.monotonic() - start
        assert [f.result() for f in futures] == [1.0] * 8
        elapsed = time.monotonic() - start
    assert submitted < 0.02  # no submit waited for a call
    assert elapsed < 8 * 0.02  # 4 lanes: two waves of 20 ms, not eight calls in a row


def test_the_timeout_starts_when_a_worker_takes_the_call():
    # One lane, six 20 ms calls queued at once: the last waits 100 ms, past timeout_s, yet each
    # call takes only 20 ms of it, so none times out.
    with RewardRunner(_sleep_20ms, decode=decode, timeout_s=0.08, workers=1) as run:
        futures = [run.submit(_request(uid=i), _completion("a")) for i in range(6)]
        assert [f.result() for f in futures] == [1.0] * 6
        assert run.timeouts == 0


def _spin(request: Request, text: str) -> float:
    """A CPU-bound verifier that never returns on "spin" (holds the GIL in its process)."""
    while text == "spin":
        pass
    if text == "boom":
        raise KeyError("answer")
    return float(len(text))


def test_process_backend_kills_a_hung_cpu_bound_call_and_keeps_capacity(warnings):
    with RewardRunner(_spin, decode=decode, timeout_s=0.5, workers=1, backend="process") as run:
        assert run(_request(), _completion("ab")) == 2.0
        start = time.monotonic()
        assert run(_request(uid=41), _completion("spin")) == 0.0
        assert time.monotonic() - start < 5.0
        # the one lane's process was killed and replaced: the next calls are served
        assert run(_request(), _completion("abc")) == 3.0
        assert run(_request(uid=42), _completion("boom")) == 0.0
        stats = run.stats()
    assert stats == {"calls": 4, "errors": 1, "timeouts": 1, "stuck": 0, "replaced": 1}
    assert any("uid=41" in w and "process killed" in w for w in warnings)
    assert any("uid=42" in w and "KeyError('answer')" in w for w in warnings)


def test_process_backend_needs_a_picklable_function():
    with pytest.raises(ValueError, match="cannot be pickled .* expected a module-level function"):
        RewardRunner(lambda r, t: 1.0, decode=decode, backend="process")
    with pytest.raises(ValueError, match=r"backend='gpu'; expected one of \('thread', 'process'\)"):
        RewardRunner(_spin, decode=decode, backend="gpu")


def test_a_call_running_python_code_is_stopped_at_its_timeout():
    before = threading.active_count()
    run = RewardRunner(_spin, decode=decode, timeout_s=0.2, workers=2)
    try:
        assert run(_request(), _completion("spin")) == 0.0
        deadline = time.monotonic() + 2.0
        while run.stats()["stuck"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert run.stats()["stuck"] == 0  # the call stopped: it costs nothing after its timeout
        assert run.stats()["timeouts"] == 1
        assert run(_request(), _completion("ok")) == 2.0
    finally:
        run.close()
    assert threading.active_count() == before


@pytest.mark.parametrize("backend", ["thread", "process"])
def test_close_ends_every_thread_and_process(backend):
    import multiprocessing

    before = threading.active_count()
    run = RewardRunner(_spin, decode=decode, timeout_s=0.5, workers=3, backend=backend)
    futures = [run.submit(_request(), _completion(t)) for t in ("ok", "spin", "ok", "ok")]
    assert [f.result() for f in futures] == [2.0, 0.0, 2.0, 2.0]
    run.close()
    assert threading.active_count() == before
    assert multiprocessing.active_children() == []


@pytest.mark.parametrize("max_stuck", [0, 32], ids=["limit_hit", "within_limit"])
def test_close_does_not_wait_for_a_call_stuck_inside_a_c_function(max_stuck):
    def sleeps(request: Request, text: str) -> float:
        time.sleep(30.0)  # one C call: the stop lands only when it returns
        return 1.0

    run = RewardRunner(sleeps, decode=decode, timeout_s=0.1, workers=1, max_stuck=max_stuck)
    if max_stuck:
        assert run(_request(), _completion("a")) == 0.0
    else:
        with pytest.raises(RuntimeError, match="1 calls are stuck"):
            run(_request(), _completion("a"))
    t = time.monotonic()
    run.close()
    assert time.monotonic() - t < 5.0
