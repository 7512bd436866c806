"""Chaos scenarios, usable from pytest (fixed seeds) and from the soak driver (random seeds).

Each scenario returns a :class:`ScenarioResult`; ``result.problems`` lists every violated invariant.
"""

from __future__ import annotations

import os
import random
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from support.incidents import incidents
from support.procs import rlsup_cmd
from support.waits import wait_for

from .common import (STEPS, Sandbox, copy_reference_steps, launcher, reference_checkpoints, reference_weights,
                     sandbox_env, train_args)
from .injector import Fault, FaultInjector, SupervisedRun
from .invariants import (check_incidents, check_no_leftovers, check_no_survivors, check_no_writes_outside,
                         check_valid_not_lost, check_weights, valid_steps)

ALLOWED_TOP = {"checkpoints", ".rlsup", "final.pt", "rlsup.0.log", "rlsup.1.log", "rlsup.2.log", "rlsup.3.log",
               "rlsup.4.log", "rlsup.5.log", "rlsup.6.log", "rlsup.7.log", "rlsup.8.log", "rlsup.9.log"}


@dataclass
class ScenarioResult:
    name: str
    seed: int
    faults: list[Fault] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    restarts: int = 0
    invariant_checks: int = 0
    seconds: float = 0.0
    log: str = ""

    @property
    def steps_lost(self) -> int:
        return sum(f.steps_lost for f in self.faults)

    def check(self, problems: list[str]) -> None:
        self.invariant_checks += 1
        self.problems += problems

    def summary(self) -> str:
        kinds = ", ".join(f"{f.kind}@{f.moment}{'' if f.hit or f.moment == 'random' else '(missed)'}"
                          f"{'' if f.injected else '(skipped)'}" for f in self.faults)
        return (f"{self.name} seed={self.seed}: faults [{kinds}] restarts={self.restarts} steps_lost={self.steps_lost} "
                f"invariant_checks={self.invariant_checks} problems={len(self.problems)} {self.seconds:.1f}s")


def kill_scenario(parent: Path, ref_cache: Path, seed: int, world: int, plan: list[tuple[str, str]] | None = None,
                  n_faults: int = 4, steps: int = STEPS, keep_last: int = 2, heartbeat_timeout: float = 6.0,
                  name: str = "kill", require_injected: bool = True) -> ScenarioResult:
    """Supervised training with faults at chosen (or random) moments; all invariants checked at the end."""
    started = time.monotonic()
    res = ScenarioResult(f"{name}-w{world}", seed)
    sb = Sandbox(parent)
    args = train_args(steps=steps, keep_last=keep_last)
    ref = reference_weights(ref_cache, world, args)
    rlsup_args = ["--backoff-initial", "0.05", "--backoff-max", "0.2", "--max-restarts", "50",
                  "--heartbeat-timeout", str(heartbeat_timeout), "--kill-grace", "2", "--startup-timeout", "120",
                  # A rank SIGSTOPped inside a save/load section is held to save_timeout, not the heartbeat
                  # timeout (saves are not hangs): keep it short so such a stop is caught in time.
                  "--save-timeout", "15"]
    run = SupervisedRun(sb, [*launcher(world), *args, "--out", str(sb.run / "final.pt")], rlsup_args)
    inj = FaultInjector(run, world, steps, seed)
    plan = plan if plan is not None else inj.random_plan(n_faults)
    try:
        run.start()
        for i, (kind, moment) in enumerate(plan):
            inj.inject(kind, moment, last=i == len(plan) - 1)
        code = run.wait_exit(timeout=600)
        run.tracker.sample()
        res.faults = inj.faults
        if code != 0:
            res.problems.append(f"rlsup exited {code}")
        res.check(run.survivor_problems)
        res.check(check_no_survivors(run.tracker))
        res.check(check_weights(sb.run / "final.pt", ref))
        res.check(check_valid_not_lost([f.valid_before for f in inj.faults], sb.ckpt, keep_last))
        res.check(check_no_writes_outside(sb, ALLOWED_TOP))
        res.check(check_incidents(sb.state, inj.faults))
        res.check(check_no_leftovers(sb.ckpt))
        # A fault that was never injected proves nothing: the plan must have been carried out.
        # A fault that was never injected proves nothing: a fixed plan must be carried out; a random
        # (soak) plan may run out of training for its last faults, but never for all of them.
        res.check([f"fault {f.kind}@{f.moment} not injected: {f.note}" for f in inj.faults
                   if not f.injected and require_injected])
        res.check([] if any(f.injected for f in inj.faults) else ["no fault of the plan was injected"])
        res.restarts = len([i for i in incidents(sb.state) if i.get("action") == "restart"])
    except Exception as e:  # a Deadline or a crash of the harness is a failed scenario, with the logs
        res.problems.append(f"{type(e).__name__}: {e}")
        res.faults = inj.faults
    finally:
        run.kill_all()
        run.tracker.stop()
        res.log = run.log_tail()
        res.seconds = time.monotonic() - started
    return res


