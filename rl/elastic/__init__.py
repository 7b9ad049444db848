"""Elastic devices: policies that move work or devices between the pools while a run goes.

`borrowing` (BiDiRL): lend the idle pool's devices to the bottleneck when the stage-time models
predict a gain above the measured switch cost. Pure, clock-free objects shared by the runtime
(rl/driver.py, learner/) and the simulator (rl/sim).
"""
