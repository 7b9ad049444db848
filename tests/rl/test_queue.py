"""GroupQueue: FIFO under threads with backpressure, close/drain semantics, fail() and timeouts."""

import threading
import time

import pytest

from rl import queue as queue_lib
from rl.queue import GroupQueue, Queue, QueueClosed
from rl.types import Completion, Group, Request

# Seconds a woken thread may take to end: only a hang reaches it, so a loaded machine never does.
JOIN_S = 60.0


def _group(uid: int, round: int = 0) -> Group:
    request = Request(uid=uid, round=round, index=uid, prompt=(1,))
    c = Completion(
        uid=uid, round=round, sample=0, prompt=(1,), tokens=(2,), logprobs=(0.0,), versions=(0,),
        finish_reason="stop", reward=1.0,
    )  # fmt: skip
    return Group(request=request, completions=(c,))


def _start(fn) -> tuple[threading.Thread, dict]:
    """Runs fn in a daemon thread; the dict gets 'result' or 'error', then 'done'."""
    out: dict = {}

    def run():
        try:
            out["result"] = fn()
        except BaseException as e:  # the test inspects it
            out["error"] = e
        out["done"] = True

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


@pytest.fixture
def blocked(monkeypatch):
    """`blocked(n)` returns once n calls have blocked inside the test's GroupQueues (each entered a
    wait on the queue's condition, so the queue's lock is free for the test's next call): a test
    acts on a call that is waiting, where a sleep would only guess that it is."""
    waits = threading.Semaphore(0)

    class Condition(threading.Condition):
        def wait(self, timeout=None):
            waits.release()
            return super().wait(timeout)

    monkeypatch.setattr(queue_lib, "Condition", Condition)  # the queues made after this point

    def wait_for(n: int) -> None:
        for i in range(n):
            assert waits.acquire(timeout=JOIN_S), f"{i} of {n} calls blocked on the queue"

    return wait_for


def test_fifo_order_and_counters():
    q: Queue = GroupQueue()
    groups = [_group(i) for i in range(5)]
    for g in groups:
        q.put(g)
    assert q.qsize() == 5 and q.max_depth == 5 and q.puts == 5
    got = [q.get() for _ in range(5)]
    assert all(a is b for a, b in zip(got, groups, strict=True))  # FIFO, stored as-is
    assert q.gets == 5 and q.qsize() == 0 and not q.closed


def test_put_blocks_while_full_until_a_get(blocked):
    q = GroupQueue(maxsize=2)
    q.put(_group(0))
    q.put(_group(1))
    t, out = _start(lambda: q.put(_group(2)))
    blocked(1)
    assert "done" not in out and q.qsize() == 2  # backpressure: the third put waits
    assert q.get().request.uid == 0
    t.join(JOIN_S)
    assert not t.is_alive() and "error" not in out
    assert [q.get().request.uid for _ in range(2)] == [1, 2]
    assert q.max_depth == 2 and q.put_wait_s > 0


@pytest.mark.parametrize("consumers", [1, 3])
def test_threads_lose_and_duplicate_nothing_with_a_slow_consumer(consumers):
    q = GroupQueue(maxsize=2)
    producers, per_producer = 3, 40
    got: list[list[Group]] = [[] for _ in range(consumers)]

    def produce(p):
        for i in range(per_producer):
            q.put(_group(uid=i, round=p))

    def consume(c):
        while True:
            try:
                got[c].append(q.get())
            except QueueClosed:
                return
            time.sleep(0.0005)  # slow consumer: producers hit the bound

    cs = [threading.Thread(target=consume, args=(c,), daemon=True) for c in range(consumers)]
    ps = [threading.Thread(target=produce, args=(p,), daemon=True) for p in range(producers)]
    for t in cs + ps:
        t.start()
    for t in ps:
        t.join(JOIN_S)
    q.close()
    for t in cs:
        t.join(JOIN_S)
    assert not any(t.is_alive() for t in cs + ps)
    keys = [g.request.key for part in got for g in part]
    expected = [(p, i) for p in range(producers) for i in range(per_producer)]
    assert sorted(keys) == expected  # none lost, none duplicated
    assert q.max_depth <= 2 and q.puts == q.gets == len(expected)
    if consumers == 1:  # FIFO: each producer's groups come out in the order it put them
        for p in range(producers):
            assert [u for r, u in keys if r == p] == list(range(per_producer))


