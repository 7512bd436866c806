"""Starting an attempt's ranks fast: the warm launcher (zygote), its warm ranks, rank pinning for torchrun.

May import processes, diagnosis, tiers, layouts, transport and the shared modules; never run, cluster or cli."""
