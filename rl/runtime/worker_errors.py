"""A Ray worker's failure as one line: which of the run's workers failed, and why.

Ray reports an error raised in an actor as RayTaskError (the worker's whole traceback in its
message) or, when the actor's constructor raised or its process died, as ActorDiedError (the same,
after a preamble). `worker_failure` reads the worker from the message (a constructor's error
carries the actor's name, rl.runtime.ray_cluster.actor_name "rolloutpipe:<workdir>:<role>", as
"ray::<name>:<Class.method>()"; a method's error carries "repr=<the actor's repr>", which the
run's actors make their role) and the cause from the exception Ray carries or the traceback's last
line, so launch.train can print it as one line. It reads attributes and text only: nothing
here imports Ray.
"""

from __future__ import annotations

import re

_TASK = re.compile(r"ray::(?P<name>[^\s(]+)\(\)")
_ROLE = re.compile(r"^(?P<kind>replica|learner|queue)(?P<index>\d*)$")
_REPR = re.compile(r"repr=(?P<repr>[^<][^)]*)\)")  # an actor's own repr (not "<... object at>")
_CAUSE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Died|Failed)\b.*")


def is_ray_error(e: BaseException) -> bool:
    """Whether `e` is one of Ray's exceptions (ray.exceptions.RayError and its subclasses)."""
    return any(
        c.__module__.startswith("ray.") and c.__name__ == "RayError" for c in type(e).__mro__
    )


def role_label(actor_name: str) -> str | None:
    """'sampler replica 0' for a run's actor named ".../replica0"; None for any other name."""
    m = _ROLE.match(actor_name.rsplit(":", 1)[-1])
    if m is None:
        return None
    kind = {"replica": "sampler replica", "learner": "learner worker", "queue": "group queue"}
    return kind[m["kind"]] + (f" {m['index']}" if m["index"] else "")


def _worker(text: str) -> str:
    """'sampler replica 0 (ReplicaCore.__init__)': the actor's repr (the run's actors give their
    role: rl.runtime.ray_cluster.actor_repr), or its name in Ray's "ray::<name>:<method>()"
    (a constructor's error, before the repr exists), and the method."""
    found = _TASK.search(text)
    if found is None:
        return "a Ray worker"
    parts = found["name"].rsplit(":", 1)
    method = parts[-1]
    label = role_label(parts[0]) if len(parts) == 2 else None
    if label is None and (r := _REPR.search(text)) is not None:
        label = r["repr"]
    return f"{label or 'a Ray worker'} ({method})"


def _cause(e: BaseException, text: str) -> str:
    cause = getattr(e, "cause", None)
    if isinstance(cause, BaseException) and not is_ray_error(cause):
        first = str(cause).strip().splitlines()
        return f"{type(cause).__name__}: {first[0]}" if first else type(cause).__name__
    # The traceback's last "SomeError: message" line (a message may run over several lines:
    # the first is kept).
    lines = [line.strip() for line in text.splitlines()]
    for i in range(len(lines) - 1, -1, -1):
        if _CAUSE.match(lines[i]) and not lines[i].startswith("ray."):
            return lines[i]
    last = [line for line in lines if line]
    return last[-1] if last else type(e).__name__


def worker_failure(e: BaseException) -> str | None:
    """One line naming the worker that failed and the cause, for an error Ray raised; None for
    any other error."""
    if not is_ray_error(e):
        return None
    text = str(e)
    return f"{_worker(text)} failed: {_cause(e, text)}"
