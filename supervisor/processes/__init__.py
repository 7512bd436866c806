"""One attempt's OS side: start, track and end the job's process tree, its cgroup, the guardian, leftovers.

May import diagnosis, tiers, layouts, transport and the shared modules; never launch, run, cluster or cli."""
