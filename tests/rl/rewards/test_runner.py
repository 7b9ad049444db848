"""RewardRunner: errors and timeouts score 0.0, are counted and logged once; capacity is kept."""

import threading
from collections.abc import Callable

import numpy as np
import pytest

from rl.rewards import RewardRunner, get_reward
from rl.rewards import runner as runner_lib
from rl.types import Completion, Request

# The timeout of the tests where a call must start, or end, before it runs out: 1 s, far above the
# time even a loaded machine takes to schedule a woken thread. A test pays it once per call that
# it times out on purpose. Calls that must time out block on an event until the test ends.
TIMEOUT_S = 1.0
# Seconds a thread, a blocked call or a barrier is waited for: only a hang reaches it.
WAIT_S = 60.0


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


@pytest.fixture(autouse=True)
def every_thread_ends():
    """Every thread a test started has ended after it (joined here: a stopped call released at
    the end of a test may still be unwinding), so none outlives its test into the next one."""
    before = set(threading.enumerate())
    yield
    started = [t for t in threading.enumerate() if t not in before]
    for t in started:
        t.join(WAIT_S)
    assert [t for t in started if t.is_alive()] == []


def _started_since(before: set[threading.Thread]) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t not in before]


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


def test_timeout_scores_zero_without_waiting_for_the_call_and_keeps_capacity(warnings):
    release, ended = threading.Event(), threading.Event()

    def slow(request: Request, text: str) -> float:
        if text == "slow":
            release.wait(WAIT_S)
            ended.set()
        return 1.0

    # One worker: without a replacement for the stuck one, the next calls would time out too.
    with RewardRunner(slow, decode=decode, timeout_s=TIMEOUT_S, workers=1) as run:
        try:
            assert run(_request(uid=21), _completion("slow")) == 0.0
            assert run(_request(uid=22), _completion("slow")) == 0.0
            assert not ended.is_set()  # neither was waited for: they end only on `release`
            for _ in range(3):
                assert run(_request(), _completion("fast")) == 1.0
            stats = run.stats()
        finally:
            release.set()
    assert stats["calls"] == 5 and stats["timeouts"] == 2 and stats["errors"] == 0
    assert stats["replaced"] == 2
    assert len(warnings) == 1 and "uid=21" in warnings[0]
    assert f"timeout_s={TIMEOUT_S}" in warnings[0]


def test_abandoned_thread_leaves_when_its_call_returns():
    release, hung = threading.Event(), []

    def hang(request: Request, text: str) -> float:
        if text == "hang":
            hung.append(threading.current_thread())
            release.wait(WAIT_S)
        return 1.0

    run = RewardRunner(hang, decode=decode, timeout_s=TIMEOUT_S, workers=2)
    try:
        assert run(_request(), _completion("hang")) == 0.0
        assert len(hung) == 1, "the call did not start within its timeout"
        assert run.stats()["stuck"] == 1
        assert run(_request(), _completion("ok")) == 1.0
        release.set()
        hung[0].join(WAIT_S)
        assert not hung[0].is_alive()  # the stuck thread left once its call returned
        assert run.stats()["stuck"] == 0
        # the replacement and the other worker; the stuck one has left
        assert sum(".hang-" in t.name for t in threading.enumerate()) == 2
    finally:
        release.set()
        run.close()


def test_too_many_stuck_calls_raise():
    release, started = threading.Event(), threading.Event()

    def hang(request: Request, text: str) -> float:
        started.set()
        return release.wait(WAIT_S)

    run = RewardRunner(hang, decode=decode, timeout_s=TIMEOUT_S, max_stuck=1)
    try:
        assert run(_request(uid=31), _completion("a")) == 0.0
        assert started.is_set(), "the call did not start within its timeout"
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


def test_submit_returns_at_once_and_calls_run_in_parallel():
    gate, wave = threading.Event(), threading.Barrier(4, timeout=WAIT_S)

    def gated(request: Request, text: str) -> float:
        gate.wait(WAIT_S)
        wave.wait()  # trips only with 4 calls running at once (else raises: an error, 0.0)
        return 1.0

    with RewardRunner(gated, decode=decode, timeout_s=WAIT_S, workers=4) as run:
        futures = [run.submit(_request(uid=i), _completion("a")) for i in range(8)]
        assert not any(f.done() for f in futures)  # every submit returned, no call could end
        gate.set()
        assert [f.result() for f in futures] == [1.0] * 8  # 4 lanes: two waves of 4
        assert run.errors == run.timeouts == 0


