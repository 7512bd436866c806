"""Multi-node chaos over loopback: every node is a separate process tree with its own directory and ports
on 127.0.0.1 (as in tests/cluster/test_multinode_e2e.py and tests/tiers/test_daemon_replication_e2e.py).

- :func:`transfer_kill_scenario`: two ``rlsup daemon`` processes replicate each other's checkpoints; the
  sender's bandwidth is capped so a push lasts seconds. While a part is in flight (the receiver's
  ``replicas/.incoming`` holds its temp file) the sender or the receiver is SIGKILLed. The receiver must
  never expose the partial part (no manifest, no torn file under a final name), the older replica stays
  valid, the temp file goes (dropped by a live receiver, removed when a killed one reopens its store), and
  once the killed daemon is back the same part is replicated whole.
- :func:`fetch_kill_scenario`: a 2-node ``rlsup run`` job (torchrun, one rank per node). Node 1 is lost
  (its whole process tree SIGKILLed, its directory gone); its replacement, whose fetch bandwidth is capped,
  is SIGKILLed while it fetches its parts from node 0 in the round's prepare, then started again. The job
  must resume and end with the uninterrupted run's weights, and nothing of the killed fetch may remain.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path
from typing import Sequence

from supervisor.job_identity import job_identity, namespace_of
from rlsup_format.names import Kind, parse_reserved
from rlsup_format.manifest import hash_file, list_step_dirs, manifest_name, read_manifest, step_dir_name

from support.cluster import Cluster
from support.incidents import incidents
from support.ports import free_ports
from support.procs import freeze, kill_tree, rlsup_cmd, thaw
from support.waits import Deadline, wait_for

from .common import STEPS, Sandbox, reference_weights, sandbox_env, train_args
from .injector import NO_WARM_LAUNCHER, Fault
from .invariants import (ProcessTracker, check_no_survivors, check_no_temp_copies, check_no_writes_outside,
                         check_weights)
from .scenarios import ScenarioResult


def default_job(peers: str) -> str:
    """The job every node derives from the default checkpoint_dir ("checkpoints", as written) and the peers."""
    return job_identity("", "checkpoints", multi_node=True, environ={}, peers=peers.split(",")).id

SECRET_TEXT = "chaos-multinode-shared-secret-0123456789\n"


def _token(sb: Sandbox) -> Path:
    token = sb.run / "token"
    token.write_text(SECRET_TEXT)
    token.chmod(0o600)
    return token


def _valid_part(step_dir: Path, rank: int):
    from supervisor.tiers.parts import verify_part

    return verify_part(step_dir, rank, full=True)


# ------------------------------------------------------------------ (a) killed mid-transfer


def transfer_kill_scenario(parent: Path, seed: int, victims: list[str] | None = None, mb: int = 6,
                           bandwidth: float = 3e6) -> ScenarioResult:
    """SIGKILL of the sending or the receiving ``rlsup daemon`` while a replica part is in flight."""
    import torch

    from supervisor.transport.auth import load_secret
    from supervisor.transport.client import PeerClient
    from trainer_hooks.checkpoint import CheckpointManager

    started = time.monotonic()
    rng = random.Random(seed)
    res = ScenarioResult("mn_transfer", seed)
    sb = Sandbox(parent)
    victims = victims or [rng.choice(["sender", "receiver"]) for _ in range(rng.randint(1, 3))]
    token = _token(sb)
    ports = free_ports(2)
    peers = ",".join(f"127.0.0.1:{p}" for p in ports)
    dirs = [sb.run / "node0", sb.run / "node1"]
    procs: dict[int, subprocess.Popen] = {}
    tracker = ProcessTracker(dirs[0] / ".rlsup").start()
    store1 = dirs[1] / "replicas"
    incoming = store1 / ".incoming"
    ns_dir = store1 / namespace_of(default_job(peers), 0)
    client = None

    def start(node: int) -> None:
        dirs[node].mkdir(parents=True, exist_ok=True)
        args = ["daemon", "--peers", peers, "--node-rank", str(node), "--token-file", str(token),
                "--replication-factor", "1", "--replication-scan-interval", "0.5"]
        if node == 0:
            args += ["--replication-bandwidth", str(bandwidth)]
        with open(dirs[node] / "daemon.log", "ab") as log:
            # PYTHONFAULTHANDLER: a daemon that will not stop is sent SIGABRT, which prints every thread's stack.
            procs[node] = subprocess.Popen(rlsup_cmd(*args), cwd=dirs[node], env=sandbox_env(sb, PYTHONFAULTHANDLER="1"),
                                           stdout=log, stderr=subprocess.STDOUT)
        tracker.add_root(procs[node].pid)

        def up() -> bool:
            try:
                info = json.loads((dirs[node] / ".rlsup" / "daemon.json").read_text())
            except (OSError, ValueError):
                return procs[node].poll() is not None
            return info.get("pid") == procs[node].pid
        wait_for(up, 60, f"daemon {node} up")
        if procs[node].poll() is not None:
            raise AssertionError(f"daemon {node} exited {procs[node].returncode}: "
                                 f"{(dirs[node] / 'daemon.log').read_text(errors='replace')[-2000:]}")

    def replica_ok(step: int) -> bool:
        """Node 1 holds node 0's part of ``step`` whole: valid, and byte-identical to the source files."""
        part = _valid_part(ns_dir / step_dir_name(step), 0)
        if part is None:
            return False
        src = read_manifest(dirs[0] / "checkpoints" / step_dir_name(step) / manifest_name(0))
        return part.manifest.files == src.files

    def torn_files(step: int) -> list[str]:
        """Files of the replica under their final names whose bytes differ from the source's."""
        src = read_manifest(dirs[0] / "checkpoints" / step_dir_name(step) / manifest_name(0))
        out = []
        d = ns_dir / step_dir_name(step)
        for name, entry in src.files.items():
            if (d / name).exists() and hash_file(d / name) != entry:
                out.append(name)
        return out

    try:
        start(0)
        start(1)
        client = PeerClient(f"127.0.0.1:{ports[1]}", load_secret(str(token)), timeout=5, retries=2, backoff=0.1)
        mgr = CheckpointManager(dirs[0] / "checkpoints")
        gen = torch.Generator().manual_seed(seed)
        mgr.save(1, {"w": torch.randn(1000, generator=gen)})
        wait_for(lambda: replica_ok(1), 60, "the first (small) replica on node 1")
        step = 1
        for victim in victims:
            fault = Fault("daemon_kill", f"{victim}_mid_transfer")
            res.faults.append(fault)
            node = 0 if victim == "sender" else 1
            caught = False
            for _try in range(3):
                step += 1
                mgr.save(step, {"w": torch.randn(mb * 2**18, generator=gen)})
                try:
                    wait_for(lambda: os.listdir(incoming), 60, f"step {step}'s upload to start",
                             interval=0.02)  # the capped push lasts about 2 s
                except Deadline:
                    break
                if freeze(procs[node].pid):
                    if os.listdir(incoming) and not replica_ok(step):
                        caught = True
                        break
                    thaw(procs[node].pid)
            if not caught:
                fault.note = "no transfer in flight was caught"
                res.problems.append(f"daemon_kill@{victim}: {fault.note}")
                continue
            before = {s for s, d in list_step_dirs(ns_dir) if _valid_part(d, 0) is not None}
            partial = set(os.listdir(incoming))
            fault.hit, fault.valid_before = True, before  # replica steps (no training step is lost here)
            fault.note = f"{victim} killed with step {step} in flight ({len(partial)} temp file(s) on node 1)"
            os.kill(procs[node].pid, signal.SIGKILL)
            procs[node].wait(timeout=30)
            fault.injected = True
            res.check(check_no_survivors(tracker, timeout=20))
            # Never a partial replica: no valid part, no torn file under a final name, older ones intact.
            res.check([f"{fault.note}: the partial part of step {step} verifies on node 1"]
                      if _valid_part(ns_dir / step_dir_name(step), 0) is not None else [])
            res.check([f"{fault.note}: torn file(s) under final names on node 1: {torn_files(step)}"]
                      if torn_files(step) else [])
            res.check([f"{fault.note}: older replica of step {s} no longer valid" for s in sorted(before)
                       if _valid_part(ns_dir / step_dir_name(s), 0) is None])
            if victim == "sender":
                # The receiver saw the connection drop mid-body: it discards the temp file and stays healthy.
                try:
                    wait_for(lambda: not (set(os.listdir(incoming)) & partial), 20,
                             "the receiver to drop the partial upload")
                except Deadline as e:
                    res.problems.append(f"{fault.note}: {e}")
                try:
                    ok = client.health().get("ok") is True
                except Exception as e:
                    ok, fault.note = False, fault.note + f" (health: {e})"
                res.check([] if ok else [f"{fault.note}: the receiver is unhealthy after the sender died"])
            start(node)
            if victim == "receiver":
                try:  # the reopened store removes what the killed process left in .incoming
                    wait_for(lambda: not (set(os.listdir(incoming)) & partial), 20,
                             "the reopened store to remove the killed upload's temp file")
                except Deadline as e:
                    res.problems.append(f"{fault.note}: {e}")
            try:
                wait_for(lambda: replica_ok(step), 90, f"step {step} replicated whole after the restart", interval=0.1)
            except Deadline as e:
                res.problems.append(f"{fault.note}: {e}")
            src_dir = dirs[0] / "checkpoints" / step_dir_name(step)
            try:
                wait_for(lambda: not any(n.startswith(".hold-") for n in os.listdir(src_dir)), 20,
                         f"the replication hold on node 0's step {step} to go")
            except Deadline as e:
                res.problems.append(f"{fault.note}: {e}")
        # Every replica node 1 holds is whole, and nothing is left in flight.
        res.check([f"step {s}: replica not whole at the end" for s, _ in list_step_dirs(ns_dir) if not replica_ok(s)])
        try:
            wait_for(lambda: not os.listdir(incoming), 20, "node 1's .incoming to be empty at the end")
        except Deadline as e:
            res.problems.append(str(e))
        for proc in procs.values():
            proc.send_signal(signal.SIGTERM)
        codes = {}
        stop_deadline = time.monotonic() + 90  # systemd's default TimeoutStopSec
        for node, proc in procs.items():
            try:
                codes[node] = proc.wait(timeout=max(0.1, stop_deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGABRT)  # faulthandler: the stacks go to its daemon.log
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                codes[node] = "still running 90 s after SIGTERM"
                stacks = (dirs[node] / "daemon.log").read_text(errors="replace")
                i = stacks.rfind("Fatal Python error")
                res.problems.append(f"daemon {node} did not stop within 90 s of SIGTERM; its threads:\n"
                                    f"{stacks[i:][:6000] if i >= 0 else '(no stack dump)'}")
        res.check([] if codes == {0: 0, 1: 0} else [f"daemons exited {codes} after SIGTERM"])
        res.check(check_no_survivors(tracker))
        res.check(check_no_writes_outside(sb, {"node0", "node1", "token"}))
    except Exception as e:
        res.problems.append(f"{type(e).__name__}: {e}")
    finally:
        if client is not None:
            client.close()
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        tracker.stop()
        res.log = "\n".join(f"--- node {n} daemon ---\n" + (d / "daemon.log").read_text(errors="replace")[-4000:]
                            for n, d in enumerate(dirs) if (d / "daemon.log").exists())
        res.seconds = time.monotonic() - started
    return res


# ------------------------------------------------------------------ (b) replacement killed mid-fetch


def fetch_kill_scenario(parent: Path, ref_cache: Path, seed: int, kills: int = 1, steps: int = STEPS,
                        bandwidth: float = 2e6, rendezvous_timeout: float = 20.0) -> ScenarioResult:
    """Node 1 of a 2-node job is lost; its replacement is SIGKILLed ``kills`` times while fetching its parts
    from node 0 (round prepare), then started again: the job resumes and ends bit-identical."""
    started = time.monotonic()
    res = ScenarioResult("mn_fetch", seed)
    sb = Sandbox(parent)
    # The kill scenarios' arguments (their 2-rank reference is shared); keep_last 100: with node-local
    # directories each node holds only its own parts, and rank 0's retention needs a whole step.
    args = train_args(steps=steps, keep_last=100)
    ref = reference_weights(ref_cache, 2, args)
    cluster = Cluster(sb.run, 2, "static", ["--startup-timeout", "120"], args, env=sandbox_env(sb),
                      rendezvous_timeout=rendezvous_timeout, secret=SECRET_TEXT,
                      warm_launcher=True)  # the chaos runs keep rlsup's defaults: the faults users meet
    peers = cluster.peers
    node_dir = [cluster.node_dir(0), cluster.node_dir(1)]
    procs = cluster.procs
    trackers: list[ProcessTracker] = []
    generation = [0, 0]
    logs: list[Path] = []

    def start(node: int, extra: Sequence[str] = ()) -> subprocess.Popen:
        """Node ``node``'s supervisor, each start with its own log and a tracker of its process tree."""
        log_name = f"rlsup.{generation[node]}.log"
        generation[node] += 1
        logs.append(node_dir[node] / log_name)
        proc = cluster.start(node, extra, log_name=log_name)
        tracker = ProcessTracker(node_dir[node] / ".rlsup").start()
        tracker.add_root(proc.pid)
        trackers.append(tracker)
        return proc

    def fetching(d: Path) -> list[str]:
        """A fetch in progress in node 1's checkpoint dir: a data file partially received (a reserved TMP
        name beside where the file goes, rlsup_format.names; the manifest comes only after every file)."""
        out = []
        for _, sd in list_step_dirs(d):
            try:
                names = os.listdir(sd)
            except OSError:
                continue
            if any((res := parse_reserved(n)) is not None and res.kind is Kind.TMP and res.label.startswith("rank_")
                   for n in names):
                out += [f"{sd.name}/{n}" for n in names if n.startswith(".")]
        return out

    try:
        start(0)
        start(1)
        replica_root = node_dir[0] / "replicas" / namespace_of(default_job(peers), 1)

        def replicated() -> int | None:
            for s, d in reversed(list_step_dirs(replica_root)):
                if _valid_part(d, 1) is not None:
                    return s
            return None
        lost_at = wait_for(lambda: any(p.poll() is not None for p in procs.values()) or replicated(), 240,
                           "a node-1 part replicated to node 0")
        if lost_at is True:
            raise AssertionError(f"a node ended early: {[p.returncode for p in procs.values()]}")
        # Node 1 is lost: its whole process tree at once, then its disk.
        loss = Fault("node_loss", "after_replication")
        res.faults.append(loss)
        killed = kill_tree(procs[1].pid)
        procs[1].wait(timeout=30)
        loss.injected = loss.hit = True
        loss.note = (f"node 1 lost after its step {lost_at} part reached node 0 ({len(killed)} processes, "
                     f"t={time.monotonic() - started:.0f}s)")
        res.check(check_no_survivors(trackers[-1]))
        os.rename(node_dir[1], sb.run / "node1.lost")
        logs[:] = [sb.run / "node1.lost" / p.name if p.parent == node_dir[1] else p for p in logs]
        for i in range(kills):
            fault = Fault("supervisor_kill", "mid_fetch")
            res.faults.append(fault)
            proc = start(1, ["--replication-bandwidth", str(bandwidth)])
            ckpt1 = node_dir[1] / "checkpoints"
            caught = None
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and proc.poll() is None and procs[0].poll() is None:
                if fetching(ckpt1) and freeze(proc.pid):
                    caught = fetching(ckpt1)
                    if caught:
                        break
                    thaw(proc.pid)
                time.sleep(0.02)  # the capped fetch of a 6 MB part lasts about 3 s
            if not caught:
                fault.note = "the replacement's fetch was never caught"
                res.problems.append(fault.note)
                break
            fault.hit = True
            fault.note = f"replacement #{i + 1} killed mid-fetch (t={time.monotonic() - started:.0f}s): {caught}"
            kill_tree(proc.pid)
            proc.wait(timeout=30)
            fault.injected = True
            res.check(check_no_survivors(trackers[-1]))
            partial = [s for s, d in list_step_dirs(ckpt1) if _valid_part(d, 1) is not None]
            res.check([f"{fault.note}: step(s) {partial} verify on node 1 after a killed fetch"] if partial else [])
        # uncapped: the fetch completes; no fault follows, so this last start arms no warm launcher nothing would use
        start(1, NO_WARM_LAUNCHER)
        codes = {}
        for node in (0, 1):
            try:
                codes[node] = procs[node].wait(timeout=240)
            except subprocess.TimeoutExpired:
                codes[node] = "timeout"
        res.check([] if codes == {0: 0, 1: 0} else [f"nodes exited {codes} (expected 0 and 0) at "
                                                    f"t={time.monotonic() - started:.0f}s"])
        res.check(check_weights(node_dir[0] / cluster.out_name, ref))
        inc0 = incidents(node_dir[0] / ".rlsup")
        resumed = [i["resumed_step"] for i in inc0 if i.get("resumed_step") is not None]
        res.check([] if resumed and resumed[-1] >= lost_at else
                  [f"node 0 resumed from {resumed}, expected a step >= {lost_at} (replicated before the loss)"])
        res.restarts = len([i for i in inc0 if i.get("action") == "restart"])
        res.check(check_no_temp_copies(node_dir[1] / "checkpoints", node_dir[0] / "checkpoints"))
        for t in trackers:
            res.check(check_no_survivors(t))
        res.check(check_no_writes_outside(sb, {"node0", "node1", "node1.lost", "token"}))
    except Exception as e:
        res.problems.append(f"{type(e).__name__}: {e}")
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                kill_tree(proc.pid)
                proc.wait()
        for t in trackers:
            for pid in t.alive():
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            t.stop()
        res.log = "\n".join(f"--- {p.parent.name}/{p.name} ---\n" + p.read_text(errors="replace")[-3000:]
                            for p in logs if p.exists())
        res.seconds = time.monotonic() - started
    return res