# ------------------------------------------------------------------ disk full


def mount_small_fs(path: Path, size_mb: int) -> str:
    """Mount a small tmpfs (else a loop ext4 image) at ``path``; returns '' or why neither works."""
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(path)],
                       capture_output=True, text=True)
    if r.returncode == 0:
        return ""
    why = f"mount -t tmpfs: {r.stderr.strip() or r.returncode}"
    img = path.parent / f".{path.name}.img"
    try:
        subprocess.run(["truncate", "-s", f"{size_mb}M", str(img)], check=True, capture_output=True)
        subprocess.run(["mkfs.ext4", "-q", "-F", str(img)], check=True, capture_output=True)
        r = subprocess.run(["mount", "-o", "loop", str(img), str(path)], capture_output=True, text=True)
        if r.returncode == 0:
            return ""
        why += f"; mount -o loop ext4: {r.stderr.strip()}"
    except (OSError, subprocess.CalledProcessError) as e:
        why += f"; loop ext4 image: {e}"
    return why


def unmount(path: Path) -> None:
    subprocess.run(["umount", "-l", str(path)], capture_output=True)


def resize_fs(path: Path, size_mb: int) -> bool:
    return subprocess.run(["mount", "-o", f"remount,size={size_mb}m", str(path)], capture_output=True).returncode == 0


class ValidPoller:
    """Records every step seen valid (sizes) while a run goes on: the 'valid before the fault' set."""

    def __init__(self, ckpt: Path) -> None:
        import threading

        self.ckpt = ckpt
        self.seen: set[int] = set()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._loop, daemon=True)
        self._t.start()

    def _loop(self) -> None:
        while not self._stop.wait(0.1):
            self.seen |= valid_steps(self.ckpt, full=False)

    def stop(self) -> set[int]:
        self._stop.set()
        self._t.join(5)
        return {s for s in self.seen}


def disk_full_scenario(parent: Path, ref_cache: Path, seed: int, size_mb: int = 5) -> ScenarioResult:
    """The checkpoint filesystem fills up mid-run: saves fail loudly, rlsup stops with 76 (no progress),
    older valid checkpoints survive, no partial files stay; with space back, a new rlsup finishes exactly."""
    started = time.monotonic()
    res = ScenarioResult("disk_full", seed)
    sb = Sandbox(parent)
    why = mount_small_fs(sb.ckpt, size_mb)
    if why:
        res.problems.append(f"SKIP: cannot mount a small filesystem: {why}")
        return res
    args = train_args(keep_last=2, ballast_mb=2)
    ref = reference_weights(ref_cache, 1, args)
    # One attempt without progress ends it: the first fills the disk after saving some steps, the second resumes
    # and fails the same save; a third doing the same would only cost another rank's start.
    rlsup_args = ["--backoff-initial", "0.05", "--backoff-max", "0.2", "--max-restarts", "10",
                  "--max-no-progress-attempts", "1", "--heartbeat-timeout", "60", "--kill-grace", "2"]
    run = SupervisedRun(sb, [*launcher(1), *args, "--out", str(sb.run / "final.pt")], rlsup_args)
    poller = ValidPoller(sb.ckpt)
    try:
        run.start()
        code = run.wait_exit(timeout=300)
        seen = poller.stop()
        res.check([] if code == 76 else [f"disk full: rlsup exited {code}, expected 76 (no progress)"])
        inc = incidents(sb.state)
        # torch hides errno behind "iostream error" / "unexpected pos"; the error is loud, if not explicit.
        enospc = ("No space left", "iostream error", "unexpected pos", "ENOSPC", "Errno 28")
        res.check([] if any(any(m in "\n".join(i.get("output_tail", [])) for m in enospc) for i in inc)
                  else [f"no incident shows the ENOSPC failure: {[i['reason'] for i in inc]}"])
        res.check([] if seen else ["no checkpoint was ever valid before the disk filled"])
        res.check(check_valid_not_lost([seen], sb.ckpt, 2))
        res.check(check_no_leftovers(sb.ckpt))
        # Files of the failed saves: nothing but complete, manifest-listed parts may stay.
        stray = []
        for step_dir in sorted(sb.ckpt.glob("step_*")):
            names = set(os.listdir(step_dir))
            if not any(n.startswith("manifest.") for n in names) and names:
                stray.append(f"{step_dir.name}: {sorted(names)}")
        res.check([f"partial files of a failed save left behind: {stray}"] if stray else [])
        res.check(check_no_survivors(run.tracker))
        res.restarts = len([i for i in inc if i.get("action") == "restart"])
        # Space comes back: the next rlsup resumes from the newest valid step and ends exactly.
        if not resize_fs(sb.ckpt, 64):
            res.problems.append("could not grow the filesystem again")
        else:
            run.start()
            code = run.wait_exit(timeout=300)
            res.check([] if code == 0 else [f"after space came back rlsup exited {code}"])
            res.check(check_weights(sb.run / "final.pt", ref))
            res.check(check_valid_not_lost([seen], sb.ckpt, 2))
        res.check(check_no_survivors(run.tracker))
        res.check(check_no_writes_outside(sb, ALLOWED_TOP))
        res.faults = [Fault("disk_full", "save", injected=True, hit=True, valid_before=seen)]
    except Exception as e:
        res.problems.append(f"{type(e).__name__}: {e}")
    finally:
        poller.stop()
        run.kill_all()
        run.tracker.stop()
        res.log = run.log_tail()
        unmount(sb.ckpt)
        res.seconds = time.monotonic() - started
    return res


