"""Replication transport throughput on 127.0.0.1: push a checkpoint directory to 1 and 2 peers.

Compared with ``cp -r`` (a local copy: the ceiling for a same-host transfer, no network, no checksum)
and an rsync daemon on 127.0.0.1 (``rsync -a --whole-file`` to ``rsync://``: the usual tool for
copying checkpoints between nodes). Each configuration runs 3 times, alternating rlsup and baseline,
and the table shows medians in MB/s (10^6 bytes per second of checkpoint data moved; with 2 peers,
bytes delivered to both peers count twice, and the baseline runs two rsyncs in parallel).

Each peer's endpoint runs in its own process (as on another node). With 2 peers rlsup pushes each file
once, to the first peer, which streams it on to the second while storing it (a chain,
:mod:`supervisor.transport.forward`); the sender's time and bytes for 2 peers are compared with 1.
rlsup includes everything a real push does: HMAC per request, streaming to the peer's
``.incoming``, xxh3-128 verification, fsync and rename. The checksums of the source files are
computed once up front (as the replicator gets them from the manifest) and not timed.

    .venv/bin/python benchmarks/bench_replication.py            # 2 GB
    .venv/bin/python benchmarks/bench_replication.py --quick    # 0.2 GB
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from supervisor.transport.client import PeerClient, TransferPool
from rlsup_format.manifest import hash_file

SECRET = b"benchmark-secret-benchmark-secret"


def make_checkpoint(root: Path, total_bytes: int, files: int = 8) -> dict:
    """A step directory like an 8-rank save: 8 equal shards plus a small metadata file."""
    step = root / "step_000000100"
    step.mkdir(parents=True)
    per = total_bytes // files
    block = os.urandom(4 << 20)
    for i in range(files):
        with open(step / f"__{i}_0.distcp", "wb") as f:
            left = per
            while left:
                n = min(left, len(block))
                f.write(block[:n])
                left -= n
    (step / ".metadata").write_bytes(os.urandom(64 << 10))
    return {f"step_000000100/{p.name}": hash_file(p) for p in sorted(step.iterdir())}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def drop(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def push_rlsup(src: Path, entries: dict, client: PeerClient, pool: TransferPool, tag: str,
               forward: tuple[str, ...] = ()) -> float:
    """The sender's side of one replication: each file pushed once, data files first, in parallel
    (as ``copy_part`` does); with ``forward`` the first peer streams every file on along the chain."""
    t0 = time.perf_counter()
    reports = pool.map(lambda rel: client.push_file(tag, rel, src / rel, entries[rel], forward=forward), list(entries))
    for report in reports:
        bad = {ep: why for ep, why in (report or {}).items() if why not in ("ok", "queued")}
        if bad:
            raise RuntimeError(f"chain did not reach {bad}")
    return time.perf_counter() - t0


_SERVE = """
import sys
sys.path.insert(0, {repo!r})
from supervisor.transport.server import ReplicationServer
from supervisor.transport.store import ReplicaStore
srv = ReplicationServer(ReplicaStore({root!r}), {secret!r}, port={port}, forward_peers={peers!r}, own_endpoint={own!r})
print(srv.start(), flush=True)
sys.stdin.read()  # until the benchmark closes our stdin
srv.stop()
"""


class PeerServer:
    """A peer's replication endpoint in its own process (as on another node: no shared GIL)."""

    def __init__(self, root: Path, port: int, peers: list[str], niceness: int = 0) -> None:
        own = f"127.0.0.1:{port}"
        code = _SERVE.format(repo=str(Path(__file__).resolve().parent.parent), root=str(root), secret=SECRET,
                             port=port, peers=[p for p in peers if p != own], own=own)
        self.root = root
        self.proc = subprocess.Popen(["nice", "-n", str(niceness), sys.executable, "-c", code], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if not line.strip().isdigit():
            raise RuntimeError("peer server did not start")
        self.endpoint = own

    def stop(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


class RsyncDaemon:
    def __init__(self, workdir: Path, dest: Path, niceness: int = 0) -> None:
        self.port = free_port()
        self.dest = dest
        dest.mkdir(parents=True, exist_ok=True)
        conf = workdir / f"rsyncd-{self.port}.conf"
        conf.write_text(f"use chroot = no\nport = {self.port}\naddress = 127.0.0.1\npid file = {workdir}/rsyncd-{self.port}.pid\n"
                        f"log file = {workdir}/rsyncd-{self.port}.log\n[ckpt]\npath = {dest}\nread only = no\n"
                        f"uid = {os.getuid()}\ngid = {os.getgid()}\n")
        self.proc = subprocess.Popen(["nice", "-n", str(niceness), "rsync", "--daemon", "--no-detach", f"--config={conf}"])
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError("rsync daemon did not start") from None
                time.sleep(0.05)

    def push(self, src: Path, tag: str) -> None:
        subprocess.run(["rsync", "-a", "--whole-file", f"{src}/", f"rsync://127.0.0.1:{self.port}/ckpt/{tag}/"],
                       check=True)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


SECOND_HOP_NICENESS = 19
RSYNC_MISSING = "rsync not installed (scripts/setup.sh installs it; or apt-get install -y rsync)"


def fsync_tree(path: Path) -> None:
    # rlsup fsyncs every file it stores; make the baselines durable too so the comparison is fair.
    subprocess.run(["sync", "-f", str(path)], check=False)


@dataclass
class Sides:
    """Seconds per run of each side, for 1 and 2 peers."""

    rlsup: dict[int, list[float]] = field(default_factory=lambda: {1: [], 2: []})
    cp: dict[int, list[float]] = field(default_factory=lambda: {1: [], 2: []})
    rsync: dict[int, list[float]] = field(default_factory=lambda: {1: [], 2: []})
    complete: list[float] = field(default_factory=list)  # 2 peers: until the chain's last hop holds it all
    sender_cpu: dict[int, list[float]] = field(default_factory=lambda: {1: [], 2: []})  # the pushing process's CPU s

    def paired_ratios(self) -> list[float]:
        """Per run, the sender's time for 2 peers over its time for 1 peer in the same run (adjacent
        rounds): what this VM's slow drift (page cache, writeback, neighbours) does to both cancels."""
        return [two / one for one, two in zip(self.rlsup[1], self.rlsup[2])]


def _one_round(src: Path, dests: list[Path], entries: dict, client: PeerClient, pool: TransferPool, peers: list[PeerServer],
               daemons: list[RsyncDaemon], npeers: int, tag: str, sides: Sides) -> None:
    forward = tuple(p.endpoint for p in peers[1:npeers])
    os.sync()  # each side starts with nothing of the previous one still to write back
    t0 = time.perf_counter()
    cpu0 = time.process_time()
    sides.rlsup[npeers].append(push_rlsup(src, entries, client, pool, tag, forward))
    sides.sender_cpu[npeers].append(time.process_time() - cpu0)
    if npeers > 1:  # the last hop holds every file (the chain sends on in the background)
        last = peers[npeers - 1].root / tag
        while not all((last / rel).is_file() and (last / rel).stat().st_size == e.size for rel, e in entries.items()):
            if time.perf_counter() - t0 > 600:
                raise RuntimeError("the chain's last hop did not get every file in 600 s")
            time.sleep(0.01)
        sides.complete.append(time.perf_counter() - t0)
    for p in peers[:npeers]:
        drop(p.root / tag)
    os.sync()
    t0 = time.perf_counter()  # cp -r (npeers copies in parallel)
    procs = [subprocess.Popen(["cp", "-r", str(src), str(dests[i] / f"cp{i}-{tag}")]) for i in range(npeers)]
    for proc in procs:
        proc.wait()
    for i in range(npeers):
        fsync_tree(dests[i] / f"cp{i}-{tag}")
    sides.cp[npeers].append(time.perf_counter() - t0)
    for i in range(npeers):
        drop(dests[i] / f"cp{i}-{tag}")
    if daemons:  # rsync: one client per peer, in parallel (the sender sends every copy)
        os.sync()
        t0 = time.perf_counter()
        ths = [threading.Thread(target=daemons[i].push, args=(src, f"rs-{tag}")) for i in range(npeers)]
        for th in ths:
            th.start()
        for th in ths:
            th.join()
        for i in range(npeers):
            fsync_tree(daemons[i].dest / f"rs-{tag}")
        sides.rsync[npeers].append(time.perf_counter() - t0)
        for i in range(npeers):
            drop(daemons[i].dest / f"rs-{tag}")


def measure(size: int, runs: int = 3, concurrency: int = 4, scratch: str | None = None) -> list[tuple[str, float, float]]:
    """Push a ``size``-byte checkpoint to 1 and 2 peers, alternating rlsup, ``cp -r`` and the rsync daemon
    ``runs`` times each; returns (name, rlsup median, baseline median) rows: MB/s delivered, then the
    sender's cost of 2 peers against 1 (seconds; bytes it sent)."""
    if shutil.which("rsync") is None:
        print(f"{RSYNC_MISSING}; the rsync rows are n/a", file=sys.stderr)
    work = Path(tempfile.mkdtemp(prefix="rlsup-bench-", dir=scratch))
    peers: list[PeerServer] = []
    daemons: list[RsyncDaemon] = []
    own_disk = work
    try:
        src = work / "src"
        entries = make_checkpoint(src, size)
        total = sum(e.size for e in entries.values())
        print(f"checkpoint: {len(entries)} files, {total / 1e9:.2f} GB in {src}; {runs} runs, median",
              file=sys.stderr)
        ports = [free_port() for _ in range(2)]
        endpoints = [f"127.0.0.1:{p}" for p in ports]
        # The second destination of every side (rlsup's second hop, the second rsync daemon, the second
        # cp) stands for another machine: it writes to memory where /dev/shm exists, not to their disk,
        # and the second hop and rsync daemon run nicer than the sender and the first, so their receive
        # does not take those cores (a cp is one process: sender and receiver at once, not niced).
        own_disk = Path(tempfile.mkdtemp(prefix="rlsup-bench-hop2-", dir="/dev/shm" if Path("/dev/shm").is_dir() else work))
        dests = [work, own_disk]
        peers = [PeerServer(dests[i] / f"peer{i}", ports[i], endpoints, niceness=SECOND_HOP_NICENESS * i)
                 for i in range(2)]
        client = PeerClient(peers[0].endpoint, SECRET, retries=0)
        pool = TransferPool(concurrency)
        if shutil.which("rsync"):
            daemons = [RsyncDaemon(work, dests[i] / f"rsync{i}", niceness=SECOND_HOP_NICENESS * i) for i in range(2)]
        sides = Sides()
        for run in range(runs):
            for npeers in ((1, 2) if run % 2 == 0 else (2, 1)):
                _one_round(src, dests, entries, client, pool, peers, daemons, npeers, f"run{run}-{npeers}", sides)
        client.close()
        pool.shutdown()
        rows = []
        rl1 = statistics.median(total / t / 1e6 for t in sides.rlsup[1])
        rl2 = statistics.median(total * 2 / t / 1e6 for t in sides.complete)  # both copies in place
        for n, rl in ((1, rl1), (2, rl2)):
            label = "push to 1 peer" if n == 1 else "push to 2 peers (chain, both copies in place)"
            rows.append((f"{label} vs cp -r", rl, statistics.median(total * n / t / 1e6 for t in sides.cp[n])))
            # Without rsync the row stays, with no baseline (n/a): a missing baseline is said, never dropped.
            rows.append((f"{label} vs rsync daemon", rl,
                         statistics.median(total * n / t / 1e6 for t in sides.rsync[n]) if daemons else None))
        rows.append(("sender time: push to 2 peers (chain) vs to 1", statistics.median(sides.rlsup[2]),
                     statistics.median(sides.rlsup[1])))
        rows.append(("sender time: push to 2 peers / to 1 in the same run (median of runs)",
                     statistics.median(sides.paired_ratios()), 1.0))
        rows.append(("sender CPU: push to 2 peers (chain) vs to 1", statistics.median(sides.sender_cpu[2]),
                     statistics.median(sides.sender_cpu[1])))
        rows.append(("sender bytes: push to 2 peers (chain) vs to 1", total / 1e6, total / 1e6))
        return rows
    finally:
        for p in peers:
            p.stop()
        for d in daemons:
            d.stop()
        drop(work)
        drop(own_disk)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gb", type=float, default=2.0)
    ap.add_argument("--quick", action="store_true", help="0.2 GB")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=4, help="concurrent file transfers (TransferPool)")
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    args = ap.parse_args()
    size = int((0.2 if args.quick else args.size_gb) * 1e9)
    rows = measure(size, args.runs, args.concurrency, args.dir)
    print(f"\n{'name':<48} {'rlsup median':>13} {'baseline median':>16} {'ratio':>7}")
    for name, a, b in rows:
        print(f"{name:<48} {a:>13.3f} {b if b is not None else float('nan'):>16.3f} "
              f"{a / b if b else float('nan'):>7.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
