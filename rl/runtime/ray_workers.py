"""Where the Ray runtime's workers used to live; each now has a module named for it.

rl.runtime.ray_learner (LearnerWorker), rl.runtime.ray_replica (ReplicaCore, SamplerReplica),
rl.runtime.ray_queue (QueueActor) and rl.runtime.ray_process (local_mesh, job_devices, join_job,
pin). The names below stay importable from here for the programs that import them so
(launch/bench_elastic.py).
"""

from __future__ import annotations

from rl.runtime.ray_process import local_mesh
from rl.runtime.ray_queue import QueueActor
from rl.runtime.ray_replica import SamplerReplica

__all__ = ["QueueActor", "SamplerReplica", "local_mesh"]