# ------------------------------------------------------------------ corruption and hostile manifests

DAMAGES = ("bitflip", "truncate", "extend", "torn_manifest", "zero_block", "drop_manifest")


def damage_step(step_dir: Path, kind: str, rng: random.Random) -> str:
    data_files = sorted(p for p in step_dir.iterdir() if p.is_file() and p.name.startswith("rank_"))
    victim = rng.choice(data_files)
    if kind == "bitflip":
        b = bytearray(victim.read_bytes())
        i = rng.randrange(len(b))
        b[i] ^= 1 << rng.randrange(8)
        victim.write_bytes(bytes(b))
        return f"{victim.name}: bit flipped at byte {i}"
    if kind == "truncate":
        n = victim.stat().st_size
        cut = rng.randrange(n)
        os.truncate(victim, cut)
        return f"{victim.name}: truncated {n} -> {cut}"
    if kind == "extend":
        with open(victim, "ab") as f:
            f.write(b"\0" * rng.randint(1, 4096))
        return f"{victim.name}: bytes appended"
    if kind == "zero_block":
        b = bytearray(victim.read_bytes())
        i = rng.randrange(len(b))
        n = min(4096, len(b) - i)
        # The ballast is zeros already: overwrite with 0xFF there, so the bytes really change.
        b[i:i + n] = bytes(n) if any(b[i:i + n]) else b"\xff" * n
        victim.write_bytes(bytes(b))
        return f"{victim.name}: zeroed {n} bytes at {i}"
    manifest = sorted(step_dir.glob("manifest.rank_*.json"))[0]
    if kind == "torn_manifest":
        text = manifest.read_bytes()
        os.truncate(manifest, rng.randrange(1, len(text)))
        return f"{manifest.name}: torn"
    if kind == "drop_manifest":
        manifest.unlink()
        return f"{manifest.name}: removed"
    raise ValueError(kind)


def hostile_manifest_steps(sb: Sandbox, ckpt: Path, template_step: Path, first: int) -> list[int]:
    """Step dirs newer than everything, whose manifests name files outside the step dir (``../``,
    absolute, a symlinked parent) with the right size and checksum of real files there: were a path
    followed, the step would verify. The traversal target in the sentinel parent is a FIFO: opening it
    for reading would block the verifier (caught by the caller's timeout)."""
    import json

    from rlsup_format.manifest import hash_file, manifest_name, step_dir_name

    fifo = sb.parent / "fifo-trap"
    if not fifo.exists():
        os.mkfifo(fifo)
        sb.parent_snapshot[os.path.relpath(fifo, sb.parent)] = ("f", 0, fifo.lstat().st_mtime_ns)
    manifest = json.loads((template_step / manifest_name(0)).read_text())
    (name, entry), = [(n, e) for n, e in manifest["files"].items()]
    real = template_step / name
    depth = len(ckpt.relative_to(sb.parent).parts) + 1
    hostile = {
        "dotdot_sentinel": ("../" * depth + "sentinel.txt", hash_file(sb.sentinel)),
        "dotdot_fifo": ("../" * depth + "fifo-trap", None),
        "dotdot_real_shard": (f"../{template_step.name}/{name}", hash_file(real)),
        "absolute": (str(real.resolve()), hash_file(real)),
        "inner_dotdot": (f"sub/../../{template_step.name}/{name}", hash_file(real)),
        "backslash": (f"..\\{template_step.name}\\{name}", hash_file(real)),
    }
    steps = []
    for i, (_label, (path, fe)) in enumerate(hostile.items()):
        step = first + i
        d = ckpt / step_dir_name(step)
        d.mkdir()
        m = dict(manifest, step=step)
        m["files"] = {path: {"size": fe.size if fe else 0, "xxh3_128": fe.xxh3_128 if fe else "0" * 32}}
        (d / manifest_name(0)).write_text(json.dumps(m))
        steps.append(step)
    return steps


