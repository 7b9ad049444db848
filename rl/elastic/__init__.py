"""Elastic devices: work and devices that move while a run goes (DESIGN.md, "Runtimes").

- `migration`: JigsawRL long-tail migration, a pure policy that, given a snapshot of the sampler
  replicas at a decode-step boundary, says which running requests move to which replica so the
  round's tail runs on fewer replicas (the threaded replica sampler, rl.runtime.replicas, and the
  simulator, rl.sim.sampler, both execute its moves).
- `borrowing`: BiDiRL bidirectional borrowing, a pure policy that lends the idle pool's devices to
  the bottleneck when the stage-time models predict a gain above the measured switch cost (the
  driver with learner.Learner.borrow, rl.runtime.lending, and the simulator, rl.sim.borrow).
- `stage`: the stage-time model (StageModel) the policies predict with; the simulator, the
  device-split planner (rl.device_split) and the in-run planner (rl.runtime.mesh_plan) run on it.
"""
