"""How an attempt is going and how it ended: hangs, rank deaths, step reports, stragglers, GPU faults, stacks, Flight Recorder.

May import tiers, layouts, transport and the shared modules; never processes, launch, run, cluster or cli."""