def corruption_scenario(parent: Path, ref_cache: Path, seed: int, n_damaged: int = 3) -> ScenarioResult:
    """Bit flips, truncations and torn manifests in the newest checkpoints, plus hostile manifests
    newer than all: rlsup resumes from the newest intact step and ends bit-identical; nothing outside
    the checkpoint directory is read (a FIFO trap) or written."""
    started = time.monotonic()
    rng = random.Random(seed)
    res = ScenarioResult("corruption", seed)
    sb = Sandbox(parent)
    args = train_args(keep_last=100)
    ref = reference_weights(ref_cache, 1, args)
    run = None
    try:
        # The checkpoints a run killed after step `crash` leaves: the uninterrupted reference run's up to it
        # (the same bytes; no run of its own to crash).
        crash = rng.choice([16, 19, 22, 25])
        copy_reference_steps(reference_checkpoints(ref_cache, 1, args), sb.ckpt, crash)
        before = sorted(valid_steps(sb.ckpt))
        damaged = before[-n_damaged:]
        notes = [f"step {s}: " + damage_step(sb.ckpt / f"step_{s:09d}", rng.choice(DAMAGES), rng) for s in damaged]
        expected = before[-n_damaged - 1]
        hostile = hostile_manifest_steps(sb, sb.ckpt, sb.ckpt / f"step_{expected:09d}", 900)
        res.faults = [Fault("corrupt", n, injected=True, hit=True, step=crash, valid_before=set(before)) for n in notes]
        res.faults += [Fault("hostile_manifest", f"step {s}", injected=True, hit=True) for s in hostile]
        # Selection, as the CLI sees it (a blocked open of the FIFO would hit the timeout).
        for s in damaged:
            from rlsup_format.manifest import verify_step_dir

            res.check([f"damaged step {s} still verifies ({notes})"] if verify_step_dir(sb.ckpt / f"step_{s:09d}").valid
                      else [])
        r = subprocess.run(rlsup_cmd("checkpoints", "latest", str(sb.ckpt)), cwd=sb.run, env=sandbox_env(sb),
                           capture_output=True, text=True, timeout=120)
        res.check([] if r.stdout.strip().endswith(f"step_{expected:09d}")
                  else [f"rlsup checkpoints latest chose {r.stdout[:300]!r} {r.stderr[-500:]}, expected step {expected}"])
        for s in hostile:
            from rlsup_format.manifest import verify_step_dir

            v = verify_step_dir(sb.ckpt / f"step_{s:09d}")
            res.check([f"hostile step {s} verified valid"] if v.valid else [])
        run = SupervisedRun(sb, [*launcher(1), *args, "--out", str(sb.run / "final.pt")],
                            ["--backoff-initial", "0.05", "--heartbeat-timeout", "60"])
        run.start()
        code = run.wait_exit(timeout=300)
        res.check([] if code == 0 else [f"rlsup exited {code}"])
        inc = incidents(sb.state)
        res.check([] if not inc else [f"unexpected incidents: {[i['reason'] for i in inc]}"])
        out = (sb.run / "rlsup.0.log").read_text(errors="replace")
        res.check([] if f"from step {expected} " in out else [f"did not resume from step {expected}: {out[:600]}"])
        res.check(check_weights(sb.run / "final.pt", ref))
        res.check(check_no_survivors(run.tracker))
        res.check(check_no_writes_outside(sb, ALLOWED_TOP))
    except Exception as e:
        res.problems.append(f"{type(e).__name__}: {e}")
    finally:
        if run is not None:
            run.kill_all()
            run.tracker.stop()
            res.log = run.log_tail()
        res.seconds = time.monotonic() - started
    return res


# ------------------------------------------------------------------ clock jumps

