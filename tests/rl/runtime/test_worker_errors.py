"""A Ray worker's error is one line naming the run's worker and the cause (launch.train prints it);
any other error is left alone."""

import pytest

from rl.runtime.ray_cluster import actor_repr
from rl.runtime.worker_errors import worker_failure


def _replica_class():
    """Defined in a function, so the workers get it by value (they cannot import this module)."""

    class _Replica:
        def __repr__(self):  # as the run's actors: their role (rl.runtime.ray_cluster)
            return actor_repr(self)

        def __init__(self, fail: bool):
            if fail:
                raise ValueError(
                    "Unknown reward 'mine' in this worker process: it could not be loaded"
                )

        def score(self):
            raise KeyError("no such request")

    return _Replica


def _error(call):
    with pytest.raises(Exception) as info:
        call()
    return info.value


@pytest.mark.slow  # two Ray actors, each importing the library (~10 s)
def test_a_worker_that_failed_to_start_or_raised_is_named_with_its_cause(ray_cluster):
    ray = ray_cluster
    name = "rolloutpipe:/tmp/some:run:replica1"  # rl.runtime.ray_cluster.actor_name's shape
    actor = ray.remote(num_cpus=0)(_replica_class())
    dead = actor.options(name=name).remote(True)
    e = _error(lambda: ray.get(dead.score.remote()))
    assert worker_failure(e) == (
        "sampler replica 1 (_Replica.__init__) failed: ValueError: Unknown reward 'mine' in this "
        "worker process: it could not be loaded"
    )
    live = actor.options(name="rolloutpipe:/tmp/w:learner").remote(False)
    e = _error(lambda: ray.get(live.score.remote()))
    assert isinstance(e, KeyError)  # Ray's RayTaskError(KeyError): still the user's type
    assert (
        worker_failure(e) == "learner worker (_Replica.score) failed: KeyError: 'no such request'"
    )
    ray.kill(live)
    assert repr(_replica_class()(False)).startswith("<")  # outside an actor: object's repr


def test_other_errors_are_not_worker_failures():
    assert worker_failure(ValueError("ray::rolloutpipe:/w:replica0:X.f() failed")) is None
