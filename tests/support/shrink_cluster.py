"""The shrink harness (issue 43): 3 real ``rlsup run`` nodes on 127.0.0.1 (and spares), each its own working
directory (:class:`support.cluster.Cluster`), around tests/jobs/world_change_job.py (DDP or FSDP2, 1 rank per node)
under torchrun as users type it (c10d, ``--nnodes 3``; rlsup rewrites it for each attempt), ``--min-nodes 2``.

The job's first attempt holds after its save at step HELD (rank 0 waits; the others wait in the next collective),
so a node is lost at a known point: once that step's parts are on every node and replicated. Also what the nodes
hold (to show nothing was deleted), their logs for assertion messages, and the ranks' id logs per attempt.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Sequence

from rlsup_format.manifest import LocalStep, list_step_dirs, manifest_name, read_manifest, verify_part
from rlsup_format.names import step_dir_name
from support.cluster import HELD_PATIENCE, Cluster, replica_part
from support.env import PY, TRAIN
from support.waits import wait_for
from support.world_phases import JOB

NODES = 3
HELD = 6  # the step the first attempt saves at and holds after: the step the shrunk job continues from
UNTIL = 12  # past two epoch ends (5 steps an epoch), the last one partial
SAVE_AT = (3, HELD, 9)  # 9: the shrunk attempt saves too
GROW_AT = 9  # the shrunk job's save at which a node that came back joins it again
SHRINK = ["--min-nodes", "2", "--spare-takeover-s", "2"]
RENDEZVOUS_S = 12  # how long the nodes left below the floor (or with unresizable saves) wait before the requeue
REQUEUE = 75
CONTINUED = f"continued on 2 of 3 nodes from step {HELD}"
# what a node says when the saves cannot be restored into another world size (one line, said once)
NOT_RESIZABLE = re.compile(r"^.*(cannot be restored|not saved as restorable) into another world size.*$", re.I | re.M)


class ShrinkCluster(Cluster):
    """:class:`Cluster` around world_change_job.py: each node its own checkpoints (``checkpoints``, relative to the
    node's directory, rlsup's default), id logs (``<node dir>/logs``) and ``--out`` (``<node dir>/final.pt``).
    Only the trainer differs from the harness's command, so :meth:`node_args` swaps train_tiny.py's part of it."""

    def __init__(self, root: Path, job_args: Sequence[str] = (), model: str = "ddp", backend: str = "torch",
                 extra: Sequence[str] = (), spares: int = 0, replication_factor: int = 1, **kw: object) -> None:
        options = ["--spares", str(spares)] if spares else []
        options += ["--replication-factor", str(replication_factor)] if replication_factor != 1 else []
        self.replication_factor = replication_factor
        super().__init__(root, NODES + spares, extra=[*SHRINK, *HELD_PATIENCE, *options, *extra],  # type: ignore[arg-type]
                         **kw)
        self.release = root / "release-hold"  # the first attempt's rank 0 waits after HELD until it exists
        self.job_args, self.model, self.backend = list(job_args), model, backend

    def launcher(self, node: int) -> list[str]:
        """torchrun as typed for the job's NODES nodes (the spares, past them, hold no ranks until they take one)."""
        return [PY, "-m", "torch.distributed.run", "--nnodes", str(NODES), "--nproc-per-node", "1", "--rdzv-backend",
                "c10d", "--rdzv-endpoint", f"{self.hosts[0]}:{self.master_port}", "--rdzv-id", "job1"]

    def node_args(self, node: int, extra: Sequence[str] = ()) -> list[str]:
        args = super().node_args(node, extra)
        d = self.node_dir(node)
        return [*args[:args.index(TRAIN)], JOB, "--model", self.model, "--backend", self.backend, "--checkpoint-dir",
                "checkpoints", "--until", str(UNTIL), "--save-at", ",".join(map(str, SAVE_AT)), "--log-dir",
                str(d / "logs"), "--tag", "a", "--attempt-tag", "--hold-at", str(HELD), "--hold-file",
                str(self.release), *self.job_args, "--out", str(d / "final.pt")]


def held_step_everywhere(cluster: ShrinkCluster) -> bool:
    """Every node holds its own part of HELD (rank = node) and its replica targets (the next ``replication_factor``
    nodes in the ring) hold a copy."""
    return all((cluster.node_dir(n) / "checkpoints" / step_dir_name(HELD) / manifest_name(n)).exists()
               and all((replica_part(cluster, (n + k) % NODES, n, HELD) / manifest_name(n)).exists()
                       for k in range(1, cluster.replication_factor + 1))
               for n in range(NODES))


