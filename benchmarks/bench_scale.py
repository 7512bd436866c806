"""Coordination at scale (issue 14): N simulated node supervisors agreeing on 127.0.0.1.

    .venv/bin/python benchmarks/bench_scale.py             # full: N = 8, 32, 64, 128, 5 rounds; bytes to 32
    .venv/bin/python benchmarks/bench_scale.py --quick     # < 2 min: 3 rounds; bytes at 4, 8, 16 nodes
    .venv/bin/python benchmarks/bench_scale.py --only agreement --sizes 64,128 --backends embedded
    .venv/bin/python benchmarks/bench_scale.py --markdown out.md --json out.json

A simulated node is a real node's ``NodeGroup`` (its config, membership, coordinator and the real
round: ``join``; ``agree`` -> publish the inventory, node 0 waits for
every inventory and runs ``compute_plan``, every node fetches and publishes its fetch result, node 0
publishes their union, every node marks ready and waits until node 0 has seen all ready) without a
trainer: nothing is launched once ``agree`` returns.

Figures (``--only`` keys):

* ``agreement``: from the moment every node starts a round (an instant scheduled on CLOCK_MONOTONIC,
  which is system-wide on Linux) to the moment the last node is past ``wait_all_ready``; max over
  nodes, median over rounds. Round 0 (a fresh store: every node proposes, node 0 opens) is a warm-up,
  shown in the note. Each later round follows the loss of one node: node 0 ends the previous round
  before the clock starts, and the lost node's replacement publishes an empty inventory. Every other
  node publishes 8 ranks x 5 steps of its own plus the replicas it holds (replication factor 1), as
  ``ReplicationEngine.inventory()`` returns them; the fetch runs the supervisor's own path
  (``fetch_part``) over in-memory stores whose parts list no files, so it moves no data (``bytes`` does
  it for real). The nodes are threads of ``--procs`` worker processes (default 4; node 0 alone on worker 0, as its
  rlsup is a process of its own, the others round-robin): each process imports torch (~300 MB) for the baseline's TCPStore, and 2 cores gain nothing
  from more. So the embedded store (rlsup's own since issue 42: supervisor/cluster/kv_server.py), hosted
  by node 0 in worker 0, serves real cross-process TCP. Every node's connection to it is made once and
  reused by every size (each size is a job of its own): connecting is not what is measured, and torch's
  TCPStore (the baseline) reverse-resolves each client's address when it accepts it, which this
  machine's resolver sometimes answers after seconds. etcd: a real 3-member
  cluster on 127.0.0.1 (tests/etcd_cluster.py), each node connected as ``rlsup run`` connects it.
  Baseline (embedded rows): a bare TCPStore exchange of the same shape on the same workers and
  connections: each node sets its inventory; node 0 ``wait``s for all, plans, sets the plan; each node
  ``wait``s for it, ``add``s 1 to a ready counter; the last sets ``go``; all ``wait`` for it. The note
  gives the CPU all simulated nodes (and etcd's members) spent per round, the store requests per round,
  and at the largest N, the polls per second the store answered with every node polling at once.
* ``plan``: ``compute_plan`` over 1,024 inventories x 8 ranks x 5 steps (replication factor 1, one node
  lost: its 8 parts come from its replica holder), median of repetitions; and node 0's own work in a
  round of 1,024 and 4,096 nodes (the values it reads verified and parsed, the plan): the part of a
  round that grows with N wherever the nodes run.
* ``bytes``: a restore after one node's loss with real ``ReplicationServer``s and ``ReplicationEngine``s
  (HTTP on 127.0.0.1, real parts on disk, replication factor 1, replicated by ``engine.sync()``), the
  embedded store on node 0, for growing N. Every connection goes through a counting TCP proxy, one per
  (client node, server node) pair and one per node to the store, so the figures are bytes on the wire
  (HTTP headers and framing included), attributed to the node that sent or received them, during the
  restore round only (from the replacement's connection to every node past ``wait_all_ready``).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import multiprocessing as mp
import os
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
for _p in (str(ROOT), str(BENCH), str(ROOT / "tests")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from run import HEADER, Row, markdown_table, print_row  # noqa: E402
from supervisor.config import SupervisorConfig  # noqa: E402
from supervisor.tiers.holdings import NodeInventory, RoundPlan, StepHoldings  # noqa: E402
from supervisor.cluster.coordinator import RoundCoordinator  # noqa: E402
from supervisor.cluster.round_plan import compute_plan  # noqa: E402
from supervisor.job_identity import JobIdentity  # noqa: E402
from supervisor.membership import Membership, replica_targets  # noqa: E402
from supervisor.cluster.job_store import connect_coordinator  # noqa: E402
from supervisor.cluster.node_run import NodeRun  # noqa: E402

SECRET = b"bench-scale-secret-bench-scale-secret"
RANKS = 8  # ranks per node
STEPS = 5  # checkpoint steps each node holds
STEP_EVERY = 100
ROUND_LEAD_S = 0.3  # a round is scheduled this far ahead, so every worker's threads are asleep waiting for it
TIMEOUT_S = 120.0  # rendezvous_timeout of the simulated nodes
FIGURES = ("agreement", "plan", "bytes")


def log(msg: str) -> None:
    print(f"# {msg}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def lost_node(nodes: int) -> int:
    """The node lost before every measured round: one in the middle (node 0 hosts the embedded store)."""
    return nodes // 2


# ------------------------------------------------------------------------------------------ inventories


def holders_of(nodes: int, factor: int = 1) -> dict[int, list[int]]:
    """node -> the owners whose parts it holds as replicas (``replica_targets``, jump 1)."""
    held: dict[int, list[int]] = {n: [] for n in range(nodes)}
    for owner in range(nodes):
        for t in replica_targets(owner, nodes, factor):
            held[t].append(owner)
    return held


def synthetic_inventory(node: int, nodes: int, held: dict[int, list[int]], lost: int | None,
                        ranks: int = RANKS, steps: int = STEPS) -> NodeInventory:
    """What ``ReplicationEngine.inventory()`` returns on ``node``: its own ``ranks`` parts of ``steps``
    steps and the replicas it holds; the lost node's replacement holds nothing."""
    if node == lost:
        return NodeInventory(node)
    out: dict[int, StepHoldings] = {}
    for s in range(1, steps + 1):
        out[s * STEP_EVERY] = StepHoldings(nodes * ranks, {node * ranks + r: node for r in range(ranks)},
                                           {o * ranks + r: o for o in held[node] for r in range(ranks)})
    return NodeInventory(node, out)


