"""Runtimes: the composition root (compose), the driver's protocols, and the two runtimes that run
the same Driver and schedules: `threads` (one process) and `ray` (actors, one host or many);
`factory` picks the one config.runtime names."""
