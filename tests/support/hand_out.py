"""The order in which the suite hands its modules to the xdist workers (tests/conftest.py), from the seconds and the
CPU each took in a CI run (tests/module_times.json, written by scripts/module_times.py).

Longest first, so no worker starts a long module while the others are already done; but of any three modules
handed out in a row at most one is wait-bound (CPU under :data:`WAIT_BOUND` of its wall time: partitions, hung file
systems, timeouts, servers). The suite is bound by CPU on 2 cores with 3 workers, and two wait-bound modules side by
side leave the cores half idle: plain longest-first once put the long wait-bound modules together at the start and
cost a run 90 s (CONTRIBUTING.md, "Suite time")."""

from __future__ import annotations

from typing import Mapping

WAIT_BOUND = 0.35  # CPU / wall below this: the module mostly waits
WINDOW = 3  # the workers: modules handed out this close together mostly run side by side


def wall_and_cpu(entry: object) -> tuple[float, float] | None:
    """A module_times.json entry: ``{"wall": s, "cpu": s}``, or seconds alone (taken as CPU-bound)."""
    if isinstance(entry, (int, float)):
        return float(entry), float(entry)
    if isinstance(entry, dict) and isinstance(entry.get("wall"), (int, float)):
        cpu = entry.get("cpu")
        return float(entry["wall"]), float(cpu) if isinstance(cpu, (int, float)) else float(entry["wall"])
    return None


def hand_out_order(times: Mapping[str, object]) -> list[str]:
    """The modules of ``times`` in hand-out order (see the module docstring); entries that do not parse are left out."""
    parsed = {m: wc for m, e in times.items() if (wc := wall_and_cpu(e)) is not None}

    def waits(module: str) -> bool:
        wall, cpu = parsed[module]
        return wall > 0 and cpu < WAIT_BOUND * wall

    pending = sorted(parsed, key=lambda m: (-parsed[m][0], m))
    order: list[str] = []
    while pending:
        pick = pending[0]
        if waits(pick) and any(waits(m) for m in order[-(WINDOW - 1):]):
            pick = next((m for m in pending if not waits(m)), pick)
        order.append(pick)
        pending.remove(pick)
    return order
