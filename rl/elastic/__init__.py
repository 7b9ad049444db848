"""Elastic devices: work and devices that move while a run goes (DESIGN.md, "Runtimes").

- `migration`: JigsawRL long-tail migration, a pure policy that, given a snapshot of the sampler
  replicas at a decode-step boundary, says which running requests move to which replica so the
  round's tail runs on fewer replicas (the threaded replica sampler, rl.runtime.replicas, and the
  simulator, rl.sim.sampler, both execute its moves).
"""
