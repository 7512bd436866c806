"""Replication transport throughput on 127.0.0.1: push a checkpoint directory to 1 and 2 peers.

Compared with ``cp -r`` (a local copy: the ceiling for a same-host transfer, no network, no checksum)
and an rsync daemon on 127.0.0.1 (``rsync -a --whole-file`` to ``rsync://``: the usual tool for
copying checkpoints between nodes). Each configuration runs 3 times, alternating rlsup and baseline,
and the table shows medians in MB/s (10^6 bytes per second of checkpoint data moved; with 2 peers,
bytes delivered to both peers count twice, and the baseline runs two rsyncs in parallel).

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
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from supervisor.transport.client import PeerClient, TransferPool  # noqa: E402
from supervisor.transport.server import ReplicationServer  # noqa: E402
from supervisor.transport.store import ReplicaStore  # noqa: E402
from rlsup_format.manifest import hash_file  # noqa: E402

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


def push_rlsup(src: Path, entries: dict, clients: list[PeerClient], pool: TransferPool, tag: str) -> float:
    t0 = time.perf_counter()
    jobs = [(c, rel, e) for c in clients for rel, e in entries.items()]
    pool.map(lambda j: j[0].push_file(tag, j[1], src / j[1], j[2]), jobs)
    return time.perf_counter() - t0


class RsyncDaemon:
    def __init__(self, workdir: Path, dest: Path) -> None:
        self.port = free_port()
        conf = workdir / f"rsyncd-{self.port}.conf"
        conf.write_text(f"use chroot = no\nport = {self.port}\naddress = 127.0.0.1\npid file = {workdir}/rsyncd-{self.port}.pid\n"
                        f"log file = {workdir}/rsyncd-{self.port}.log\n[ckpt]\npath = {dest}\nread only = no\n"
                        f"uid = {os.getuid()}\ngid = {os.getgid()}\n")
        self.proc = subprocess.Popen(["rsync", "--daemon", "--no-detach", f"--config={conf}"])
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError("rsync daemon did not start")
                time.sleep(0.05)

    def push(self, src: Path, tag: str) -> None:
        subprocess.run(["rsync", "-a", "--whole-file", f"{src}/", f"rsync://127.0.0.1:{self.port}/ckpt/{tag}/"],
                       check=True)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


RSYNC_MISSING = "rsync not installed (scripts/setup.sh installs it; or apt-get install -y rsync)"


def fsync_tree(path: Path) -> None:
    # rlsup fsyncs every file it stores; make the baselines durable too so the comparison is fair.
    subprocess.run(["sync", "-f", str(path)], check=False)


def measure(size: int, runs: int = 3, concurrency: int = 4, scratch: str | None = None) -> list[tuple[str, float, float]]:
    """Push a ``size``-byte checkpoint to 1 and 2 peers, alternating rlsup, ``cp -r`` and the rsync daemon
    ``runs`` times each; returns (name, rlsup median MB/s, baseline median MB/s) rows."""
    if shutil.which("rsync") is None:
        print(f"{RSYNC_MISSING}; the rsync rows are n/a", file=sys.stderr)
    work = Path(tempfile.mkdtemp(prefix="rlsup-bench-", dir=scratch))
    servers: list[ReplicationServer] = []
    daemons: list[RsyncDaemon] = []
    try:
        src = work / "src"
        entries = make_checkpoint(src, size)
        total = sum(e.size for e in entries.values())
        print(f"checkpoint: {len(entries)} files, {total / 1e9:.2f} GB in {src}; {runs} runs, median",
              file=sys.stderr)
        stores = [ReplicaStore(work / f"peer{i}") for i in range(2)]
        servers = [ReplicationServer(s, SECRET) for s in stores]
        clients = [PeerClient(f"127.0.0.1:{srv.start()}", SECRET, retries=0) for srv in servers]
        pool = TransferPool(concurrency)
        if shutil.which("rsync"):
            daemons = [RsyncDaemon(work, work / f"peer{i}") for i in range(2)]
        rows = []
        for npeers in (1, 2):
            rl, cp, rs = [], [], []
            for run in range(runs):
                tag = f"run{run}"
                # rlsup
                t = push_rlsup(src, entries, clients[:npeers], pool, tag)
                rl.append(total * npeers / t / 1e6)
                for i in range(npeers):
                    stores[i].delete(tag, "")
                # cp -r (npeers copies in parallel)
                t0 = time.perf_counter()
                procs = [subprocess.Popen(["cp", "-r", str(src), str(work / f"cp{i}-{tag}")]) for i in range(npeers)]
                for p in procs:
                    p.wait()
                for i in range(npeers):
                    fsync_tree(work / f"cp{i}-{tag}")
                cp.append(total * npeers / (time.perf_counter() - t0) / 1e6)
                for i in range(npeers):
                    drop(work / f"cp{i}-{tag}")
                # rsync daemon
                if daemons:
                    t0 = time.perf_counter()
                    ths = [threading.Thread(target=daemons[i].push, args=(src, f"rs-{tag}")) for i in range(npeers)]
                    for th in ths:
                        th.start()
                    for th in ths:
                        th.join()
                    for i in range(npeers):
                        fsync_tree(work / f"peer{i}" / f"rs-{tag}")
                    rs.append(total * npeers / (time.perf_counter() - t0) / 1e6)
                    for i in range(npeers):
                        drop(work / f"peer{i}" / f"rs-{tag}")
            med = statistics.median(rl)
            rows.append((f"push to {npeers} peer{'s' if npeers > 1 else ''} vs cp -r", med, statistics.median(cp)))
            # Without rsync the row stays, with no baseline (n/a): a missing baseline is said, never dropped.
            rows.append((f"push to {npeers} peer{'s' if npeers > 1 else ''} vs rsync daemon", med,
                         statistics.median(rs) if rs else None))
        for c in clients:
            c.close()
        pool.shutdown()
        return rows
    finally:
        for srv in servers:
            srv.stop()
        for d in daemons:
            d.stop()
        drop(work)


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
    print(f"\n{'name':<34} {'rlsup median':>13} {'baseline median':>16} {'ratio':>7}  unit")
    for name, a, b in rows:
        print(f"{name:<34} {a:>13.0f} {b:>16.0f} {a / b:>7.2f}  MB/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