def build_walljump(out_dir: Path) -> tuple[str | None, str]:
    """Compile tests/chaos/walljump.c (an LD_PRELOAD wall-clock shifter); (path, '') or (None, why)."""
    import shutil as _sh

    cc = _sh.which("cc") or _sh.which("gcc")
    if cc is None:
        return None, "no C compiler to build the wall-clock shim (libfaketime 0.9.10 cannot be used: with " \
                     "DONT_FAKE_MONOTONIC=1 its clock_nanosleep fails with EINVAL, so Python's time.sleep raises)"
    out = out_dir / "walljump.so"
    r = subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", str(out), str(Path(__file__).with_name("walljump.c")),
                        "-ldl"], capture_output=True, text=True)
    if r.returncode != 0:
        return None, f"building walljump.so failed: {r.stderr[-500:]}"
    return str(out), ""


def clock_jump_scenario(parent: Path, ref_cache: Path, seed: int, jumps: int = 4) -> ScenarioResult:
    """The wall clock of rlsup AND its job jumps by hours, forwards and backwards (an LD_PRELOAD shim,
    CLOCK_MONOTONIC untouched, as with an NTP step), while training runs with a 3 s heartbeat timeout:
    no hang is detected, no incident, exact weights. The jumps are shown to be real in the manifests'
    timestamps (time.time() of the job)."""
    import json

    started = time.monotonic()
    rng = random.Random(seed)
    res = ScenarioResult("clock_jump", seed)
    sb = Sandbox(parent)
    lib, why = build_walljump(sb.tmp)
    if lib is None:
        res.problems.append(f"SKIP: {why}")
        return res
    rc = sb.run / "tmp" / "walljump.offset"
    rc.write_text("0\n")
    args = train_args(keep_last=100, ballast_mb=1, step_time=0.08)
    ref = reference_weights(ref_cache, 1, args)
    env = {"LD_PRELOAD": lib, "WALLJUMP_FILE": str(rc)}
    run = SupervisedRun(sb, [*launcher(1), *args, "--out", str(sb.run / "final.pt")],
                        ["--heartbeat-timeout", "3", "--backoff-initial", "0.05", "--kill-grace", "2"], env=env)
    try:
        run.start()
        offsets = []
        last = -1
        for _ in range(jumps):
            # Wait for training to progress past the previous jump, then jump by hours either way.
            def progressed():
                recs = run.ranks(0)
                return run.proc.poll() is not None or (recs and recs[0].step > last + 2 and recs[0].step)
            got = wait_for(progressed, 120, "training progress between clock jumps")
            if run.proc.poll() is not None:
                break
            last = got
            hours = rng.choice([-7, -3, 2, 5, 26])
            offsets.append(hours)
            rc.write_text(f"{hours * 3600}\n")
            res.faults.append(Fault("clock_jump", f"{hours:+d}h", injected=True, hit=True, step=got))
        code = run.wait_exit(timeout=300)
        res.check([] if code == 0 else [f"rlsup exited {code}"])
        inc = incidents(sb.state)
        res.check([] if not inc else [f"clock jumps caused incidents: {[(i['reason'], i.get('detail')) for i in inc]}"])
        res.check(check_weights(sb.run / "final.pt", ref))
        # The job really saw the jumps: manifest timestamps are hours away from the real clock.
        created = [json.loads(p.read_text())["created"] for p in sb.ckpt.glob("step_*/manifest.rank_00000.json")]
        off = max((abs(c - time.time()) for c in created), default=0)
        res.check([] if not offsets or off > 3600 else [f"the wall-clock jump was not visible to the job ({off:.0f}s)"])
        res.check(check_no_survivors(run.tracker))
        res.check(check_no_writes_outside(sb, ALLOWED_TOP))
    except Exception as e:
        res.problems.append(f"{type(e).__name__}: {e}")
    finally:
        run.kill_all()
        run.tracker.stop()
        res.log = run.log_tail()
        res.seconds = time.monotonic() - started
    return res


# ------------------------------------------------------------------ hostile network

SECRET = b"chaos-secret-chaos-secret-chaos!"


