"""Nodes agreeing on one job: the store and its clients, the per-attempt round and its plan, spares, liveness, the node daemon.

May import run, launch, processes, diagnosis, tiers, layouts, transport and the shared modules; never cli."""