def expected_plan(nodes: int, lost: int, ranks: int = RANKS) -> dict[int, dict[int, list[int]]]:
    holder = replica_targets(lost, nodes, 1)
    return {lost: {lost * ranks + r: holder for r in range(ranks)}}


# ------------------------------------------------------------------------------------------ simulated nodes


class StubEngine:
    """A ReplicationEngine stand-in for the agreement figure: a fixed inventory, and parts with no data files.

    The supervisor's restore path runs as it is (``clean``, then ``fetch_part`` from ``peer_store(holder)``
    into ``local_store()`` with ``accept``), over in-memory stores: a holder's part is a manifest listing
    no files, so a fetch reads one manifest and writes one, and moves no data (``bytes`` does that for
    real). ``fetched`` records the (step, rank) parts written."""

    def __init__(self, inventory: NodeInventory, world_size: int) -> None:
        self._inventory = inventory
        self.world_size = world_size
        self.fetched: list[tuple[int, int]] = []

    def inventory(self, known: object = None) -> NodeInventory:
        return self._inventory  # ``known``: digests the real engine reuses; a stub reads nothing

    def peer_store(self, node: int) -> "MemPartStore":
        return MemPartStore(f"node {node}", source_world_size=self.world_size)

    def local_store(self) -> "MemPartStore":
        return MemPartStore("local", on_put=lambda step, rank: self.fetched.append((step, rank)))

    def accept(self, manifest: Any) -> str:
        return ""

    def clean(self) -> None:
        pass


class MemStep:
    """A StepReader over one step of a :class:`MemPartStore`."""

    def __init__(self, store: "MemPartStore", step: int) -> None:
        self.store, self.step = store, step

    def names(self) -> list[str]:
        from rlsup_format.manifest import manifest_name

        if self.store.source_world_size:
            return [manifest_name(r) for r in range(self.store.source_world_size)]
        names = [manifest_name(r) for s, r in self.store.manifests if s == self.step]
        if not names:
            raise FileNotFoundError(f"{self.store.location}: no step {self.step}")
        return sorted(names)

    def read(self, name: str) -> bytes:
        from rlsup_format.manifest import SCHEMA_VERSION, RankManifest
        from rlsup_format.names import parse_manifest_rank

        rank = parse_manifest_rank(name)
        if rank is None:
            raise FileNotFoundError(name)
        if self.store.source_world_size:  # a holder: every rank's part of every step, no data files
            return RankManifest(SCHEMA_VERSION, self.step, self.store.source_world_size, rank, "torch", {},
                                0.0).to_json().encode()
        try:
            return self.store.manifests[(self.step, rank)]
        except KeyError:
            raise FileNotFoundError(name) from None

    def check(self, name: str, entry: Any, full: bool) -> str:
        return f"{name}: missing"  # no data files anywhere


class MemPartStore:
    """An in-memory PartStore for :class:`StubEngine`: a holder (``source_world_size``: it has every part)
    or an empty destination that keeps the manifests written to it."""

    def __init__(self, location: str, source_world_size: int = 0,
                 on_put: Callable[[int, int], None] | None = None) -> None:
        self.location = location
        self.source_world_size = source_world_size
        self.on_put = on_put
        self.manifests: dict[tuple[int, int], bytes] = {}

    def steps(self) -> list[int]:
        return sorted({s for s, _ in self.manifests})

    def reader(self, step: int) -> MemStep:
        return MemStep(self, step)

    def open(self, step: int, name: str) -> Any:
        raise FileNotFoundError(name)

    def put_file(self, step: int, name: str, src: Any, entry: Any) -> None:
        raise AssertionError("stub parts have no data files")

    def put_manifest(self, step: int, rank: int, raw: bytes) -> None:
        self.manifests[(step, rank)] = raw
        if self.on_put is not None:
            self.on_put(step, rank)

    def remove_manifest(self, step: int, rank: int) -> None:
        self.manifests.pop((step, rank), None)

    def delete(self, step: int) -> None:
        for key in [k for k in self.manifests if k[0] == step]:
            del self.manifests[key]

    def clean(self) -> None:
        pass

    def hold(self, step: int) -> Any:
        import contextlib

        return contextlib.nullcontext()


class PlanTap:
    """A node's coordinator that keeps each plan the node reads (what the benchmark reports); the rest is the
    coordinator's own."""

    def __init__(self, coordinator: RoundCoordinator, plans: list[str]) -> None:
        self.coordinator, self.plans = coordinator, plans

    def plan(self, attempt: int, plan_try: int = 0) -> RoundPlan:
        plan = self.coordinator.plan(attempt, plan_try)
        self.plans.append(plan.to_json())
        return plan

    def __getattr__(self, name: str) -> Any:
        return getattr(self.coordinator, name)


class SimNode:
    """A node without a trainer: the real join and agreement of a node's run (its NodeGroup), no run loop."""

    def __init__(self, cfg: SupervisorConfig, command: list[str], membership: Membership, engine: Any, *,
                 job: JobIdentity, coordinator: RoundCoordinator) -> None:
        self.cfg, self.coordinator = cfg, coordinator
        self.plans: list[str] = []
        run = NodeRun.from_config(cfg, command, membership, engine, job=job, coordinator=coordinator)
        self.group = run.group(PlanTap(coordinator, self.plans))  # type: ignore[arg-type]
        self.attempt: int | None = None

    def round(self) -> tuple[int, Any]:
        """One round: join (the first, or the next after the previous one ended), then agree."""
        attempt = self.group.join(0 if self.attempt is None else self.attempt + 1)
        resume = self.group.agree(attempt, lambda: None)
        self.attempt = attempt
        return attempt, resume


def make_node(work: Path, node: int, nodes: int, backend: str, job: str, port: int, endpoints: list[str],
              engine: Any, peers: list[str] | None = None, store_port: int | None = None,
              store: Any = None) -> SimNode:
    """A simulated node supervisor, connected to the job's coordination store the way ``rlsup run`` does
    (``connect_coordinator``), or through ``store``, an embedded-store connection made earlier.
    ``store_port``: where this node reaches the embedded store (a counting proxy), if not ``port``."""
    base = work / f"node{node}"
    cfg = SupervisorConfig(checkpoint_dir=str(base / "ckpt"), state_dir=str(base / "state"), job_name=job,
                           coordinator_backend=backend, coordinator_endpoints=list(endpoints),
                           coordinator_port=store_port if (store_port and node) else port,
                           rendezvous_timeout=TIMEOUT_S, metrics_port=0, warm_launcher=False)
    membership = Membership(tuple(peers or [f"127.0.0.1:{40000 + n}" for n in range(nodes)]), node)
    identity = JobIdentity(job, "bench_scale")
    if store is None:
        coordinator = connect_coordinator(cfg, membership, identity, SECRET)
    else:
        coordinator = RoundCoordinator(store, identity, SECRET, node, nodes, TIMEOUT_S)
    return SimNode(cfg, ["true"], membership, engine, job=identity, coordinator=coordinator)