def hostile_peer_scenario(parent: Path, seed: int, modes: tuple[str, ...] | None = None) -> ScenarioResult:
    """A peer that returns wrong bytes, lies about checksums or lengths, stalls or drops mid-stream, or
    answers garbage: every fetch fails with TransportError in bounded time, the destination never
    appears (not even partially), no temp file stays, nothing outside the checkpoint dir is written."""
    from supervisor.transport.client import PeerClient, TransportError
    from rlsup_format.manifest import FileEntry

    from .hostile import PEER_MODES, HostilePeer

    started = time.monotonic()
    rng = random.Random(seed)
    res = ScenarioResult("hostile_peer", seed)
    sb = Sandbox(parent)
    content = rng.randbytes(rng.randint(64 << 10, 512 << 10))
    import xxhash

    entry = FileEntry(len(content), xxhash.xxh3_128_hexdigest(content))
    step_dir = sb.ckpt / "step_000000003"
    step_dir.mkdir(parents=True)
    for mode in modes or PEER_MODES:
        peer = HostilePeer(mode, content, seed=rng.randrange(1 << 30))
        client = PeerClient(peer.endpoint, SECRET, timeout=2, retries=1, backoff=0.05)
        dest = step_dir / "rank_00002.pt"
        outcome: dict = {}

        def work() -> None:
            try:
                if mode == "index_lies":
                    outcome["value"] = client.index("node2")
                else:
                    outcome["value"] = client.fetch_file("node2", "step_000000003/rank_00002.pt", dest, entry)
            except TransportError as e:
                outcome["error"] = e
            except Exception as e:  # anything but TransportError is a contract violation
                outcome["unexpected"] = e

        import threading

        t0 = time.monotonic()
        t = threading.Thread(target=work, daemon=True)
        t.start()
        t.join(6)
        if t.is_alive():
            # A peer that keeps trickling bytes is never "stalled": documented (timeout bounds stalls,
            # not whole transfers). Cut it off; the client must then fail cleanly.
            note = f"{mode}: fetch still running after 6s (no overall deadline / minimum rate)"
            peer.close()
            t.join(30)
            res.faults.append(Fault("hostile_peer", mode, injected=True, hit=True, note=note))
            if t.is_alive():
                res.problems.append(f"{mode}: fetch hung even after the peer closed")
        else:
            res.faults.append(Fault("hostile_peer", mode, injected=True, hit=True))
        took = time.monotonic() - t0
        res.check([f"{mode}: unexpected {type(outcome['unexpected']).__name__}: {outcome['unexpected']}"]
                  if "unexpected" in outcome else [])
        res.check([f"{mode}: the hostile answer was accepted: {outcome.get('value')}"] if "value" in outcome else [])
        res.check([f"{mode}: {dest.name} appeared"] if dest.exists() else [])
        leftovers = [n for n in os.listdir(step_dir)]
        res.check([f"{mode}: files left in the step dir: {leftovers}"] if leftovers else [])
        res.faults[-1].note += f" ({took:.1f}s: {outcome.get('error', '')})"[:300]
        client.close()
        peer.close()
    res.check(check_no_writes_outside(sb, {"checkpoints"}))
    res.seconds = time.monotonic() - started
    return res


def hostile_client_scenario(parent: Path, seed: int) -> ScenarioResult:
    """No auth, bad auth, traversal (signed!), huge headers, slowloris, random bytes, a connection flood:
    the replication daemon stays up, answers every healthy request, and stores nothing but what
    authenticated peers sent, inside its root."""
    from supervisor.transport.auth import auth_headers
    from supervisor.transport.client import PeerClient
    from supervisor.transport.server import ReplicationServer
    from supervisor.transport.store import ReplicaStore
    from rlsup_format.manifest import FileEntry

    from .hostile import hostile_requests, send_raw

    started = time.monotonic()
    rng = random.Random(seed)
    res = ScenarioResult("hostile_client", seed)
    sb = Sandbox(parent)
    store = ReplicaStore(sb.run / "replicas")
    server = ReplicationServer(store, SECRET, header_timeout=1.5, request_timeout=3.0, max_connections=32,
                               max_file_bytes=64 << 20)
    port = server.start()
    client = PeerClient(f"127.0.0.1:{port}", SECRET, timeout=5, retries=2, backoff=0.1)
    try:
        import xxhash

        legit = sb.tmp / "legit.bin"
        legit.write_bytes(rng.randbytes(300_000))
        entry = FileEntry(legit.stat().st_size, xxhash.xxh3_128_hexdigest(legit.read_bytes()))
        client.push_file("node0", "step_000000001/rank_00000.pt", legit, entry)

        def signed(method: str, path: str, body: bytes, declare: int | None = None) -> bytes:
            cl = declare if declare is not None else (len(body) if method in ("PUT", "POST") else None)
            h = auth_headers(SECRET, method, path, cl, xxhash.xxh3_128_hexdigest(body) if method == "PUT" else None)
            lines = "".join(f"{k}: {v}\r\n" for k, v in h.items())
            return f"{method} {path} HTTP/1.1\r\nHost: x\r\n{lines}\r\n".encode() + body

        for label, data, drip in hostile_requests(rng, signed):
            answer = send_raw(port, data, drip)
            status = answer.split(b"\r\n", 1)[0][:60]
            ok_status = (not answer) or status.startswith(b"HTTP/1.1 4") or status.startswith(b"HTTP/1.0 4")
            if not ok_status:
                res.problems.append(f"{label}: answered {status!r}")
            res.faults.append(Fault("hostile_client", label, injected=True, hit=True, note=status.decode("latin-1")))
            if client.health().get("ok") is not True:
                res.problems.append(f"unhealthy after {label}")
        # Connection flood beyond max_connections, then everything closed: still serving.
        socks = []
        for _ in range(100):
            try:
                socks.append(__import__("socket").create_connection(("127.0.0.1", port), timeout=5))
            except OSError:
                break
        for s in socks:
            s.close()
        res.faults.append(Fault("hostile_client", "connection flood x100", injected=True, hit=True))
        wait_for(lambda: _healthy(client), 30, "the server to answer after the flood", interval=0.2)
        # The legit replica is intact and alone; nothing was written anywhere else.
        back = sb.tmp / "back.bin"
        client.fetch_file("node0", "step_000000001/rank_00000.pt", back, entry)
        res.check([] if back.read_bytes() == legit.read_bytes() else ["the stored replica changed"])
        idx = client.index("node0")
        res.check([] if set(idx) == {"step_000000001/rank_00000.pt"} else [f"unexpected stored files: {sorted(idx)}"])
        others = [p.name for p in (sb.run / "replicas").iterdir() if p.name not in ("node0", ".incoming", ".meta")]
        res.check([f"unexpected entries in the store root: {others}"] if others else [])
        res.check(wait_for(lambda: not os.listdir(sb.run / "replicas" / ".incoming"), 15, ".incoming to drain") and [])
        res.check(check_no_writes_outside(sb, {"replicas"}))
    except Exception as e:
        res.problems.append(f"{type(e).__name__}: {e}")
    finally:
        client.close()
        server.stop()
        store.close()
        res.seconds = time.monotonic() - started
    return res


