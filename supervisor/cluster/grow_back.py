"""A job that went on with fewer nodes grows back (issue 43): the keys between a node left out of the smaller world
and the attempt's lead. The node back marks itself (``back/a/<node>``) and waits; the lead sees who is back and ends
the attempt at its next save (:meth:`~supervisor.cluster.coordinator.RoundCoordinator.end_to_resize`); the waiting
node sees the lead go on to the next attempt (:func:`moved_on`).
"""

from __future__ import annotations

from typing import Iterable

from supervisor.cluster.coordinator import RoundCoordinator


def mark_back(coordinator: RoundCoordinator, attempt: int) -> None:
    """This node, left out of ``attempt``'s smaller world, is back and waits to grow into the next one."""
    coordinator.keys.set(f"back/{attempt}/{coordinator.node_rank}", "1")


def back(coordinator: RoundCoordinator, attempt: int, nodes: Iterable[int]) -> list[int]:
    """Which of ``nodes`` (left out of ``attempt``) marked themselves back (:func:`mark_back`)."""
    nodes = list(nodes)
    marks = coordinator.keys.get_many([f"back/{attempt}/{n}" for n in nodes])
    return [n for n, m in zip(nodes, marks) if m is not None]


def moved_on(coordinator: RoundCoordinator, attempt: int) -> bool:
    """The lead of ``attempt`` joined the next one (its inventory is there): ``attempt`` is over for everyone."""
    return coordinator.keys.get(f"inv/{attempt + 1}/{coordinator.lead_of(attempt)}") is not None


__all__ = ["mark_back", "back", "moved_on"]
