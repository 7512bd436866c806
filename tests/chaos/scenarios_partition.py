"""Network partitions of a 3-node ``rlsup run`` job: each node in its own network namespace (support.partition),
the job launched as users type it (torchrun c10d, which rlsup pins to its node ranks), the nodes agreeing
through the embedded store (hosted by node 0) or a 3-member etcd cluster whose members sit in the nodes'
namespaces (member i with node i, so a cut node takes its member with it).

One scenario, :func:`partition_scenario`, driven by a :class:`PartitionPlan`: which nodes are cut, which way
(both, or only what they send), and when: while the job trains (step 6 replicated), or during the round
between two attempts (node 1's rank crashes after step 7; the cut lands as node 0 ends that attempt). While
the cut holds, the test polls every node's newest checkpoint step (nobody may train); the links are healed
once every node on the other side has failed the attempt (``attempt N failed`` in its log, within the
rendezvous timeout) and a few seconds more, so the heal meets them waiting in the next round.

Checked every time (each a number in :class:`PartitionReport`, RELIABILITY.md's figures):
- the job ends 0 on every node with the uninterrupted run's weights, bit for bit;
- divergent resume steps: attempts whose launch step differs between nodes, or that some node never launched
  (a split: two groups resuming from different steps, or one training without the others): 0;
- foreign resumes: a launch from a step whose part does not verify on the launching node, or a trainer that
  loaded another step than rlsup announced: 0;
- valid steps lost: steps between the newest step complete on every node when the cut came and the first
  resume after it: 0; and no node saved a step past the one in flight while cut (a minority never trains).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Literal

from rlsup_format.manifest import list_step_dirs
from support.cluster import Cluster, rlsup_resumes, trainer_starts
from support.partition import Direction, Partition, why_unavailable
from support.waits import Deadline, wait_for

from .common import Sandbox, reference_weights, same_weights, sandbox_env
from .scenarios import ScenarioResult

NODES = 3
EVERY = 3
TRAIN = ["--steps", "30", "--checkpoint-every", str(EVERY), "--step-time", "0.2", "--keep-last", "100"]
CRASH = ["--crash-at-step", "7", "--fault-rank", "1"]  # the "round" plan: node 1's rank dies, a round follows
HEARTBEAT_S = 8  # a rank stuck in a collective with a cut peer is a hang after this long
RENDEZVOUS_S = 180  # every wait of a round; the cut heals well before it (node 0 cut off: the others fail it in ~110 s)
SHORT_RENDEZVOUS_S = 40  # a cut that never heals: the nodes give up after this
STOPPED = re.compile(r"timed out after \d+s waiting for|stayed unreachable for \d+s")
SETTLE_S = 4.0  # after the far side failed the attempt: the heal then meets it waiting in the next round
ROUND_HOLD_S = 10.0  # a cut during a round holds this long: the others wait for the cut node in it
FAILED = re.compile(r"\[rlsup\] attempt (\d+) failed")
LAUNCH = re.compile(r"\[rlsup\] attempt (\d+): launching[^\n]*?(?: from step (\d+) |$)", re.M)


@dataclass
class PartitionPlan:
    """What to cut, which way, when, and how the nodes agree."""

    name: str
    cut: tuple[int, ...]
    direction: Direction = "both"
    during: Literal["training", "round"] = "training"
    backend: Literal["embedded", "etcd"] = "embedded"
    heal: bool = True  # False: the cut outlasts the rendezvous timeout; every node must stop, named, losing nothing
    # rlsup's max_restarts (None: its default). The failures the plan causes, when known: the attempt after the last
    # one then arms no warm launcher, which nothing would use (a torchrun and a warm rank per node).
    max_restarts: int | None = None


@dataclass
class PartitionReport:
    """The numbers one run gives RELIABILITY.md."""

    cut_at_step: int = -1  # newest step complete on every node when the links were cut
    fail_s: float = -1.0  # cut -> every node of the far side failed the attempt
    held_s: float = 0.0  # how long the cut held
    trained_while_cut: int = 0  # newest step saved anywhere while cut, past the one in flight (0: nobody trained)
    divergent_resumes: int = 0
    foreign_resumes: int = 0
    steps_lost: int = 0
    resumes: dict[int, list[int | None]] = field(default_factory=dict)  # node -> launch steps, attempt by attempt

    def line(self) -> str:
        return (f"cut at step {self.cut_at_step}, failed by the others in {self.fail_s:.1f}s, held {self.held_s:.1f}s, "
                f"trained while cut {self.trained_while_cut}, divergent resumes {self.divergent_resumes}, foreign "
                f"resumes {self.foreign_resumes}, steps lost {self.steps_lost}, resumes {self.resumes}")


def own_steps(cluster: Cluster, node: int) -> set[int]:
    """Steps whose part of rank ``node`` (one rank per node) verifies in the node's own checkpoint dir."""
    from supervisor.tiers.parts import verify_part

    return {s for s, d in list_step_dirs(cluster.node_dir(node) / "checkpoints") if verify_part(d, node, full=True)}