def _healthy(client) -> bool:
    try:
        return client.health().get("ok") is True
    except Exception:
        return False


def replica_disk_full_scenario(parent: Path, seed: int) -> ScenarioResult:
    """The replica store's filesystem is full: an upload fails (5xx, retried, then TransportError), the
    replica stored before is intact, ``.incoming`` holds no partial file, the daemon stays healthy, and
    once space is back the same upload succeeds."""
    from supervisor.transport.client import PeerClient, TransportError
    from supervisor.transport.server import ReplicationServer
    from supervisor.transport.store import ReplicaStore
    from rlsup_format.manifest import FileEntry
    import xxhash

    started = time.monotonic()
    rng = random.Random(seed)
    res = ScenarioResult("replica_disk_full", seed)
    sb = Sandbox(parent)
    root = sb.run / "replicas"
    why = mount_small_fs(root, 2)
    if why:
        res.problems.append(f"SKIP: cannot mount a small filesystem: {why}")
        return res
    store = server = client = None
    try:
        store = ReplicaStore(root)
        server = ReplicationServer(store, SECRET, request_timeout=5.0)
        port = server.start()
        client = PeerClient(f"127.0.0.1:{port}", SECRET, timeout=5, retries=1, backoff=0.05)

        def make(name: str, size: int) -> tuple[Path, FileEntry]:
            p = sb.tmp / name
            p.write_bytes(rng.randbytes(size))
            return p, FileEntry(size, xxhash.xxh3_128_hexdigest(p.read_bytes()))

        small, e_small = make("small", 700_000)
        client.push_file("node1", "step_000000003/rank_00001.pt", small, e_small)
        big, e_big = make("big", 3_000_000)
        failed = False
        try:
            client.push_file("node1", "step_000000006/rank_00001.pt", big, e_big)
        except TransportError as e:
            failed = True
            res.faults.append(Fault("replica_disk_full", "upload", injected=True, hit=True, note=str(e)[:200]))
        res.check([] if failed else ["an upload larger than the free space succeeded"])
        # Overwriting the stored replica with bytes that do not fit must leave the old one intact.
        bigger, e_bigger = make("bigger", 2_500_000)
        try:
            client.push_file("node1", "step_000000003/rank_00001.pt", bigger, e_bigger)
            res.problems.append("overwrite larger than the free space succeeded")
        except TransportError:
            pass
        back = sb.tmp / "back"
        client.fetch_file("node1", "step_000000003/rank_00001.pt", back, e_small)
        res.check([] if back.read_bytes() == small.read_bytes() else ["the stored replica was damaged"])
        res.check(wait_for(lambda: not os.listdir(root / ".incoming"), 15, ".incoming to be cleaned") and [])
        res.check([] if _healthy(client) else ["daemon unhealthy after ENOSPC"])
        idx = client.index("node1")
        res.check([] if set(idx) == {"step_000000003/rank_00001.pt"} else [f"partial replica listed: {sorted(idx)}"])
        if resize_fs(root, 16):
            client.push_file("node1", "step_000000006/rank_00001.pt", big, e_big)
            res.check([] if client.index("node1").get("step_000000006/rank_00001.pt") == e_big
                      else ["upload failed after space came back"])
        res.check(check_no_writes_outside(sb, {"replicas"}))
    except Exception as e:
        res.problems.append(f"{type(e).__name__}: {e}")
    finally:
        if client is not None:
            client.close()
        if server is not None:
            server.stop()
        if store is not None:
            store.close()
        unmount(root)
        res.seconds = time.monotonic() - started
    return res


