"""Pin each node's ranks to the node that wrote their checkpoint parts, whatever rendezvous was typed.

torchrun's c10d (and etcd) rendezvous hands out node ranks in its own order: torch's
``DynamicRendezvousHandler`` sorts participants by ``(addr, pid, local_id)``, and ``--node-rank`` is
ignored. So after a restart a rank can land on a node that never held its part, and a node-local
checkpoint directory then has nothing to load. rlsup already runs a rendezvous of its own before every
attempt (the coordinator's round: all nodes agree on the step and launch together), so for
``torchrun`` and ``python -m torch.distributed.run`` in a multi-node run it launches each node with
torchrun's *static* rendezvous: ``--node-rank`` = rlsup's
node rank, ``--nnodes`` = the number of peers, and the master at node 0's host (the port the user gave
for the rendezvous endpoint or master). Global ranks are then ``node_rank * nproc_per_node + local_rank``
on every attempt, and each rank's part is on its node (in place or fetched before launch).

Everything else on the command line is left as typed; the change is logged once.

NVRx ``ft_launcher`` accepts only c10d (its ``config_from_args`` refuses any other backend), and its
rendezvous also sorts nodes by ``(addr, pid, local_id)``: it runs as typed, with a warning. On a cluster
its order follows the host names, so list ``peers`` in that order (SLURM's node list is); if ranks do
move, ``CheckpointManager.restore`` fails the attempt naming the rank whose part is missing (never a
quiet fresh start).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Sequence

DEFAULT_PORT = {"c10d": 29400, "static": 29500}
# The options this module owns: removed from the user's command and set again (with their values).
_OWNED = {"--nnodes", "--rdzv-backend", "--rdzv_backend", "--rdzv-endpoint", "--rdzv_endpoint", "--rdzv-id",
          "--rdzv_id", "--node-rank", "--node_rank", "--master-addr", "--master_addr", "--master-port",
          "--master_port", "--standalone"}


FT_LAUNCHER_NOTE = ("warning: ft_launcher supports only the c10d rendezvous, which orders nodes by host name "
                    "(then pid), not by --node-rank: list peers in host-name order so each rank stays on the node "
                    "that holds its checkpoint part; a rank that lands elsewhere fails its attempt (ResumeError)")


class PinningError(ValueError):
    """The launcher's command cannot be pinned as it is (the message says which option and why)."""


@dataclass(frozen=True)
class Pinned:
    command: list[str]
    note: str  # what changed, for the log ("" when nothing did)


#: torchrun's options that take no value (torch 2.4-2.14, ``torch.distributed.run.get_args_parser``); every other
#: option of its parser takes one (:data:`TORCHRUN_VALUE_OPTIONS`). Spelled here so that a node's supervisor never
#: imports torch (1.3 s of CPU a node process) to read a command line; tests/launch/test_rank_pinning.py checks the
#: installed torch's parser against both tables.
TORCHRUN_FLAGS = frozenset({"--help", "-h", "--module", "-m", "--no-python", "--no_python", "--run-path", "--run_path",
                            "--standalone", "--virtual-local-rank", "--virtual_local_rank"})
TORCHRUN_VALUE_OPTIONS = frozenset({
    "--nnodes", "--nproc-per-node", "--nproc_per_node", "--rdzv-backend", "--rdzv_backend", "--rdzv-endpoint",
    "--rdzv_endpoint", "--rdzv-id", "--rdzv_id", "--rdzv-conf", "--rdzv_conf", "--max-restarts", "--max_restarts",
    "--monitor-interval", "--monitor_interval", "--start-method", "--start_method", "--event-log-handler",
    "--event_log_handler", "--role", "--log-dir", "--log_dir", "-r", "--redirects", "-t", "--tee",
    "--local-ranks-filter", "--local_ranks_filter", "--node-rank", "--node_rank", "--master-addr", "--master_addr",
    "--master-port", "--master_port", "--local-addr", "--local_addr", "--logs-specs", "--logs_specs",
    "--numa-binding", "--numa_binding", "--signals-to-handle", "--signals_to_handle", "--shutdown-timeout",
    "--shutdown_timeout", "--duplicate-stdout-filters", "--duplicate_stdout_filters", "--duplicate-stderr-filters",
    "--duplicate_stderr_filters"})


def _launcher(command: Sequence[str]) -> int | None:
    """The index of the launcher's first option, for a torchrun-compatible launcher."""
    if not command:
        return None
    head = os.path.basename(command[0])
    if head == "torchrun":
        return 1
    if re.fullmatch(r"python[0-9.]*", head) and list(command[1:3]) == ["-m", "torch.distributed.run"]:
        return 3
    return None


