"""The sampler loop's background thread: it steps while there is work and sleeps otherwise.

The thread waits on the loop's condition (`wake`, whose lock guards the loop's state and the flags
here) until `has_work()` or a stop; `idle` is set while it waits and when it ends. An exception
that stops it is kept in `error` for the caller (`raise_if_failed`), except a QueueClosed after a
stop was requested: work running ahead (async) may finish while the run shuts down, and a group
the closed queue refuses is then dropped, not an error.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from rl.queue import QueueClosed


class LoopThread:
    """Calls `step` on a daemon thread whenever `has_work()` (checked with `wake`'s lock held)."""

    def __init__(
        self,
        step: Callable[[], object],
        has_work: Callable[[], bool],
        wake: threading.Condition,
        name: str = "sampler-loop",
    ):
        self.step, self.has_work, self.wake, self.name = step, has_work, wake, name
        self.idle = threading.Event()  # cleared by whoever adds work; set while the thread waits
        self.idle.set()
        self.stop = False  # guarded by wake's lock
        self.error: BaseException | None = None  # guarded by wake's lock
        self._thread: threading.Thread | None = None

    @property
    def started(self) -> bool:
        return self._thread is not None

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("SamplerLoop.start called twice.")
        self._thread = threading.Thread(target=self._main, name=self.name, daemon=True)
        self._thread.start()

    def _main(self) -> None:
        try:
            while True:
                with self.wake:
                    while not self.stop and not self.has_work():
                        self.idle.set()
                        self.wake.wait()
                    if self.stop:
                        return
                self.step()
        except BaseException as e:  # surfaced to the caller by raise_if_failed
            with self.wake:
                if not (self.stop and isinstance(e, QueueClosed)):
                    self.error = e
        finally:
            self.idle.set()

    def request_stop(self) -> None:
        """Asks the thread to stop after its current step."""
        with self.wake:
            self.stop = True
            self.wake.notify_all()

    def wait_idle(self, timeout: float | None, pending: Callable[[], int]) -> None:
        """Blocks until the thread waits for work (or ended); re-raises what stopped it.

        Args:
          timeout: seconds to wait (None: no limit).
          pending: the work left, for the timeout's message.
        """
        if not self.idle.wait(timeout):
            raise TimeoutError(
                f"Sampler did not drain within {timeout} s ({pending()} requests pending)."
            )
        with self.wake:
            self.raise_if_failed()

    def close(self) -> None:
        """Stops the thread after its current step, waits for it; re-raises what stopped it."""
        self.request_stop()
        if self._thread is not None:
            self._thread.join()
        with self.wake:
            self.raise_if_failed()

    def raise_if_failed(self) -> None:
        """Re-raises the exception that stopped the thread, if any (wake's lock held)."""
        if self.error is not None:
            raise self.error