def test_close_drains_then_raises():
    q = GroupQueue()
    q.put(_group(0))
    q.put(_group(1))
    q.close()
    q.close()  # idempotent
    assert q.closed
    with pytest.raises(QueueClosed, match=r"\(round, uid\)=\(4, 7\)"):
        q.put(_group(7, round=4))
    assert [q.get().request.uid for _ in range(2)] == [0, 1]
    with pytest.raises(QueueClosed, match="closed, drained"):
        q.get()
    assert issubclass(QueueClosed, RuntimeError)


def test_close_wakes_blocked_get_and_put(blocked):
    empty, full = GroupQueue(), GroupQueue(maxsize=1)
    full.put(_group(0))
    tg, outg = _start(empty.get)
    tp, outp = _start(lambda: full.put(_group(1, round=2)))
    blocked(2)  # both wait (no timeout): only the close can end them
    empty.close()
    full.close()
    tg.join(JOIN_S)
    tp.join(JOIN_S)
    assert isinstance(outg.get("error"), QueueClosed)
    assert isinstance(outp.get("error"), QueueClosed) and "(2, 1)" in str(outp["error"])
    assert full.get().request.uid == 0  # what was queued still drains


def test_fail_wakes_blocked_get_and_put_with_the_error(blocked):
    empty, full = GroupQueue(), GroupQueue(maxsize=1)
    full.put(_group(0))
    tg, outg = _start(empty.get)
    tp, outp = _start(lambda: full.put(_group(1)))
    blocked(2)  # both wait (no timeout): only the fail can end them
    boom = ValueError("sampler crashed")
    empty.fail(boom)
    full.fail(boom)
    tg.join(JOIN_S)
    tp.join(JOIN_S)
    assert not tg.is_alive() and not tp.is_alive()  # woken, not left waiting
    assert outg.get("error") is boom and outp.get("error") is boom
    assert full.closed and full.error is boom
    with pytest.raises(ValueError, match="sampler crashed"):
        full.get()  # a failed queue does not drain: the queued group is not handed on
    with pytest.raises(ValueError, match="sampler crashed"):
        full.put(_group(2))
    full.fail(RuntimeError("later"))
    assert full.error is boom  # the first error (the cause) wins


def test_fail_after_close_stops_draining():
    q = GroupQueue()
    q.put(_group(0))
    q.close()
    q.fail(KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        q.get()


def test_timeouts():
    # A timeout is a lower bound on the caller's wait (load only lengthens it; 1 ms is left for
    # the rounding of clock readings). The wait counters are only checked to be counted: the queue
    # starts counting after it reads the clock for its deadline, and a loaded machine may stall
    # the thread in between.
    q = GroupQueue(maxsize=1)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="empty"):
        q.get(timeout=0.02)
    assert time.monotonic() - start >= 0.019
    with pytest.raises(TimeoutError, match="empty"):
        q.get(timeout=0)
    assert q.get_wait_s > 0
    q.put(_group(0), timeout=0)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"\(0, 1\).*full"):
        q.put(_group(1), timeout=0.02)
    assert time.monotonic() - start >= 0.019
    assert q.put_wait_s > 0 and q.qsize() == 1
    assert q.get(timeout=0).request.uid == 0
    with pytest.raises(ValueError, match="received -1"):
        q.get(timeout=-1)


def test_bad_arguments():
    with pytest.raises(ValueError, match="received -1"):
        GroupQueue(maxsize=-1)
    q = GroupQueue()
    with pytest.raises(TypeError, match="received dict"):
        q.put({})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="received str"):
        q.fail("boom")  # type: ignore[arg-type]