def test_the_timeout_starts_when_a_worker_takes_the_call():
    # One lane. "first" holds it while the test queues three calls; "stuck" then holds it for the
    # whole timeout_s (it times out), so "a" and "bb" wait in the queue for longer than timeout_s.
    # Their clocks start only when the lane takes them, so neither times out.
    first_runs, first_ends, stuck_ends = threading.Event(), threading.Event(), threading.Event()

    def fn(request: Request, text: str) -> float:
        if text == "first":
            first_runs.set()
            first_ends.wait(WAIT_S)
        elif text == "stuck":
            stuck_ends.wait(WAIT_S)
        return float(len(text))

    with RewardRunner(fn, decode=decode, timeout_s=TIMEOUT_S, workers=1) as run:
        try:
            first = run.submit(_request(uid=0), _completion("first"))
            assert first_runs.wait(WAIT_S)
            texts = ("stuck", "a", "bb")
            rest = [run.submit(_request(uid=i), _completion(t)) for i, t in enumerate(texts, 1)]
            first_ends.set()
            assert first.result() == 5.0
            assert [f.result() for f in rest] == [0.0, 1.0, 2.0]
            assert run.timeouts == 1  # "stuck" only
        finally:
            first_ends.set()
            stuck_ends.set()


def _spin(request: Request, text: str) -> float:
    """A CPU-bound verifier that never returns on "spin" (holds the GIL in its process)."""
    while text == "spin":
        pass
    if text == "boom":
        raise KeyError("answer")
    return float(len(text))


def test_process_backend_kills_a_hung_cpu_bound_call_and_keeps_capacity(warnings):
    with RewardRunner(
        _spin, decode=decode, timeout_s=TIMEOUT_S, workers=1, backend="process"
    ) as run:
        assert run(_request(), _completion("ab")) == 2.0
        # "spin" never returns: only the kill can end the call (the bound is against a hang)
        assert run.submit(_request(uid=41), _completion("spin")).result(WAIT_S) == 0.0
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


def _recording_spin(spinning: list[threading.Thread]) -> Callable[[Request, str], float]:
    """`_spin` for the thread backend, recording the threads that run a "spin" call."""

    def spin(request: Request, text: str) -> float:
        if text == "spin":
            spinning.append(threading.current_thread())
        return _spin(request, text)

    return spin


def test_a_call_running_python_code_is_stopped_at_its_timeout():
    before, spinning = set(threading.enumerate()), []
    run = RewardRunner(_recording_spin(spinning), decode=decode, timeout_s=TIMEOUT_S, workers=2)
    try:
        assert run(_request(), _completion("spin")) == 0.0
        assert len(spinning) == 1, "the call did not start within its timeout"
        spinning[0].join(WAIT_S)  # "spin" never returns: only the stop can end its thread
        assert not spinning[0].is_alive()
        assert run.stats()["stuck"] == 0  # the call stopped: it costs nothing after its timeout
        assert run.stats()["timeouts"] == 1
        assert run(_request(), _completion("ok")) == 2.0
    finally:
        run.close()
    assert _started_since(before) == []


@pytest.mark.parametrize("backend", ["thread", "process"])
def test_close_ends_every_thread_and_process(backend):
    import multiprocessing

    before, spinning = set(threading.enumerate()), []
    fn = _spin if backend == "process" else _recording_spin(spinning)
    run = RewardRunner(fn, decode=decode, timeout_s=TIMEOUT_S, workers=3, backend=backend)
    futures = [run.submit(_request(), _completion(t)) for t in ("ok", "spin", "ok", "ok")]
    assert [f.result() for f in futures] == [2.0, 0.0, 2.0, 2.0]
    assert backend == "process" or len(spinning) == 1, "the call did not start within its timeout"
    run.close()
    # Every lane and worker has ended; a stopped call's thread (close waits for it at most 1 s)
    # may still be unwinding, and is then joined by `every_thread_ends`.
    assert [t for t in _started_since(before) if t not in spinning] == []
    assert multiprocessing.active_children() == []


@pytest.mark.parametrize("max_stuck", [0, 32], ids=["limit_hit", "within_limit"])
def test_close_does_not_wait_for_a_call_stuck_inside_a_c_function(max_stuck):
    release, ended = threading.Event(), threading.Event()

    def blocks(request: Request, text: str) -> float:
        release.wait(WAIT_S)  # one C call (a lock's acquire): the stop lands only when it returns
        ended.set()
        return 1.0

    run = RewardRunner(blocks, decode=decode, timeout_s=0.1, workers=1, max_stuck=max_stuck)
    try:
        if max_stuck:
            assert run(_request(), _completion("a")) == 0.0
        else:
            with pytest.raises(RuntimeError, match="1 calls are stuck"):
                run(_request(), _completion("a"))
        run.close()
        assert not ended.is_set()  # close returned while the call still ran
    finally:
        release.set()
        run.close()