def newest_any(cluster: Cluster) -> int:
    """The newest step directory any node's trainer wrote (valid or not: a minority's save counts too)."""
    return max([s for n in range(cluster.nodes) for s, _ in list_step_dirs(cluster.node_dir(n) / "checkpoints")]
               or [-1])


def launches(log: str) -> dict[int, int | None]:
    """attempt -> the step it was launched from (None: fresh), as the node's rlsup said."""
    return {int(m.group(1)): int(m.group(2)) if m.group(2) else None for m in LAUNCH.finditer(log)}


def failed_attempts(log: str) -> set[int]:
    return {int(a) for a in FAILED.findall(log)}


def check_resumes(cluster: Cluster, report: PartitionReport, first_after_cut: int) -> list[str]:
    """Divergent and foreign resumes, and steps lost, from every node's log and disk."""
    problems: list[str] = []
    per_node = [launches(cluster.log(n)) for n in range(cluster.nodes)]
    report.resumes = {n: [per_node[n][a] for a in sorted(per_node[n])] for n in range(cluster.nodes)}
    for attempt in sorted(set().union(*per_node)):
        steps = {n: launches_n.get(attempt, "not launched") for n, launches_n in enumerate(per_node)}
        if len(set(steps.values())) > 1:
            report.divergent_resumes += 1
            problems.append(f"attempt {attempt} launched from different steps (a split): {steps}")
    for n in range(cluster.nodes):
        valid = own_steps(cluster, n)
        for attempt, step in per_node[n].items():
            if step is not None and step not in valid:
                report.foreign_resumes += 1
                problems.append(f"node {n} launched attempt {attempt} from step {step}, whose part does not verify")
    starts = trainer_starts(cluster.log(0))
    if starts != [r or 0 for r in rlsup_resumes(cluster.log(0))]:
        report.foreign_resumes += 1
        problems.append(f"rank 0 loaded {starts}, rlsup announced {rlsup_resumes(cluster.log(0))}")
    after = [s or 0 for a, s in per_node[0].items() if a >= first_after_cut]
    if not after:
        problems.append(f"no attempt launched after the cut (attempt {first_after_cut} on)")
    elif after[0] < report.cut_at_step:
        report.steps_lost = report.cut_at_step - after[0]
        problems.append(f"resumed from step {after[0]} after the cut, older than step {report.cut_at_step} "
                        f"complete on every node when it came")
    return problems


def check_named_stop(cluster: Cluster, net: Partition, report: PartitionReport) -> list[str]:
    """A cut that outlasts the rendezvous timeout: every node stops (non-zero, the log naming what it waited
    for), nothing of the cut step is lost, and the same command run again once healed finishes the job."""
    codes = cluster.wait_all(timeout=SHORT_RENDEZVOUS_S + 120)
    problems = [f"node {n} did not stop on its own (exit codes {codes})" for n, c in codes.items() if c in (0, -999)]
    problems += [f"node {n} stopped without naming the wait it gave up" for n in range(cluster.nodes)
                 if not STOPPED.search(cluster.log(n))]
    problems += [f"node {n} lost its part of step {report.cut_at_step}, complete when the cut came"
                 for n in range(cluster.nodes) if report.cut_at_step not in own_steps(cluster, n)]
    net.heal()
    cluster.start_all()  # the same command, as a requeue runs it
    return problems


def hold_cut(cluster: Cluster, report: PartitionReport, until: Callable[[], bool], timeout: float, what: str) -> None:
    """Keep the cut until ``until()`` (raises Deadline after ``timeout``), polling that nobody trains: no step
    past the one in flight when the cut came appears on any node."""
    def poll() -> bool:
        report.trained_while_cut = max(report.trained_while_cut, newest_any(cluster) - report.cut_at_step - EVERY, 0)
        return until()
    wait_for(poll, timeout, what, interval=0.2)