class BareNode:
    """The baseline: the same exchange on a bare TCPStore (blocking ``wait``s, a ready counter)."""

    def __init__(self, node: int, nodes: int, store: Any, job: str, inventory: NodeInventory) -> None:
        self.node, self.nodes, self.store, self.job = node, nodes, store, job  # store: a torch TCPStore
        self.inventory = inventory.to_json()
        self.plans: list[str] = []

    def round(self, idx: int) -> tuple[int, Any]:
        p = f"bare/{self.job}/{idx}/"
        self.store.set(f"{p}inv/{self.node}", self.inventory)
        if self.node == 0:
            keys = [f"{p}inv/{n}" for n in range(self.nodes)]
            self.store.wait(keys)
            plan = compute_plan(idx, [NodeInventory.from_json(v, n) for n, v in enumerate(self.store.multi_get(keys))])
            self.store.set(f"{p}plan", plan.to_json())
        self.store.wait([f"{p}plan"])
        self.plans.append(self.store.get(f"{p}plan").decode())
        if self.store.add(f"{p}ready", 1) == self.nodes:
            self.store.set(f"{p}go", "1")
        self.store.wait([f"{p}go"])
        return idx, None


# ------------------------------------------------------------------------------------------ worker processes


def _worker_main(conn: Any, worker: int) -> None:
    """A worker process: simulates the nodes it is given, as threads, one round per command.

    Its connections to the embedded store are made once (``connect``) and reused by every size and by
    the baseline (each size is its own job, so keys never mix): making them is not what is measured,
    and torch's TCPStore reverse-resolves every client's address when it accepts it, which on this
    machine's resolver costs seconds now and then."""
    nodes: dict[int, Any] = {}
    pool: dict[int, Any] = {}  # node -> EmbeddedKVStore (node 0: the host)
    bare: dict[int, Any] = {}  # node -> torch TCPStore (node 0: the host), the baseline's
    work = Path(tempfile.mkdtemp(prefix=f"rlsup-scale-w{worker}-"))
    try:
        while True:
            msg = conn.recv()
            try:
                if msg[0] == "connect":
                    pool, bare = _connect_pool(msg[1], msg[2], msg[3])
                    conn.send(("ok", len(pool)))
                elif msg[0] == "setup":
                    nodes = _setup_nodes(work, msg[1], pool, bare)
                    conn.send(("ok", len(nodes)))
                elif msg[0] == "round":
                    conn.send(("ok", _run_round(nodes, msg[1], msg[2], msg[3])))
                elif msg[0] == "hammer":
                    conn.send(("ok", _hammer(nodes, msg[1], msg[2])))
                elif msg[0] == "teardown":
                    _teardown(nodes)
                    nodes = {}
                    conn.send(("ok", None))
                elif msg[0] == "exit":
                    for n in sorted(pool, reverse=True):
                        pool[n].close()
                    conn.send(("ok", None))
                    return
            except Exception:  # reported to the parent, which fails the figure
                conn.send(("error", traceback.format_exc()))
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _connect_pool(port: int, bare_port: int, mine: list[int]) -> tuple[dict[int, Any], dict[int, Any]]:
    """Each of ``mine``'s connections to the embedded store on ``port`` and to the baseline's TCPStore on
    ``bare_port`` (node 0 hosts both)."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    from supervisor.cluster.kvstore import EmbeddedKVStore

    pool = connect_all(mine, lambda n: EmbeddedKVStore("127.0.0.1", port, SECRET, n == 0, TIMEOUT_S))
    for store in pool.values():
        REQUESTS.attach(store)
    POOL.clear()
    POOL.update(pool)
    bare = connect_all(mine, lambda n: TCPStore("127.0.0.1", bare_port, None, n == 0, timedelta(seconds=TIMEOUT_S),
                                                wait_for_workers=False))
    return pool, bare


def _setup_nodes(work: Path, spec: dict[str, Any], pool: dict[int, Any], bare: dict[int, Any]) -> dict[int, Any]:
    n, lost, backend = spec["nodes"], spec["lost"], spec["backend"]
    held = holders_of(n)

    def one(node: int) -> Any:
        inventory = synthetic_inventory(node, n, held, lost)
        if backend == "bare":
            return BareNode(node, n, bare[node], spec["job"], inventory)
        engine = StubEngine(inventory, n * RANKS)
        if backend == "embedded":
            return make_node(work, node, n, backend, spec["job"], 0, [], engine, store=pool[node])
        sim = make_node(work, node, n, backend, spec["job"], 0, spec["endpoints"], engine)
        REQUESTS.attach(sim.coordinator.store)
        return sim

    return connect_all(spec["ranks"], one)


def connect_all(nodes: list[int], connect: Callable[[int], Any]) -> dict[int, Any]:
    """``connect(node)`` for every node: node 0 first (it hosts the embedded store), the others at once."""
    out: dict[int, Any] = {}
    if 0 in nodes:
        out[0] = connect(0)
    rest = [n for n in nodes if n != 0]
    if rest:
        with concurrent.futures.ThreadPoolExecutor(min(32, len(rest))) as pool:
            out.update(zip(rest, pool.map(connect, rest)))
    return out


class RequestCounter:
    """Counts a store's round trips: wraps ``EmbeddedKVStore._request`` (one per request on the wire; node 0's own
    calls go to its table) or
    ``EtcdKVStore._post`` (one per HTTP request to etcd) of the stores it is given."""

    def __init__(self) -> None:
        self.count = 0
        self.watches = 0  # etcd watch streams opened (each a connection of its own), counted apart
        self._lock = threading.Lock()

    def attach(self, store: Any) -> None:
        if hasattr(store, "wait_for_change") and not hasattr(store, "_request"):
            self._count_watches()
        name = "_request" if hasattr(store, "_request") else "_post"
        inner = getattr(store, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                self.count += 1
            return inner(*args, **kwargs)

        setattr(store, name, counted)

    def _count_watches(self) -> None:
        from supervisor.cluster.etcd_watch import EtcdWatch

        if getattr(EtcdWatch.open, "counted", False):
            return
        inner = EtcdWatch.open

        def counted(watch: Any, *args: Any, **kwargs: Any) -> Any:
            with self._lock:
                self.watches += 1
            return inner(watch, *args, **kwargs)

        counted.counted = True  # type: ignore[attr-defined]
        EtcdWatch.open = counted  # type: ignore[method-assign]

    def take(self) -> int:
        with self._lock:
            n, self.count = self.count, 0
        return n

    def take_watches(self) -> int:
        with self._lock:
            n, self.watches = self.watches, 0
        return n


REQUESTS = RequestCounter()  # this worker's
POOL: dict[int, Any] = {}  # this worker's connections to the embedded store (node -> store), for their CPU


def store_thread_cpu() -> float:
    """CPU seconds this process's embedded store spent answering (the host's, in worker 0), and its TCPStore
    server thread's (torch names it pt_tcpstore_uv: the baseline's, idle while the embedded store is measured)."""
    total = sum(store.served_cpu_s() for store in POOL.values() if hasattr(store, "served_cpu_s"))
    for task in Path("/proc/self/task").iterdir():
        try:
            if (task / "comm").read_text().strip() == "pt_tcpstore_uv":
                fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
                total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError):
            continue
    return total


def _hammer(nodes: dict[int, Any], start_at: float, seconds: float) -> int:
    """Every node polls for a key that never appears (a wait's poll: the keys, and the round's end) as
    fast as it can for ``seconds``: what the store serves when every node waits at once."""
    counts: dict[int, int] = {}

    def one(node: int, sim: SimNode) -> None:
        time.sleep(max(0.0, start_at - time.monotonic()))
        n, deadline = 0, start_at + seconds
        while time.monotonic() < deadline:
            sim.coordinator.keys.poll([f"capacity/{node}"], "capacity/end")
            n += 1
        counts[node] = n

    threads = [threading.Thread(target=one, args=(n, s)) for n, s in nodes.items()]
    store_cpu = store_thread_cpu()
    REQUESTS.take()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"polls": sum(counts.values()), "requests": REQUESTS.take(), "store_cpu": store_thread_cpu() - store_cpu}


def _run_round(nodes: dict[int, Any], idx: int, start_at: float, end_reason: str) -> dict[str, Any]:
    """Every node of this worker starts round ``idx`` at ``start_at`` (CLOCK_MONOTONIC); when each was done,
    this process's CPU time and the store requests its nodes made meanwhile."""
    out: dict[int, dict[str, Any]] = {}

    def one(node: int, sim: Any) -> None:
        try:
            if isinstance(sim, SimNode) and node == 0 and sim.attempt is not None:
                sim.coordinator.end(sim.attempt, end_reason)  # the previous round ends (before the clock starts)
            time.sleep(max(0.0, start_at - time.monotonic()))
            attempt, resume = sim.round(idx) if isinstance(sim, BareNode) else sim.round()
            done = time.monotonic()
            out[node] = {"done": done, "attempt": attempt, "plan": sim.plans[-1] if sim.plans else None,
                         "step": getattr(resume, "step", None)}
        except Exception:
            out[node] = {"error": traceback.format_exc()}

    threads = [threading.Thread(target=one, args=(n, s), name=f"node{n}") for n, s in nodes.items()]
    cpu, store_cpu = time.process_time(), store_thread_cpu()
    REQUESTS.take()
    REQUESTS.take_watches()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"nodes": out, "cpu": time.process_time() - cpu, "requests": REQUESTS.take(),
            "watches": REQUESTS.take_watches(), "store_cpu": store_thread_cpu() - store_cpu}


