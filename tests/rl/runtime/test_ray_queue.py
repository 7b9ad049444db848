"""The queue actor's books of which requests' groups it holds (QueueActor.keys): the router keeps
those owned when their replica leaves or dies, so they must be named from the put's call until
the driver is done with them."""

import ray

from rl.queue import QueueClosed
from rl.runtime.ray_queue import QueueActor, QueueClient
from rl.types import Completion, Group, Request


def group(uid):
    request = Request(uid=uid, prompt=(1, 2), group_size=1)
    completion = Completion(
        uid=uid,
        round=0,
        sample=0,
        prompt=request.prompt,
        tokens=(3,),
        logprobs=(-0.5,),
        versions=(0,),
        finish_reason="stop",
        reward=1.0,
    )
    return Group(request=request, completions=(completion,))


def test_keys_name_queued_groups_and_the_one_in_the_drivers_hands(ray_cluster):
    actor = QueueActor.options(max_concurrency=4).remote(0)
    accepted = []
    client = QueueClient(actor, lambda g: accepted.append(g.request.key) or True)
    keys = lambda: ray.get(actor.keys.remote())
    a, b = group(0), group(1)
    client.put(a)
    client.put(b)
    assert keys() == {a.request.key, b.request.key}
    assert client.get() == a  # taken off, in the driver's hands until its next get
    assert keys() == {a.request.key, b.request.key}
    assert client.get() == b
    assert keys() == {b.request.key}
    assert ray.get(actor.get.remote(0.01))[0] is None  # a get that found nothing: b is done with
    assert keys() == set() and accepted == [a.request.key, b.request.key]


def test_a_put_that_fails_leaves_no_key(ray_cluster):
    actor = QueueActor.options(max_concurrency=4).remote(0)
    client = QueueClient(actor, lambda g: True)
    client.close()
    try:
        client.put(group(0))
    except QueueClosed:
        pass
    else:
        raise AssertionError("a put after close went through")
    assert ray.get(actor.keys.remote()) == set()