def pin_ranks(command: Sequence[str], node_rank: int, num_nodes: int, master_host: str) -> Pinned:
    """``command`` with torchrun's static rendezvous at rlsup's node rank (see the module docstring);
    unchanged for anything that is not a torchrun-compatible launcher."""
    found = _launcher(command)
    if found is None:
        if command and (os.path.basename(command[0]) == "ft_launcher"
                        or any(c.startswith("nvidia_resiliency_ext.") for c in command[1:3])):
            return Pinned(list(command), FT_LAUNCHER_NOTE)
        return Pinned(list(command), "")
    start, takes, flags = found, TORCHRUN_VALUE_OPTIONS, TORCHRUN_FLAGS
    options: dict[str, str] = {}
    kept: list[str] = []
    i = start
    while i < len(command):
        tok = command[i]
        if not tok.startswith("-") or tok == "--":
            break  # the training script (or module) and its own arguments
        name, eq, inline = tok.partition("=")
        if name in takes:
            if eq:
                value, i = inline, i + 1
            elif i + 1 < len(command):
                value, i = command[i + 1], i + 2
            else:
                raise PinningError(f"launcher option {name} has no value")
            if name in _OWNED:
                options[name.replace("_", "-")] = value
            else:
                kept += [tok] if eq else [name, value]
        elif name in flags:
            if name in _OWNED:
                options[name] = "1"
            else:
                kept.append(tok)
            i += 1
        else:
            kept.append(tok)  # unknown to the parser: leave it, the launcher will say what it thinks
            i += 1
    rest = list(command[i:])
    if not rest:
        return Pinned(list(command), "")
    backend = options.get("--rdzv-backend", "static")
    nnodes = options.get("--nnodes")
    if nnodes is not None:
        lo, _, hi = nnodes.partition(":")
        if not (lo.isdigit() and (not hi or hi.isdigit())) or int(hi or lo) < num_nodes or int(lo) > num_nodes:
            raise PinningError(f"launcher option --nnodes {nnodes} does not admit the {num_nodes} nodes in peers")
    endpoint = options.get("--rdzv-endpoint", "")
    port = options.get("--master-port") or (endpoint.rpartition(":")[2] if ":" in endpoint else "")
    port = port or str(DEFAULT_PORT.get(backend, DEFAULT_PORT["c10d"]))
    if not port.isdigit():
        raise PinningError(f"launcher rendezvous port {port!r} is not a number")
    host = master_host if backend != "static" or "--master-addr" not in options else options["--master-addr"]
    head = list(command[:start])
    pinned = head + kept + ["--nnodes", str(num_nodes), "--node-rank", str(node_rank), "--rdzv-backend", "static",
                            "--master-addr", host, "--master-port", port] + rest
    before = {"--rdzv-backend": "static", **options}  # torchrun's default backend is static
    after = {"--rdzv-backend": "static", "--node-rank": str(node_rank), "--nnodes": str(num_nodes),
             "--master-addr": host, "--master-port": port}
    changed = {k: v for k, v in after.items() if before.get(k) != v}
    dropped = sorted(set(before) - set(after))
    if not changed and not dropped:
        return Pinned(pinned, "")
    what = ", ".join(f"{k} {v}" for k, v in changed.items())
    note = (f"launcher rendezvous pinned to rlsup's node rank ({what}"
            + (f"; dropped {' '.join(dropped)}" if dropped else "") + "): ranks stay on the node that holds "
            f"their checkpoint parts (was {backend}"
            + (", which orders nodes by join order and ignores --node-rank)" if backend != "static" else ")"))
    return Pinned(pinned, note)


def resize_pinned(command: Sequence[str], node_rank: int, num_nodes: int, master_host: str | None = None) -> list[str]:
    """A command :func:`pin_ranks` pinned, for a world of ``num_nodes`` nodes in which this node is ``node_rank``
    (the job shrank or grew back): the values of the ``--nnodes`` and ``--node-rank`` it set (the run of options it
    adds, never a like-named argument of the script), replaced, and ``--master-addr`` too when ``master_host`` is
    given (the world's first node is not node 0, which was lost). A command it left as typed is returned unchanged."""
    out = list(command)
    at = _pinned_at(out)
    if at is not None:
        out[at + 1], out[at + 3] = str(num_nodes), str(node_rank)
        if master_host is not None:
            out[at + 7] = master_host
    return out


def resizable_launch(command: Sequence[str]) -> bool:
    """Whether :func:`resize_pinned` can give ``command`` (as :func:`pin_ranks` left it) another node count: only a
    torchrun-compatible launch line; a job launched otherwise is never run on fewer nodes."""
    return _pinned_at(list(command)) is not None


def _pinned_at(command: list[str]) -> int | None:
    """Where the run of options :func:`pin_ranks` adds begins (``--nnodes N --node-rank R --rdzv-backend static
    --master-addr H``)."""
    for i in range(len(command) - 7):
        if (command[i] == "--nnodes" and command[i + 2] == "--node-rank"
                and command[i + 4:i + 7] == ["--rdzv-backend", "static", "--master-addr"]):
            return i
    return None