# ------------------------------------------------------------------ bad input


def bad_config_scenario(parent: Path, seed: int, n_random: int = 40) -> ScenarioResult:
    """Malformed YAML, wrong types, unknown keys, binary junk and seeded random mutations of a valid
    config: `rlsup config show` exits 0 or 2 (config error naming the problem), never a traceback."""
    import contextlib
    import io

    from supervisor.cli import main as cli

    started = time.monotonic()
    rng = random.Random(seed)
    res = ScenarioResult("bad_config", seed)
    sb = Sandbox(parent)
    valid = ("max_restarts: 5\nbackoff_initial: 0.5\nheartbeat_timeout: 30\nfatal_exit_codes: [13, 42]\n"
             "checkpoint_dir: ck\npeers: []\nresume: true\npreempt_signal: SIGUSR1\n")
    fixed = {
        "unclosed bracket": "fatal_exit_codes: [1, 2\n",
        "tab indentation": "max_restarts:\n\t- 3\n",
        "wrong type int": "max_restarts: lots\n",
        "wrong type list": "fatal_exit_codes: 13\n",
        "wrong type bool": "resume: maybe\n",
        "negative": "max_restarts: -4\n",
        "nan": "backoff_initial: .nan\n",
        "unknown key": "max_restart: 3\n",
        "top-level list": "- a\n- b\n",
        "binary": "\x00\xff\xfe garbage \x01",
        "anchors bomb": "a: &a [x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]\n"
                        "c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]\nd: [*c, *c, *c, *c, *c, *c, *c, *c, *c]\n",
        "python tag": "max_restarts: !!python/object/apply:os.system ['touch PWNED']\n",
        "huge int": "max_restarts: " + "9" * 5000 + "\n",
        "empty": "",
    }
    cases = list(fixed.items())
    alphabet = list(":-[]{},'\"#&*!|>%@` \t\n") + ["\x00", "\xff", "yes", "null", "1e999", "0x1F", "~"]
    for i in range(n_random):
        text = list(valid)
        for _ in range(rng.randint(1, 6)):
            pos = rng.randrange(len(text))
            op = rng.random()
            if op < 0.4:
                text.insert(pos, rng.choice(alphabet))
            elif op < 0.7:
                del text[pos]
            else:
                text[pos] = rng.choice(alphabet)
        cases.append((f"mutation #{i}", "".join(text)))
    for label, text in cases:
        path = sb.run / "cfg.yaml"
        path.write_bytes(text.encode("utf-8", "surrogateescape") if isinstance(text, str) else text)
        out, err = io.StringIO(), io.StringIO()
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                code = cli.main(["config", "show", "--config", str(path)])
        except SystemExit as e:
            code = e.code
        except Exception as e:
            res.problems.append(f"{label}: traceback {type(e).__name__}: {e} for {text[:80]!r}")
            continue
        if code not in (0, 2):
            res.problems.append(f"{label}: exit {code}: {err.getvalue()[-300:]}")
        elif code == 2 and "config error" not in err.getvalue():
            res.problems.append(f"{label}: exit 2 without a config error message: {err.getvalue()[-300:]}")
        if label in fixed and label not in ("empty",) and code != 2:
            res.problems.append(f"{label}: accepted (exit {code}): {out.getvalue()[:200]}")
        res.faults.append(Fault("bad_config", label, injected=True, hit=True, note=err.getvalue().strip()[-160:]))
    res.check([] if not (sb.run / "PWNED").exists() else ["a YAML python tag was executed"])
    res.check(check_no_writes_outside(sb, {"cfg.yaml"}))
    res.seconds = time.monotonic() - started
    return res