def _teardown(nodes: dict[int, Any]) -> None:
    for node in sorted(nodes, reverse=True):  # node 0 (the embedded store's host) last
        sim = nodes[node]
        try:
            if isinstance(sim, SimNode) and sim.cfg.coordinator_backend == "etcd":  # embedded: pooled, kept
                if node == 0:
                    sim.coordinator.store.delete_prefix(sim.coordinator.keys.prefix)  # the job's keys go (node 0 led)
                sim.coordinator.store.close()
        except Exception:
            pass


class Workers:
    """``count`` spawned worker processes (each imports torch once, for the TCPStore)."""

    def __init__(self, count: int) -> None:
        ctx = mp.get_context("spawn")
        self.conns = []
        self.procs = []
        for w in range(count):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker_main, args=(child, w), name=f"scale-worker{w}", daemon=True)
            p.start()
            self.conns.append(parent)
            self.procs.append(p)

    def __len__(self) -> int:
        return len(self.conns)

    def assign(self, nodes: int) -> dict[int, list[int]]:
        """Which worker simulates which nodes: node 0 (the embedded store's host) alone on worker 0, as its rlsup
        is a process of its own on a cluster (the store's server shares its interpreter with node 0 only), the
        others round-robin over the other workers."""
        others = max(1, len(self) - 1)
        out = {0: [0]}
        for n in range(1, nodes):
            out.setdefault(1 + (n - 1) % others, []).append(n)
        return out

    def connect(self, nodes: int) -> None:
        """Every node's connection to one embedded store (node 0 hosts it), made once for every size."""
        port, bare_port = free_port(), free_port()
        while bare_port == port:
            bare_port = free_port()
        blocks = self.assign(nodes)
        self.call({0: ("connect", port, bare_port, blocks[0])})
        self.call({w: ("connect", port, bare_port, mine) for w, mine in blocks.items() if w})

    def call(self, msgs: dict[int, tuple], timeout: float = 600) -> dict[int, Any]:
        for w, msg in msgs.items():
            self.conns[w].send(msg)
        out = {}
        for w in msgs:
            if not self.conns[w].poll(timeout):
                raise RuntimeError(f"worker {w} did not answer {msgs[w][0]!r} in {timeout:.0f} s")
            status, value = self.conns[w].recv()
            if status != "ok":
                raise RuntimeError(f"worker {w} failed {msgs[w][0]!r}:\n{value}")
            out[w] = value
        return out

    def close(self) -> None:
        for _w, conn in enumerate(self.conns):
            try:
                conn.send(("exit",))
            except OSError:
                pass
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)


