"""One node's run loop and its decisions: watching an attempt, restart policy, the progress rule, checkpoint evidence, the run record.

May import launch, processes, diagnosis, tiers, layouts, transport and the shared modules; never cluster or cli."""
