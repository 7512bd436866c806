"""Shrink (issue 43): a job of 3 nodes that loses one, with no spare left, goes on with the 2 it has when
``min_nodes`` allows it and its saves are resizable. Real rlsup, 3 node supervisors on 127.0.0.1, each its own
working directory (:class:`support.cluster.Cluster`), around tests/jobs/world_change_job.py (DDP, torch backend,
1 rank per node) under torchrun as users type it (c10d, ``--nnodes 3``; rlsup rewrites it for each attempt).

The job's first attempt holds after its save at step HELD (rank 0 waits; the others wait in the next collective),
so node 2 is lost at a known point: once that step's parts are on every node and replicated.

- Resizable saves, ``--min-nodes 2``: nodes 0 and 1 end 0, saying they continued on 2 of 3 nodes from HELD; the
  final weights equal a run without rlsup (3 ranks to HELD, then 2 ranks from that save) bit for bit, and over the
  kept steps (the first attempt's up to HELD, the shrunk attempt's after it; what the killed attempt took after
  HELD is redone) every rank's sample ids are every sample of each epoch once, in its order.
- Below the floor (nodes 1 and 2 lost): node 0 waits ``rendezvous_timeout`` and exits 75 for a requeue, its
  checkpoints and replicas untouched.
- Saves never marked resizable: nodes 0 and 1 never continue on 2 nodes; node 0 (which plans the rounds) says once
  that the checkpoints cannot be restored into another world size, and both exit 75 after ``rendezvous_timeout``.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Sequence

import pytest

from rlsup_format.manifest import LocalStep, list_step_dirs, manifest_name, read_manifest, verify_part
from rlsup_format.names import step_dir_name
from support.cluster import HELD_PATIENCE, Cluster, replica_part
from support.env import PY, TRAIN
from support.incidents import incidents
from support.spares_cluster import took_rank
from support.waits import wait_for
from support.world_phases import JOB, Phase, check_data_order, consumed, consumed_from, run_chain, same_state

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
                 extra: Sequence[str] = (), spares: int = 0, **kw: object) -> None:
        spare_args = ["--spares", str(spares)] if spares else []
        super().__init__(root, NODES + spares, extra=[*SHRINK, *HELD_PATIENCE, *spare_args, *extra],  # type: ignore[arg-type]
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
    """Every node holds its own part of HELD (rank = node) and the next node in the ring holds a replica."""
    return all((cluster.node_dir(n) / "checkpoints" / step_dir_name(HELD) / manifest_name(n)).exists()
               and (replica_part(cluster, (n + 1) % NODES, n, HELD) / manifest_name(n)).exists()
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
    dirs = [cluster.node_dir(n) for n in range(NODES)] + [cluster.root / f"node{n}.lost" for n in range(NODES)]
    out: dict[int, list[Path]] = {}
    for d in dirs:
        for path in (d / "logs").glob("ids.a.attempt*.rank*"):
            m = re.fullmatch(r"ids\.a\.attempt(\d+)\.rank(\d+)", path.name)
            assert m, path
            if path.read_text().strip():
                out.setdefault(int(m.group(1)), []).append(path)
    return {a: sorted(files, key=lambda p: p.name) for a, files in sorted(out.items())}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("model, backend, extra", [
    ("ddp", "torch", []),
    # dcp reshards: every node reads every part, so each part needs a replica on a node left (factor 2 of 3)
    ("fsdp", "dcp", ["--replication-factor", "2"]),
])
def test_a_lost_node_without_spare_shrinks_the_job_exactly(workdir: Path, model: str, backend: str,
                                                           extra: list[str]) -> None:
    cluster = ShrinkCluster(workdir, model=model, backend=backend, extra=extra)
    try:
        run_until_held(cluster)
        lose(cluster, [2])
        codes = cluster.wait_all(timeout=180)
    finally:
        cluster.kill_all()
    assert codes[0] == 0 and codes[1] == 0, (codes, node_logs(cluster))
    for node in (0, 1):
        assert CONTINUED in cluster.log(node), (node, node_logs(cluster))
    assert f"WORLD_CHANGE {HELD} 3 2" in cluster.log(0), node_logs(cluster)
    for node in (0, 1):  # the failure's incident says what the job went on with; state.json its size now
        assert [i.get("world") for i in incidents(cluster.node_dir(node) / ".rlsup")] == [CONTINUED], node
        assert (cluster.state(node)["world_nodes"], cluster.state(node)["job_nodes"]) == (2, 3)
    manifests = [read_manifest(cluster.node_dir(n) / "checkpoints" / step_dir_name(HELD) / manifest_name(n))
                 for n in (0, 1)]
    assert all(m.world_size == 3 and m.resizable for m in manifests), manifests

    # The same job without rlsup: 3 ranks to HELD, then 2 ranks from that save to the end.
    reference = (Phase(3, HELD, tuple(s for s in SAVE_AT if s <= HELD), range(1, HELD + 1)),
                 Phase(2, UNTIL, tuple(s for s in SAVE_AT if s > HELD), range(HELD + 1, UNTIL + 1)))
    run_chain(workdir / "reference", reference, model, backend)
    assert same_state(cluster.node_dir(0) / "final.pt", workdir / "reference" / "final.pt") == []
    check_data_order(consumed(workdir / "reference", reference), UNTIL)

    # The ids the ranks consumed: the first attempt's up to HELD (what it took after HELD died with it and was
    # redone), then the shrunk attempt's, every sample of each epoch once.
    logs = id_logs(cluster)
    attempts = list(logs)
    assert len(attempts) == 2 and attempts[0] == 0, {a: [str(p) for p in f] for a, f in logs.items()}
    shrunk = logs[attempts[1]]
    assert min(int(line.split()[0]) for p in shrunk for line in p.read_text().splitlines()) == HELD + 1, shrunk
    check_data_order(consumed_from([logs[0], shrunk], reference), UNTIL)


@pytest.mark.timeout(300)
def test_below_the_floor_the_node_left_requeues_and_deletes_nothing(workdir: Path) -> None:
    cluster = ShrinkCluster(workdir, rendezvous_timeout=RENDEZVOUS_S)
    try:
        run_until_held(cluster)
        before = parts(cluster.node_dir(0))
        lost_at = lose(cluster, [1, 2])
        codes = cluster.wait_all(timeout=RENDEZVOUS_S + 120)
        waited = time.monotonic() - lost_at
    finally:
        cluster.kill_all()
    assert codes[0] == REQUEUE, (codes, node_logs(cluster))
    assert waited >= RENDEZVOUS_S - 1, f"node 0 gave up {waited:.1f}s after the loss: {node_logs(cluster)}"
    assert "continued on" not in cluster.log(0), node_logs(cluster)
    assert_parts_untouched(cluster.node_dir(0), before)


@pytest.mark.timeout(300)
def test_saves_never_marked_resizable_are_never_shrunk(workdir: Path) -> None:
    cluster = ShrinkCluster(workdir, job_args=["--not-resizable"], rendezvous_timeout=RENDEZVOUS_S)
    try:
        run_until_held(cluster)
        before = {n: parts(cluster.node_dir(n)) for n in (0, 1)}
        lost_at = lose(cluster, [2])
        codes = cluster.wait_all(timeout=RENDEZVOUS_S + 120)
        waited = time.monotonic() - lost_at
    finally:
        cluster.kill_all()
    manifest = read_manifest(cluster.node_dir(0) / "checkpoints" / step_dir_name(HELD) / manifest_name(0))
    assert manifest.world_size == 3 and not manifest.resizable, manifest
    assert codes[0] == REQUEUE and codes[1] == REQUEUE, (codes, node_logs(cluster))
    assert waited >= RENDEZVOUS_S - 1, f"the nodes gave up {waited:.1f}s after the loss: {node_logs(cluster)}"
    said = {node: len(NOT_RESIZABLE.findall(cluster.log(node))) for node in (0, 1)}
    assert said[0] == 1 and said[1] <= 1, (said, node_logs(cluster))  # node 0 plans the rounds: it knows why
    for node in (0, 1):
        log = cluster.log(node)
        assert "continued on" not in log and "WORLD_CHANGE" not in log, (node, node_logs(cluster))
        assert_parts_untouched(cluster.node_dir(node), before[node])
    assert list(id_logs(cluster)) == [0], "an attempt after the loss took a step"


@pytest.mark.timeout(400)
def test_a_lost_node_back_grows_the_job_at_its_next_save(workdir: Path) -> None:
    """Node 2 lost at HELD, the job goes on with 2 nodes and holds after its first step; node 2 comes back with an
    empty disk and waits (its return does not end the running attempt); the job, released, saves at GROW_AT and the
    next round grows it back to 3 nodes from there. The final weights equal a run without rlsup with the same shrink
    and grow points (3 ranks to HELD, 2 ranks to GROW_AT, 3 ranks to the end), and the ids of the kept steps are
    every sample of each epoch once."""
    released = workdir / "release-shrunk"
    # the shrunk job also holds after its save at GROW_AT (for good: the lead ends that attempt to grow), so it cannot
    # finish before the lead's look (a second here; this job's steps take milliseconds)
    cluster = ShrinkCluster(workdir, job_args=["--hold-in", f"2:{HELD + 1}:{released}", "--hold-in",
                                               f"2:{GROW_AT}:{workdir / 'never'}"])
    try:
        run_until_held(cluster)
        lose(cluster, [2])
        wait_for(lambda: f"HOLDING in world 2 after step {HELD + 1}" in cluster.log(0), 180, "the shrunk job holding")
        cluster.start(2)  # back, its disk empty
        wait_for(lambda: "waiting for its next save to grow back" in cluster.log(2), 120, "node 2 waiting to grow")
        wait_for(lambda: "node(s) [2] back" in cluster.log(0), 30, "the lead to see node 2 back")
        assert all("grew back" not in cluster.log(n) for n in range(NODES)), node_logs(cluster)
        released.touch()
        codes = cluster.wait_all(timeout=240)
    finally:
        cluster.kill_all()
    assert codes == {0: 0, 1: 0, 2: 0}, (codes, node_logs(cluster))
    assert CONTINUED in cluster.log(0), node_logs(cluster)
    for node in range(NODES):
        assert f"grew back to 3 at step {GROW_AT}" in cluster.log(node), (node, node_logs(cluster))
    assert [i.get("world") for i in incidents(cluster.node_dir(0) / ".rlsup")] == [CONTINUED,
                                                                                   f"grew back to 3 at step {GROW_AT}"]
    assert cluster.state(0)["world_nodes"] == 3
    reference = (Phase(3, HELD, tuple(s for s in SAVE_AT if s <= HELD), range(1, HELD + 1)),
                 Phase(2, GROW_AT, (GROW_AT,), range(HELD + 1, GROW_AT + 1)),
                 Phase(3, UNTIL, (), range(GROW_AT + 1, UNTIL + 1)))
    run_chain(workdir / "reference", reference, "ddp", "torch")
    assert same_state(cluster.node_dir(0) / "final.pt", workdir / "reference" / "final.pt") == []
    logs = id_logs(cluster)
    assert len(logs) == 3, {a: [str(p) for p in f] for a, f in logs.items()}
    check_data_order(consumed_from(list(logs.values()), reference), UNTIL)


@pytest.mark.timeout(300)
def test_a_spare_takes_the_lost_rank_first_and_the_job_never_shrinks(workdir: Path) -> None:
    """3 nodes and a spare, ``min_nodes`` 2: node 2 lost at HELD, the spare takes its rank; the job goes on with 3
    nodes (nothing says it continued on fewer) and ends with the weights of a run that kept 3 ranks throughout."""
    cluster = ShrinkCluster(workdir, spares=1)
    try:
        run_until_held(cluster)
        lose(cluster, [2])
        codes = cluster.wait_all(timeout=180)
    finally:
        cluster.kill_all()
    assert codes[0] == 0 and codes[1] == 0 and codes[3] == 0, (codes, node_logs(cluster))
    assert took_rank(cluster.log(3)) == 2, node_logs(cluster)
    assert all("continued on" not in cluster.log(n) for n in (0, 1, 3)), node_logs(cluster)
    reference = (Phase(3, HELD, tuple(s for s in SAVE_AT if s <= HELD), range(1, HELD + 1)),
                 Phase(3, UNTIL, tuple(s for s in SAVE_AT if s > HELD), range(HELD + 1, UNTIL + 1)))
    run_chain(workdir / "reference", reference, "ddp", "torch")
    assert same_state(cluster.node_dir(0) / "final.pt", workdir / "reference" / "final.pt") == []