def measure_agreement(workers: Workers, backend: str, nodes: int, rounds: int, endpoints: list[str] | None = None,
                      server_cpu: Callable[[], float] | None = None, capacity_s: float = 0.0) -> dict[str, Any]:
    """Round 0 (fresh store) plus ``rounds`` measured rounds; per round the last node's time past ready."""
    lost = lost_node(nodes)
    job = f"scale-{backend}-{nodes}-{os.getpid()}-{time.monotonic_ns()}"
    blocks = workers.assign(nodes)
    used = len(blocks)
    spec = {"backend": backend, "nodes": nodes, "lost": lost, "endpoints": endpoints or [], "job": job}
    workers.call({w: ("setup", {**spec, "ranks": mine}) for w, mine in blocks.items()})
    times: list[float] = []
    cpu: list[tuple[float, float]] = []  # per round: the simulated nodes' CPU (and the embedded store's), etcd's
    requests: list[int] = []  # per round: store round trips, all nodes
    watches: list[int] = []  # per round: etcd watch streams opened, all nodes
    store_cpu: list[float] = []  # per round: the embedded store's server thread
    capacity: dict[str, float] | None = None
    plan_ok = True
    try:
        for idx in range(rounds + 1):
            start_at = time.monotonic() + ROUND_LEAD_S
            server0 = server_cpu() if server_cpu else 0.0
            got = workers.call({w: ("round", idx, start_at, f"bench: node {lost} was lost") for w in range(used)})
            cpu.append((sum(g["cpu"] for g in got.values()), (server_cpu() - server0) if server_cpu else 0.0))
            requests.append(sum(g["requests"] for g in got.values()))
            watches.append(sum(g.get("watches", 0) for g in got.values()))
            store_cpu.append(sum(g["store_cpu"] for g in got.values()))
            results = {n: r for g in got.values() for n, r in g["nodes"].items()}
            errors = [f"node {n}: {r['error']}" for n, r in results.items() if "error" in r]
            if errors:
                raise RuntimeError(f"{backend} N={nodes} round {idx}: {len(errors)} nodes failed; first:\n{errors[0]}")
            if len(results) != nodes or len({r["attempt"] for r in results.values()}) != 1:
                raise RuntimeError(f"{backend} N={nodes} round {idx}: nodes disagree on the round: "
                                   f"{sorted({r['attempt'] for r in results.values()})}")
            round_plans = {r["plan"] for r in results.values()}
            if len(round_plans) != 1:
                raise RuntimeError(f"{backend} N={nodes} round {idx}: {len(round_plans)} different plans")
            plan = RoundPlan.from_json(round_plans.pop())
            plan_ok &= plan.step == STEPS * STEP_EVERY and plan.fetch == expected_plan(nodes, lost)
            plan_ok &= backend == "bare" or {r["step"] for r in results.values()} == {plan.step}
            times.append(max(r["done"] for r in results.values()) - start_at)
        if capacity_s > 0 and backend != "bare":
            start_at = time.monotonic() + ROUND_LEAD_S
            server0 = server_cpu() if server_cpu else 0.0
            got = workers.call({w: ("hammer", start_at, capacity_s) for w in range(used)})
            capacity = {k: sum(g[k] for g in got.values()) for k in ("polls", "requests", "store_cpu")}
            capacity["seconds"] = capacity_s
            capacity["server_cpu"] = (server_cpu() - server0) if server_cpu else 0.0
    finally:
        workers.call({w: ("teardown",) for w in range(used)})
    return {"first": times[0], "times": times[1:], "median": statistics.median(times[1:]), "max": max(times[1:]),
            "lost": lost, "procs": used, "plan_ok": plan_ok, "cpu": statistics.median(c[0] for c in cpu[1:]),
            "server_cpu": statistics.median(c[1] for c in cpu[1:]), "requests": statistics.median(requests[1:]),
            "watches": statistics.median(watches[1:]), "store_cpu": statistics.median(store_cpu[1:]), "capacity": capacity}


# ------------------------------------------------------------------------------------------ plan


def plan_inventories(nodes: int = 1024, ranks: int = RANKS, steps: int = STEPS) -> list[NodeInventory]:
    """As node 0 reads them from the store (parsed from their JSON), one node lost."""
    held = holders_of(nodes)
    lost = lost_node(nodes)
    return [NodeInventory.from_json(synthetic_inventory(n, nodes, held, lost, ranks, steps).to_json(), n)
            for n in range(nodes)]


def measure_plan(nodes: int = 1024, reps: int = 9) -> dict[str, Any]:
    invs = plan_inventories(nodes)
    times = []
    plan = None
    for _ in range(reps):
        t0 = time.perf_counter()
        plan = compute_plan(1, invs)
        times.append(time.perf_counter() - t0)
    assert plan is not None
    return {"median": statistics.median(times), "max": max(times), "reps": reps,
            "inventory_bytes": sum(len(i.to_json()) for i in invs) / nodes,
            "ok": plan.step == STEPS * STEP_EVERY and plan.fetch == expected_plan(nodes, lost_node(nodes))}


def measure_node0(nodes: int, reps: int = 5) -> dict[str, Any]:
    """Node 0's own work in one round of ``nodes`` nodes, store round trips aside: what it does with the
    values it reads (each verified, HMAC and job, as the coordinator does, then parsed): every inventory,
    the plan, every fetch result and their union, every ready mark. The rest of a round is constant per
    node, so this is the part of agreement that grows with N wherever the nodes run."""
    from supervisor.cluster.coordinator import FetchResult
    from supervisor.cluster.signed_keys import SignedKeys

    keys = SignedKeys(None, JobIdentity("model", "bench_scale"), SECRET, 0)  # type: ignore[arg-type]

    def sealed(name: str, payload: str) -> tuple[str, bytes]:
        key = keys.key(name)
        return key, keys.seal(key, payload)

    inventories = [sealed(f"inv/1/{n}", inv.to_json()) for n, inv in enumerate(plan_inventories(nodes))]
    fetched = [sealed(f"fetched/1/0/{n}", FetchResult().to_json()) for n in range(nodes)]
    ready = [sealed(f"ready/1/{n}", "1") for n in range(nodes)]
    parts: dict[str, list[float]] = {"inventories": [], "plan": [], "fetch results": [], "ready marks": []}
    for _ in range(reps):
        t0 = time.perf_counter()
        invs = [NodeInventory.from_json(keys.open(k, raw).payload, n)  # type: ignore[union-attr]
                for n, (k, raw) in enumerate(inventories)]
        t1 = time.perf_counter()
        plan = compute_plan(1, invs)
        t2 = time.perf_counter()
        results = [FetchResult.from_json(keys.open(k, raw).payload) for k, raw in fetched]  # type: ignore[union-attr]
        FetchResult(sorted({b for r in results for b in r.bad}), "; ".join(r.error for r in results if r.error))
        t3 = time.perf_counter()
        assert all(keys.open(k, raw) is not None for k, raw in ready)
        t4 = time.perf_counter()
        for name, dt in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            parts[name].append(dt)
    medians = {name: statistics.median(v) for name, v in parts.items()}
    return {"nodes": nodes, "total": sum(medians.values()), "parts": medians, "ok": plan.step is not None,
            "bytes_read": sum(len(raw) for _, raw in inventories + fetched + ready),
            "inventory_bytes": sum(len(raw) for _, raw in inventories) / nodes}