def run_until_held(cluster: ShrinkCluster) -> None:
    """Start every node and wait until HELD is saved and replicated everywhere, the job holding after it."""
    cluster.start_all()
    wait_for(lambda: held_step_everywhere(cluster), 180, f"step {HELD} saved on every node and replicated")
    wait_for(lambda: f"HOLDING after step {HELD}" in cluster.log(0), 30, "rank 0 holding")
    newer = [s for n in range(NODES) for s, _ in list_step_dirs(cluster.node_dir(n) / "checkpoints") if s > HELD]
    assert not newer, f"the job saved past the held step: {newer}"


def lose(cluster: ShrinkCluster, nodes: Sequence[int]) -> float:
    """Lose ``nodes`` (SIGKILL, disk gone, never back), then release the held rank 0 (the job goes on into a
    collective with the lost ranks, as a running job would). Returns when they were lost (monotonic)."""
    for node in nodes:
        cluster.lose(node)
    lost_at = time.monotonic()
    cluster.release.touch()
    return lost_at


def parts(node_dir: Path) -> dict[tuple[str, int, int], bytes]:
    """{(where, step, rank): manifest bytes} of every part a node holds, its own and its replicas."""
    places = [node_dir / "checkpoints", *sorted(p for p in (node_dir / "replicas").glob("*.node*") if p.is_dir() and not p.name.startswith("."))]
    out = {}
    for place in places:
        for step, d in list_step_dirs(place):
            for m in d.glob("manifest.rank_*.json"):
                out[(place.name, step, read_manifest(m).rank)] = m.read_bytes()
    return out


def assert_parts_untouched(node_dir: Path, before: dict[tuple[str, int, int], bytes]) -> None:
    """Every part present before is still there, with the same manifest, and verifies (nothing was deleted)."""
    assert before, "no parts before the loss"
    after = parts(node_dir)
    assert set(before) <= set(after), f"parts gone: {sorted(set(before) - set(after))}"
    for (where, step, rank), manifest in before.items():
        assert after[(where, step, rank)] == manifest, f"{where} step {step} rank {rank}: manifest changed"
        place = node_dir / "checkpoints" if where == "checkpoints" else node_dir / "replicas" / where
        m, why = verify_part(LocalStep(place / step_dir_name(step)), step, rank)
        assert m is not None, f"{where} step {step} rank {rank}: {why}"


def node_logs(cluster: ShrinkCluster, lines: int = 60) -> str:
    """The last ``lines`` lines of every node's rlsup output, a lost node's too, without torch's C++ stack frames
    (for assertion messages: what each node said about the loss)."""
    out = []
    for n in range(cluster.nodes):
        for d in (cluster.node_dir(n), cluster.root / f"node{n}.lost"):
            path = d / cluster.log_name
            if path.exists():
                kept = [line for line in path.read_text(errors="replace").splitlines()
                        if not line.startswith(("frame #", "<omitting", "Exception raised from"))]
                out.append(f"--- {d.name} ---\n" + "\n".join(kept[-lines:]))
    return "\n".join(out)


def id_logs(cluster: ShrinkCluster) -> dict[int, list[Path]]:
    """{attempt: its ranks' id logs, from every node's directory (a lost node's too)} over the attempts that took
    a step (an attempt that ended before its first step may leave an empty log)."""
    return id_logs_in([cluster.node_dir(n) for n in range(NODES)] + [cluster.root / f"node{n}.lost" for n in range(NODES)])


def id_logs_in(dirs: Sequence[Path]) -> dict[int, list[Path]]:
    """{attempt: the ranks' id logs under ``<dir>/logs`` of each of ``dirs``} over the attempts that took a step."""
    out: dict[int, list[Path]] = {}
    for d in dirs:
        for path in (d / "logs").glob("ids.a.attempt*.rank*"):
            m = re.fullmatch(r"ids\.a\.attempt(\d+)\.rank(\d+)", path.name)
            assert m, path
            if path.read_text().strip():
                out.setdefault(int(m.group(1)), []).append(path)
    return {a: sorted(files, key=lambda p: p.name) for a, files in sorted(out.items())}