def partition_scenario(parent: Path, ref_cache: Path, plan: PartitionPlan) -> tuple[ScenarioResult, PartitionReport]:
    """Run the job, cut the plan's links at the plan's moment, heal them once the far side failed the attempt,
    and check the job's end and every invariant."""
    started = time.monotonic()
    res, report = ScenarioResult(f"partition_{plan.name}", 0), PartitionReport()
    why = why_unavailable()
    if why:
        res.problems.append(f"SKIP: {why}")
        return res, report
    sb = Sandbox(parent)
    train = TRAIN + (CRASH if plan.during == "round" else [])
    ref = reference_weights(ref_cache, NODES, TRAIN)
    far = [n for n in range(NODES) if n not in plan.cut]
    with Partition(NODES) as net:
        etcd = None
        extra = ["--heartbeat-timeout", str(HEARTBEAT_S)]
        if plan.max_restarts is not None:
            extra += ["--max-restarts", str(plan.max_restarts)]
        if plan.backend == "etcd":
            from etcd_cluster import EtcdCluster, etcd_binary

            if etcd_binary() is None:
                res.problems.append("SKIP: etcd is not installed (Debian: etcd-server; scripts/install_system_deps.sh)")
                return res, report
            etcd = EtcdCluster(sb.run / "etcd", NODES, hosts=net.addrs, wrap=net.wrap).start()
            extra += ["--coordinator-backend", "etcd", "--coordinator-endpoints", ",".join(etcd.endpoints)]
        cluster = Cluster(sb.run, NODES, "c10d", extra, train, hosts=net.addrs, wrap=net.wrap,
                          rendezvous_timeout=RENDEZVOUS_S if plan.heal else SHORT_RENDEZVOUS_S,
                          env=sandbox_env(sb, GLOO_SOCKET_IFNAME="eth0"),
                          warm_launcher=True)  # the chaos runs keep rlsup's defaults: the faults users meet
        try:
            cluster.start_all()
            res.check(run_partition(cluster, net, plan, report, far))
            if not plan.heal:
                res.check(check_named_stop(cluster, net, report))
            codes = cluster.wait_all(timeout=240)
            res.check([] if codes == {n: 0 for n in range(NODES)} else [f"exit codes {codes}"])
            why_not = same_weights(cluster.node_dir(0) / cluster.out_name, ref)  # rank 0 writes the weights
            res.check([f"final weights: {why_not}"] if why_not else [])
            res.check(check_resumes(cluster, report, first_after_cut=1))
        except Deadline as e:
            res.problems.append(str(e))
        finally:
            cluster.kill_all()
            if etcd is not None:
                etcd.stop()
            res.log = cluster.logs(6000)
    res.restarts = max((len(v) for v in report.resumes.values()), default=1) - 1
    res.seconds = time.monotonic() - started
    return res, report


def run_partition(cluster: Cluster, net: Partition, plan: PartitionPlan, report: PartitionReport,
                  far: list[int]) -> list[str]:
    """Cut at the plan's moment, hold until the far side failed the attempt, heal."""
    problems: list[str] = []
    if plan.during == "training":
        wait_for(lambda: all(6 in own_steps(cluster, n) for n in range(NODES)), 180, "step 6 saved on every node")
    else:
        wait_for(lambda: 0 in failed_attempts(cluster.log(0)), 180, "node 0 to fail attempt 0 (node 1's crash)")
        if any(1 in launches(cluster.log(n)) for n in range(NODES)):
            problems.append("the round of attempt 1 was over before the cut (the cut missed it)")
    report.cut_at_step = max(set.intersection(*(own_steps(cluster, n) for n in range(NODES))), default=-1)
    attempt = 0
    net.cut(plan.cut, plan.direction)
    cut_at = time.monotonic()
    if plan.during == "training":
        hold_cut(cluster, report, lambda: all(attempt in failed_attempts(cluster.log(n)) for n in far),
                 RENDEZVOUS_S, f"nodes {far} to fail attempt {attempt} with nodes {list(plan.cut)} cut off")
        report.fail_s = time.monotonic() - cut_at
    hold = SETTLE_S if plan.during == "training" else ROUND_HOLD_S
    settle = time.monotonic() + hold
    hold_cut(cluster, report, lambda: time.monotonic() > settle, hold + 5, "the cut's hold")
    if any(1 in launches(cluster.log(n)) for n in range(NODES)):
        problems.append("an attempt launched while the cut held: "
                        f"{[sorted(launches(cluster.log(n))) for n in range(NODES)]}")
    report.held_s = time.monotonic() - cut_at
    if plan.heal:
        net.heal()
    if report.trained_while_cut:
        problems.append(f"a step {report.trained_while_cut} past the one in flight was saved while cut")
    return problems