# ------------------------------------------------------------------------------------------ bytes


class ProxyHub:
    """Counting TCP proxies on 127.0.0.1, one asyncio loop in a thread. ``counts[key]`` = [bytes from the
    client side to the server side, bytes back]."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.counts: dict[Any, list[int]] = {}
        self._servers: list[asyncio.base_events.Server] = []
        self._thread = threading.Thread(target=self.loop.run_forever, name="proxy-hub", daemon=True)
        self._thread.start()

    def add(self, key: Any, target: Callable[[], int]) -> int:
        """A proxy counting under ``key`` to 127.0.0.1:``target()`` (looked up per connection); its port."""
        self.counts.setdefault(key, [0, 0])

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                up_r, up_w = await asyncio.open_connection("127.0.0.1", target())
            except OSError:
                writer.close()
                return

            async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter, i: int) -> None:
                try:
                    while True:
                        data = await src.read(1 << 16)
                        if not data:
                            break
                        self.counts[key][i] += len(data)
                        dst.write(data)
                        await dst.drain()
                    if dst.can_write_eof():
                        dst.write_eof()
                except (OSError, asyncio.CancelledError):
                    pass

            await asyncio.gather(pipe(reader, up_w, 0), pipe(up_r, writer, 1))
            for w in (writer, up_w):
                w.close()

        async def start() -> int:
            server = await asyncio.start_server(handle, "127.0.0.1", 0)
            self._servers.append(server)
            return server.sockets[0].getsockname()[1]

        return asyncio.run_coroutine_threadsafe(start(), self.loop).result(10)

    def reset(self) -> None:
        for c in self.counts.values():
            c[0] = c[1] = 0

    def close(self) -> None:
        async def stop() -> None:
            for s in self._servers:
                s.close()

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


class PairClients(dict):
    """Node ``me``'s PeerClients, created on first use, each through its own counting proxy (me, peer)."""

    def __init__(self, me: int, hub: ProxyHub, server_ports: dict[int, int]) -> None:
        super().__init__()
        self.me, self.hub, self.server_ports = me, hub, server_ports
        self._lock = threading.Lock()

    def __missing__(self, peer: int) -> Any:
        from supervisor.transport.client import PeerClient

        with self._lock:
            if peer not in self:
                port = self.hub.add(("data", self.me, peer), lambda: self.server_ports[peer])
                dict.__setitem__(self, peer, PeerClient(f"127.0.0.1:{port}", SECRET))
            return dict.__getitem__(self, peer)


def write_parts(ckpt: Path, node: int, nodes: int, job: str, steps: int, ranks: int, part_bytes: int) -> None:
    """Real checkpoint parts as trainer_hooks writes them: one data file per rank, the manifest last."""
    from rlsup_format.manifest import SCHEMA_VERSION, RankManifest, hash_file, step_dir_name, write_manifest

    for s in range(1, steps + 1):
        step = s * STEP_EVERY
        d = ckpt / step_dir_name(step)
        d.mkdir(parents=True, exist_ok=True)
        for r in range(ranks):
            rank = node * ranks + r
            name = f"rank{rank:05d}.bin"
            (d / name).write_bytes(os.urandom(part_bytes))
            write_manifest(d, RankManifest(SCHEMA_VERSION, step, nodes * ranks, rank, "torch",
                                           {name: hash_file(d / name)}, time.time(),
                                           extra={"node_rank": node, "job": job}))


def measure_bytes(nodes: int, scratch: str | None, steps: int = 2, ranks: int = RANKS,
                  part_bytes: int = 64 << 10) -> dict[str, Any]:
    """A restore after losing one node of ``nodes``; wire bytes per node (see the module docstring)."""
    from supervisor.tiers.replication import ReplicationEngine, ReplicationSettings
    from supervisor.transport.server import ReplicationServer
    from supervisor.transport.store import ReplicaStore

    work = Path(tempfile.mkdtemp(prefix=f"rlsup-scale-bytes{nodes}-", dir=scratch))
    hub = ProxyHub()
    job = f"scale-bytes-{nodes}"
    lost = lost_node(nodes)
    servers: dict[int, Any] = {}
    server_ports: dict[int, int] = {}
    sims: dict[int, SimNode] = {}
    clients: list[PairClients] = []
    try:
        def start_server(n: int) -> None:
            srv = ReplicationServer(ReplicaStore(work / f"node{n}" / "replicas"), SECRET)
            server_ports[n] = srv.start()
            servers[n] = srv

        for n in range(nodes):
            start_server(n)
        peers = [f"127.0.0.1:{server_ports[n]}" for n in range(nodes)]  # membership; traffic goes by PairClients

        def engine(n: int) -> ReplicationEngine:
            base = work / f"node{n}"
            clients.append(PairClients(n, hub, server_ports))
            return ReplicationEngine(membership=Membership(tuple(peers), n), checkpoint_dir=base / "ckpt",
                                     replica_root=base / "replicas", clients=clients[-1],
                                     settings=ReplicationSettings(factor=1, jump=1),
                                     state_path=base / "state" / "replication.json", job=job)

        engines = {n: engine(n) for n in range(nodes)}
        for n in range(nodes):
            write_parts(engines[n].checkpoint_dir, n, nodes, job, steps, ranks, part_bytes)
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda e: e.sync(), engines.values()))
        pushed = sum(p.bytes_sent for e in engines.values() for p in e.progress.values())

        store_port = free_port()
        store_proxy = {n: hub.add(("store", n), lambda: store_port) for n in range(1, nodes)}

        def sim(n: int) -> SimNode:
            return make_node(work, n, nodes, "embedded", job, store_port, [], engines[n], peers=peers,
                             store_port=store_proxy.get(n))

        sims.update(connect_all(list(range(nodes)), sim))

        def run_all(targets: dict[int, SimNode]) -> dict[int, Any]:
            with concurrent.futures.ThreadPoolExecutor(len(targets)) as pool:
                futs = {n: pool.submit(s.round) for n, s in targets.items()}
                return {n: f.result(TIMEOUT_S) for n, f in futs.items()}

        first = run_all(sims)  # every node holds everything: nothing to fetch
        assert {a for a, _ in first.values()} == {0}, first

        # Node ``lost`` is lost: its disk (parts and the replicas it held) and its supervisor go; a replacement
        # with an empty disk starts on the same address. Node 0 ends the round, as the failing node would.
        sims[0].coordinator.end(0, f"node {lost} was lost")
        sims[lost].coordinator.store.close()
        servers.pop(lost).stop()
        shutil.rmtree(work / f"node{lost}")
        start_server(lost)
        engines[lost] = engine(lost)
        hub.reset()
        sims[lost] = sim(lost)
        counters = {n: RequestCounter() for n in sims}
        for n, s in sims.items():
            counters[n].attach(s.coordinator.store)
        restored = run_all(sims)

        attempts = {a for a, _ in restored.values()}
        plans = {s.plans[-1] for s in sims.values()}
        plan = RoundPlan.from_json(next(iter(plans)))
        per_node: dict[int, dict[str, int]] = {n: {"data_sent": 0, "data_recv": 0, "coord_sent": 0, "coord_recv": 0}
                                              for n in range(nodes)}
        host = [0, 0]  # the embedded store on node 0: what it received from and sent to the other nodes
        for key, (up, down) in hub.counts.items():
            if key[0] == "data":
                _, client, server = key
                per_node[client]["data_sent"] += up
                per_node[client]["data_recv"] += down
                per_node[server]["data_sent"] += down
                per_node[server]["data_recv"] += up
            elif key[0] == "store":
                per_node[key[1]]["coord_sent"] += up
                per_node[key[1]]["coord_recv"] += down
                host[0] += up
                host[1] += down
        payload = ranks * part_bytes
        holder = replica_targets(lost, nodes, 1)[0]
        fetched_ok = all(r[1] is not None and r[1].step == steps * STEP_EVERY for r in restored.values())
        others = [n for n in range(nodes) if n not in (0, lost, *replica_targets(lost, nodes, 1))]
        return {
            "nodes": nodes, "lost": lost, "holder": holder, "per_node": per_node, "host": host, "payload": payload,
            "pushed": pushed, "parts": ranks, "part_bytes": part_bytes, "steps": steps,
            "ok": len(attempts) == 1 and len(plans) == 1 and fetched_ok and plan.fetch == expected_plan(nodes, lost),
            "max_data": max(p["data_sent"] + p["data_recv"] for p in per_node.values()),
            "max_coord": max(p["coord_sent"] + p["coord_recv"] for n, p in per_node.items() if n != 0),
            "requests": {n: c.count for n, c in counters.items()},
            "max_requests": max(c.count for n, c in counters.items() if n != 0),
            "other_data": max((per_node[n]["data_sent"] + per_node[n]["data_recv"] for n in others), default=0),
        }
    finally:
        for s in sorted(sims, reverse=True):
            try:
                sims[s].coordinator.store.close()
            except Exception:
                pass
        for pair in clients:
            for c in dict.values(pair):
                c.close()
        for srv in servers.values():
            srv.stop()
        hub.close()
        shutil.rmtree(work, ignore_errors=True)


# ------------------------------------------------------------------------------------------ main


def fmt_bytes(n: float) -> str:
    return f"{n / 1024:.1f} KiB" if n < 1 << 20 else f"{n / (1 << 20):.2f} MiB"


def process_cpu(pids: list[int]) -> float:
    """User + system CPU seconds of processes (etcd members), from /proc."""
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError):
            pass
    return total


def run(quick: bool, only: list[str], procs: int, rounds: int | None, sizes: list[int], byte_sizes: list[int],
        backends: list[str], scratch: str | None) -> tuple[list[Row], dict[str, Any]]:
    """Every figure asked for: the table's rows, and the numbers behind them (``--json``)."""
    rows: list[Row] = []
    results: dict[str, Any] = {"agreement": [], "bytes": [], "plan": None}
    rounds = rounds or (3 if quick else 5)

    def emit(row: Row) -> None:
        print_row(row)
        rows.append(row)

    if "plan" in only:
        t0 = time.monotonic()
        r = measure_plan(1024, 5 if quick else 15)
        results["plan"] = r
        emit(Row("plan: compute_plan, 1,024 nodes x 8 ranks x 5 steps, one node lost", r["median"] * 1e3, None,
                 "ms", f"median of {r['reps']} (max {r['max'] * 1e3:.1f} ms); budget 100 ms; inventories of "
                 f"{r['inventory_bytes'] / 1024:.1f} KiB (JSON)" + ("" if r["ok"] else "; WRONG PLAN")))
        results["node0"] = []
        for nodes in (1024, 4096):
            m = measure_node0(nodes, 3 if quick else 5)
            results["node0"].append(m)
            emit(Row(f"node 0's own work per round at {nodes:,} nodes (values read, verified, parsed; plan)",
                     m["total"] * 1e3, None, "ms", "; ".join(f"{k} {v * 1e3:.0f} ms" for k, v in m["parts"].items())
                     + f"; {fmt_bytes(m['bytes_read'])} read" + ("" if m["ok"] else "; NO PLAN")))
        log(f"plan: {time.monotonic() - t0:.0f} s")
    if "agreement" in only:
        workers = Workers(procs)
        cluster = None
        try:
            if "embedded" in backends:
                t0 = time.monotonic()
                workers.connect(max(sizes))
                log(f"{max(sizes)} connections to the embedded store: {time.monotonic() - t0:.0f} s")
            endpoints: list[str] = []
            if "etcd" in backends:
                from etcd_cluster import EtcdCluster, etcd_binary

                if etcd_binary() is None:
                    log("etcd not installed (apt-get install etcd-server): the etcd rows are skipped")
                    backends = [b for b in backends if b != "etcd"]
                else:
                    cluster = EtcdCluster(Path(tempfile.mkdtemp(prefix="rlsup-scale-etcd-", dir=scratch))).start()
                    endpoints = cluster.endpoints
            for nodes in sizes:
                t0 = time.monotonic()
                bare = measure_agreement(workers, "bare", nodes, rounds) if "embedded" in backends else None
                for backend in backends:
                    etcd_cpu = None
                    if cluster is not None and backend == "etcd":
                        cluster.wipe()
                        etcd_cpu = lambda: process_cpu([p.pid for p in cluster.procs if p is not None])  # noqa: E731
                    try:
                        r = measure_agreement(workers, backend, nodes, rounds, endpoints, etcd_cpu,
                                              capacity_s=(1.0 if quick else 3.0) if nodes == max(sizes) else 0.0)
                    except Exception as e:  # one broken size must not hide the others
                        results["agreement"].append({"backend": backend, "nodes": nodes, "error": str(e)})
                        emit(Row(f"agreement: {nodes} nodes, {backend} store: failed", None, None, "s",
                                 f"{type(e).__name__}: {str(e)[-300:]}"))
                        continue
                    base = bare["median"] if backend == "embedded" and bare else None
                    results["agreement"].append({"backend": backend, "nodes": nodes, "baseline": base, **r})
                    if backend == "embedded":
                        cpu = f"CPU per round: nodes {r['cpu']:.2f} s, of which the store's thread {r['store_cpu']:.3f} s"
                    else:
                        cpu = f"CPU per round: nodes {r['cpu']:.2f} s, etcd members {r['server_cpu']:.2f} s"
                    cpu += f"; {r['requests']:.0f} store requests per round"
                    if r.get("watches"):
                        cpu += f" and {r['watches']:.0f} watches opened"
                    cap = r["capacity"]
                    if cap:
                        cpu += (f"; with every node polling at once the store answered {cap['polls'] / cap['seconds']:.0f}"
                                f" polls/s ({cap['requests'] / cap['seconds']:.0f} requests/s"
                                + (f", {cap['store_cpu'] / cap['requests'] * 1e6:.0f} us of store thread CPU each)"
                                   if backend == "embedded" else
                                   f", {cap['server_cpu'] / cap['requests'] * 1e6:.0f} us of etcd CPU each)"))
                    emit(Row(f"agreement: {nodes} nodes, {backend} store"
                             + (" vs bare TCPStore exchange" if base is not None else ""), r["median"], base, "s",
                             f"max over nodes, median of {len(r['times'])} rounds (max {r['max']:.3f} s); first "
                             f"round (fresh store) {r['first']:.3f} s; {cpu}; threads of {r['procs']} processes"
                             + ("" if r["plan_ok"] else "; WRONG PLAN")))
                log(f"agreement N={nodes}: {time.monotonic() - t0:.0f} s")
        finally:
            workers.close()
            if cluster is not None:
                cluster.stop()
                shutil.rmtree(cluster.base_dir, ignore_errors=True)
    if "bytes" in only:
        for nodes in byte_sizes:
            t0 = time.monotonic()
            r = measure_bytes(nodes, scratch, steps=1 if quick else 2)
            results["bytes"].append(r)
            lost, holder, pn = r["lost"], r["holder"], r["per_node"]
            emit(Row(f"restore after losing 1 of {nodes} nodes: max data bytes per node vs the lost parts",
                     r["max_data"] / 1024, r["payload"] / 1024, "KiB",
                     f"lost node {lost} received {fmt_bytes(pn[lost]['data_recv'])}, its holder {holder} sent "
                     f"{fmt_bytes(pn[holder]['data_sent'])}, every other node {fmt_bytes(r['other_data'])}; "
                     f"{r['parts']} parts of {fmt_bytes(r['part_bytes'])} ({r['steps']} step"
                     f"{'s' if r['steps'] > 1 else ''} replicated before the loss)"
                     + ("" if r["ok"] else "; RESTORE WRONG")))
            emit(Row(f"restore after losing 1 of {nodes} nodes: max coordination bytes per node (not node 0)",
                     r["max_coord"] / 1024, None, "KiB",
                     f"sent + received through the embedded store, at most {r['max_requests']} requests (most are "
                     f"polls: their number follows the round's length); node 0, which hosts the store, served "
                     f"{fmt_bytes(sum(r['host']))} to the other {nodes - 1}"))
            log(f"bytes N={nodes}: {time.monotonic() - t0:.0f} s")
    return rows, results


def quiet_environment() -> None:
    """For this process and the workers it spawns. torch's TCPStore reverse-resolves every client's
    address when it accepts it (and warns when that fails); this machine's resolver drops a query now and
    then, which costs its whole timeout (5 s) at connection time. Neither is what is measured."""
    os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer rounds and smaller byte runs: < 2 min")
    ap.add_argument("--only", default="", help=f"comma-separated subset of: {','.join(FIGURES)}")
    ap.add_argument("--sizes", default="8,32,64,128", help="node counts for the agreement figure")
    ap.add_argument("--byte-sizes", default="", help="node counts for the bytes figure (default 4,8,16 quick; "
                                                       "4,8,16,32 full)")
    ap.add_argument("--backends", default="embedded,etcd", help="embedded, etcd, or both")
    ap.add_argument("--procs", type=int, default=4, help="worker processes the simulated nodes are spread over")
    ap.add_argument("--rounds", type=int, default=None, help="measured rounds per size (default 3 quick, 5 full)")
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    ap.add_argument("--json", default=None, help="also write the rows as JSON here")
    ap.add_argument("--markdown", default=None, help="also write the rows as a Markdown table here")
    args = ap.parse_args()
    only = [x.strip() for x in args.only.split(",") if x.strip()] or list(FIGURES)
    if any(x not in FIGURES for x in only):
        ap.error(f"--only takes {','.join(FIGURES)}")
    sizes = [int(x) for x in args.sizes.split(",") if x.strip()]
    byte_sizes = [int(x) for x in args.byte_sizes.split(",") if x.strip()] or ([4, 8, 16] if args.quick
                                                                              else [4, 8, 16, 32])
    backends = [x.strip() for x in args.backends.split(",") if x.strip()]
    quiet_environment()
    started = time.monotonic()
    print(f"rlsup scale benchmark ({'quick' if args.quick else 'full'}): {os.cpu_count()} cores, "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)
    print(HEADER, flush=True)
    load = os.getloadavg()[0]
    rows, results = run(args.quick, only, args.procs, args.rounds, sizes, byte_sizes, backends, args.dir)
    log(f"total {time.monotonic() - started:.0f} s; load average {load:.1f} at the start, "
        f"{os.getloadavg()[0]:.1f} now")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": [{**r.__dict__, "ratio": r.ratio} for r in rows],
                                               "load_average": [load, os.getloadavg()[0]], **results},
                                              indent=1, default=str))
    if args.markdown:
        Path(args.markdown).write_text(markdown_table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
