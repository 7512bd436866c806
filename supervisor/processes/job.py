"""Launch one attempt of the job and make sure every process of it is gone afterwards.

The job runs in its own session (so one signal reaches its process group) with PR_SET_PDEATHSIG
(so it dies if rlsup is SIGKILLed). rlsup is a child subreaper, so grandchildren that daemonise or
lose their parent are re-parented to rlsup and stay visible; every process ever seen in the tree is
remembered (pid + create time, to be safe against pid reuse) and killed at the end of the attempt.
Where the run guards its attempts (:meth:`OsProcesses.guard_attempts`, :mod:`supervisor.processes.containment`),
each job root also gets its own cgroup (killed as a unit) and every process seen is recorded on disk,
so the guardian or the next rlsup can end the tree when this rlsup dies without cleaning up.
"""

from __future__ import annotations

import codecs
import collections
import ctypes
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Callable, Mapping, Sequence

import psutil

from supervisor.bounded_calls import child_pids
from supervisor.processes import children as proc_children
from supervisor.log import CONSOLE

if TYPE_CHECKING:
    from rlsup_format.heartbeat_record import HeartbeatRecord
    from supervisor.processes.containment import AttemptTree
    from supervisor.processes.leftovers import Ended
    from supervisor.diagnosis.unkillable import StuckProcess

_PR_SET_PDEATHSIG = 1
SLOW_EXIT_S = 50.0  # past kill_grace, how long a SIGKILLed process not in state D is still waited for (as before issue 32)
_PR_SET_CHILD_SUBREAPER = 36
_libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
# The attempts' record and cgroups (OsProcesses.guard_attempts), one per process and not per layer: every job root
# is a child of this one process (a subreaper), so where several runs share a process (bench_scale's simulated
# nodes, tests) the first run's tree records them all and no other run may make a second (its close would end them).
_TREE: "AttemptTree | None" = None


def become_subreaper() -> bool:
    """Orphaned descendants are re-parented to us instead of init, so none escapes the tree."""
    return bool(_libc is not None and _libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)


def _die_with_parent() -> None:  # runs in the child between fork and exec
    if _libc is not None:
        _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _child_setup(cgroup: str | None) -> Callable[[], None]:
    """What the job root does between fork and exec: die with rlsup, enter its cgroup before it can fork."""
    if cgroup is None:
        return _die_with_parent
    from supervisor.processes.cgroup import join_cgroup  # here, not in the forked child (no import after fork)

    def setup() -> None:
        _die_with_parent()
        try:
            join_cgroup(cgroup)
        except OSError:
            pass  # the session and the recorded pids still end it

    return setup


MAX_LINE = 65536  # characters the relay holds for one line without an end; then it is passed on as a line
_SEGMENT = re.compile(r"[^\r\n]*[\r\n]")


class WholeLines:
    """Cuts the job's output into what may be passed on now: everything up to its last line end (``\n``, or
    the ``\r`` of a progress bar's redraw), at once; the rest is held until its end comes. A line longer than
    ``limit`` without an end is passed on in pieces of ``limit``, each ended by a newline (memory stays
    bounded); :meth:`end` ends what is held at the job's exit. Why: with ``PYTHONUNBUFFERED=1`` ``print``
    writes the text and the newline separately, and rlsup's own line written between the two would land
    inside the job's (supervisor.log)."""

    def __init__(self, limit: int = MAX_LINE) -> None:
        if limit < 1:
            raise ValueError(f"line limit must be at least 1 character, got {limit}")
        self.limit = limit
        self.held = ""  # the line begun and not yet ended

    def feed(self, text: str) -> str:
        """The whole lines ``text`` completes (each with its end), or ""."""
        cut = max(text.rfind("\n"), text.rfind("\r")) + 1
        if cut:
            out, self.held = self.held + text[:cut], text[cut:]
        else:
            out, self.held = "", self.held + text
        while len(self.held) >= self.limit:
            out += self.held[:self.limit] + "\n"
            self.held = self.held[self.limit:]
        return out

    def end(self) -> str:
        """What is held, ended by a newline (the job has exited), or ""."""
        out, self.held = (self.held + "\n" if self.held else ""), ""
        return out


@dataclass
class OutputTail:
    """Relays the job's output to our stdout by whole lines (:class:`WholeLines`, through
    :data:`supervisor.log.CONSOLE`), copies it to a log file as it comes, and keeps the last lines for
    incidents."""

    lines: int
    log_path: Path
    echo: IO[str] | None = None
    on_segment: Callable[[str], None] | None = None  # progress_regex matching (supervisor.diagnosis.step_reports)
    finished: str | None = None  # the line in which the trainer said its run is done (supervisor.diagnosis.step_reports)
    _tail: collections.deque = field(init=False)
    _thread: threading.Thread | None = field(init=False, default=None)
    _line_last: str = field(init=False, default="")  # the current line's last redraw (what the tail keeps of it)

    def __post_init__(self) -> None:
        self._tail = collections.deque(maxlen=max(self.lines, 1))

    def start(self, stream: IO[bytes]) -> None:
        self._thread = threading.Thread(target=self._pump, args=(stream,), daemon=True, name="rlsup-output")
        self._thread.start()

    def _pump(self, stream: IO[bytes]) -> None:
        """Read whatever the pipe holds; pass on the whole lines at once (a redraw's ``\r`` ends one), and
        hand every segment ended by ``\n`` or ``\r`` to :attr:`on_segment`, the redraw not yet ended too."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        decode = codecs.getincrementaldecoder("utf-8")(errors="replace").decode
        read = getattr(stream, "read1", None) or stream.read  # whatever the pipe holds, not a whole line
        cutter = WholeLines()
        try:
            with open(self.log_path, "ab") as log:
                for raw in iter(lambda: read(65536), b""):
                    log.write(raw)
                    log.flush()
                    self._pass_on(cutter.feed(decode(raw)))
                    if cutter.held:
                        self._feed(cutter.held)  # a redraw not yet ended (tqdm ends it with the next)
        finally:  # the job's exit (or a broken pipe): its last line, ended, before anything rlsup says next
            self._pass_on(cutter.feed(decode(b"", True)) + cutter.end())  # a character cut at the end: U+FFFD
            if self._line_last:
                self._tail.append(self._line_last)

    def _pass_on(self, whole: str) -> None:
        """Relay whole lines; each segment to on_segment, each line's last redraw to the tail."""
        if not whole:
            return
        self._echo(whole)
        for match in _SEGMENT.finditer(whole):
            segment = match.group()[:-1]
            if segment:
                self._feed(segment)
                self._line_last = segment
            if match.group()[-1] == "\n":
                self._tail.append(self._line_last)
                self._line_last = ""

    def _feed(self, segment: str) -> None:
        if self.on_segment is not None:
            try:
                self.on_segment(segment)
            except Exception:  # noqa: BLE001 - a bad pattern never stops the output
                pass

    def _echo(self, text: str) -> None:
        try:
            CONSOLE.relay(text, self.echo)
        except (OSError, ValueError):
            pass

    def join(self, timeout: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def tail(self) -> list[str]:
        return list(self._tail)


def spawn_job_root(argv: Sequence[str], env: Mapping[str, str], cwd: str | None = None,
                   stdin: int | IO | None = subprocess.DEVNULL, pass_fds: Sequence[int] = ()) -> subprocess.Popen:
    """Start a job's top process: own session, dies with rlsup, stdout+stderr on one pipe.

    PR_SET_PDEATHSIG fires when the *thread* that forked the child exits: call this from the thread
    that supervises the job (the run loop), never from a short-lived helper thread. Where the run
    guards its attempts, the root starts in a cgroup of its own and is recorded."""
    tree = _TREE
    cgroup = tree.new_root_cgroup() if tree is not None else None
    popen = subprocess.Popen(
        list(argv), env=None if env is None else dict(env), cwd=cwd, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        start_new_session=True, preexec_fn=_child_setup(cgroup), pass_fds=tuple(pass_fds),
    )
    if tree is not None:
        tree.root_spawned(popen.pid, cgroup)
    return popen


class JobProcess:
    """One launched attempt: the top process, the set of processes seen under it, and its output."""

    # pids rlsup started for itself (the guardian, py-spy's analyser, warm launchers), never part of a job. The
    # process's, not a layer's: they are children of this process, whichever run started them, and a job's orphan
    # walk (_orphans) must spare every one of them.
    helpers: set[int] = set()

    def __init__(self, argv: Sequence[str], env: dict[str, str], log_path: Path, tail_lines: int,
                 cwd: str | None = None) -> None:
        self._adopt(spawn_job_root(argv, env, cwd), log_path, tail_lines)

    @classmethod
    def from_popen(cls, popen: subprocess.Popen, log_path: Path, tail_lines: int) -> "JobProcess":
        """An attempt whose top process was spawned ahead with :func:`spawn_job_root` (a warm launcher)."""
        job = cls.__new__(cls)
        job._adopt(popen, log_path, tail_lines)
        return job

    def _adopt(self, popen: subprocess.Popen, log_path: Path, tail_lines: int) -> None:
        self.output = OutputTail(tail_lines, log_path)
        self.popen = popen
        self.pid = self.popen.pid
        self.pgid = self.pid
        self.started = time.monotonic()
        self.stuck: "list[StuckProcess]" = []  # alive after SIGKILL and its wait (terminate_tree)
        self._known: dict[int, psutil.Process] = {}
        try:
            self._known[self.pid] = psutil.Process(self.pid)
        except psutil.NoSuchProcess:
            pass
        assert self.popen.stdout is not None
        self.output.start(self.popen.stdout)

    # ------------------------------------------------------------ watching

    def refresh(self) -> None:
        """Remember every live descendant (ours, and orphans re-parented to us as subreaper). Called every
        poll: the walk reads the job's own ``children`` files (:mod:`supervisor.processes.children`), not every
        process on the host."""
        roots = [self.pid] + [p for p in self._orphans()]
        for pid in roots:
            known = self._known.get(pid)
            if known is not None and not known.is_running():
                continue  # reaped, and its pid may be another process's now: never walk a stranger's tree
            below = proc_children.descendants(pid)
            if below is None:  # no children files: psutil's scan, as before
                self._remember_scanned(pid)
                continue
            for member in (pid, *below):
                if member not in self._known:
                    try:
                        self._known[member] = psutil.Process(member)
                    except psutil.Error:
                        continue  # gone already
        if _TREE is not None:
            _TREE.seen(list(self._known))
        self._reap_orphans()

    def _remember_scanned(self, pid: int) -> None:
        try:
            proc = self._known.get(pid) or psutil.Process(pid)
            self._known.setdefault(pid, proc)
            for child in proc.children(recursive=True):
                self._known.setdefault(child.pid, child)
        except psutil.Error:
            pass

    def _orphans(self) -> list[int]:
        """Children of rlsup that we did not start directly: re-parented members of this job."""
        mine = proc_children.children(os.getpid())
        if mine is None:
            try:
                mine = [c.pid for c in psutil.Process().children()]
            except psutil.Error:
                return []
        own = child_pids()  # rlsup's forked calls (supervisor.bounded_calls): never a member of the job
        return [pid for pid in mine if pid != self.pid and pid not in JobProcess.helpers and pid not in own]

    def _reap_orphans(self) -> None:
        """Collect exit statuses of re-parented zombies (never the top process: Popen owns that one)."""
        for pid, proc in list(self._known.items()):
            if pid == self.pid:
                continue
            try:
                if proc.status() == psutil.STATUS_ZOMBIE and proc.ppid() == os.getpid():
                    os.waitpid(pid, os.WNOHANG)
            except (psutil.Error, ChildProcessError, OSError):
                pass

    def poll(self) -> int | None:
        return self.popen.poll()

    def live_processes(self) -> list[psutil.Process]:
        alive = []
        for proc in self._known.values():
            try:
                if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                    alive.append(proc)
            except psutil.Error:
                continue
        return alive

    # ------------------------------------------------------------ signalling

    def send(self, sig: int) -> None:
        """Signal the whole tree once: the process group, plus every process seen that left it. Never a
        second copy to a process the group signal reached: a trainer's handler that is not re-entrant
        (``lambda *_: event.set()`` is common) can deadlock when the copy lands while the first runs."""
        self.refresh()
        try:
            os.killpg(self.pgid, sig)
            grouped = True
        except (ProcessLookupError, PermissionError):
            grouped = False
        for proc in self.live_processes():
            try:
                if grouped and os.getpgid(proc.pid) == self.pgid:
                    continue
                proc.send_signal(sig)
            except (psutil.Error, OSError):
                pass

    def terminate_tree(self, grace: float, stuck_after: float = 10.0) -> list[int]:
        """SIGTERM everything, SIGKILL what is left after ``grace``; return pids that needed SIGKILL.
        ``grace`` 0: SIGKILL at once, no SIGTERM (a crashed attempt has nothing left to save); the
        root's cgroup, where it has one, is killed as a unit first (daemonised members included).
        What is still alive ``stuck_after`` seconds after the first SIGKILL is examined and left in
        :attr:`stuck` (:mod:`supervisor.diagnosis.unkillable`: a process in state D on a hung mount never dies)."""
        self.refresh()
        killed = _TREE.kill_root(self.pid) if _TREE is not None and grace <= 0 else []
        if grace > 0:
            self.send(signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            self.refresh()
            self.popen.poll()
            if not self.live_processes():
                break
            time.sleep(0.05)
        if _TREE is not None and grace > 0:
            killed += _TREE.kill_root(self.pid)
        killed += self._kill_until(time.monotonic() + max(stuck_after, 1.0))
        try:
            self.popen.wait(timeout=0.1 if self.stuck else 5)
        except subprocess.TimeoutExpired:
            pass
        self._reap_orphans()
        if _TREE is not None:
            _TREE.root_ended(self.pid)
        self.output.join(timeout=0.1 if self.stuck else 2)
        return sorted(set(killed))

    def _kill_until(self, deadline: float) -> list[int]:
        """SIGKILL what is alive until none is or ``deadline`` passes; what outlives it goes to :attr:`stuck`.
        Past ``deadline`` only a process in state D (held by a mount: it never dies) ends the wait early; one
        that is merely slow to die (a large process torn down on a loaded node) is waited for as long as
        :data:`SLOW_EXIT_S` more, so that no next attempt starts beside it."""
        from supervisor.diagnosis.unkillable import examine, uninterruptible

        killed: list[int] = []
        self.stuck = []
        hard_deadline = deadline + SLOW_EXIT_S
        while True:
            self.refresh()
            alive = self.live_processes()
            if not alive:
                return killed
            left = deadline - time.monotonic()
            if left <= 0:
                stuck = examine([proc.pid for proc in alive])
                if uninterruptible(stuck) or time.monotonic() >= hard_deadline:
                    self.stuck = stuck
                    return killed
                left = hard_deadline - time.monotonic()
            for proc in alive:
                try:
                    proc.kill()
                    killed.append(proc.pid)
                except psutil.Error:
                    pass
            try:
                os.killpg(self.pgid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            psutil.wait_procs(alive, timeout=min(1.0, left))
            self._reap_orphans()

    def wait_exit(self, timeout: float) -> int | None:
        try:
            return self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None


def oom_kill_count() -> int | None:
    """System-wide count of OOM kills (``/proc/vmstat``); a rise during an attempt marks an OOM."""
    try:
        with open("/proc/vmstat") as f:
            for line in f:
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


class OsProcesses:
    """The process layer (:class:`supervisor.processes.layer.Processes`) over the real operating system: start an
    attempt's job root, look at and signal pids, count OOM kills, collect stacks, guard the attempts against rlsup's
    own death. The in-process tests of the loop pass a fake instead (tests/support/fake_run_loop.py).

    ``cgroups`` False: no cgroup per job root (the fallback: sessions and recorded pids, as on a host
    where none can be made); ``guardian`` False: no guardian process (only a successor rlsup ends
    what a dead one left)."""

    def __init__(self, cgroups: bool = True, guardian: bool = True) -> None:
        self.cgroups, self.guardian = cgroups, guardian
        self._tree: "AttemptTree | None" = None  # the tree this layer made (guard_attempts), if any

    def end_predecessor(self, state_dir: Path) -> "tuple[int, list[Ended]] | None":
        """End what a dead rlsup's attempt left in ``state_dir`` (before anything is launched)."""
        from supervisor.processes.containment import end_predecessor

        return end_predecessor(state_dir)

    def guard_attempts(self, state_dir: Path) -> None:
        """From now on job roots get cgroups and are recorded in ``state_dir``, and a guardian ends
        them if this process dies; call once per run, after :meth:`end_predecessor`."""
        global _TREE
        from supervisor.processes.containment import AttemptTree

        if self._tree is not None and self._tree is _TREE:
            return  # this layer guards the run already (a spare guards before it arms, then runs as a node)
        self.release_attempts()
        if _TREE is not None:  # another run in this process (tests, simulated nodes) guards it: never replace it,
            _TREE.shared = True  # and its close must not end this run's jobs
            return
        _TREE = self._tree = AttemptTree(state_dir, use_cgroup=self.cgroups, guardian=self.guardian)
        if _TREE.guardian is not None:
            JobProcess.helpers.add(_TREE.guardian.pid)  # rlsup's child, never a member of an attempt

    def release_attempts(self) -> "list[Ended]":
        """The run is over: end anything still recorded, drop the record and cgroup, stop the guardian."""
        global _TREE
        tree = self._tree
        if tree is None or tree is not _TREE:
            return []  # not this layer's run (another run in this process owns the tree)
        _TREE = self._tree = None
        if tree.guardian is not None:
            JobProcess.helpers.discard(tree.guardian.pid)
        return tree.close()

    def start(self, command: Sequence[str], env: dict[str, str], log_path: Path, tail_lines: int) -> JobProcess:
        return JobProcess(command, env, log_path, tail_lines)

    def become_subreaper(self) -> bool:
        return become_subreaper()

    def oom_kill_count(self) -> int | None:
        return oom_kill_count()

    def pid_exists(self, pid: int) -> bool:
        return psutil.pid_exists(pid)

    def alive(self, pid: int) -> bool:
        """Whether a registered rank's process still exists (an exited rank is never 'silent')."""
        from rlsup_format.fileio import pid_alive

        return pid_alive(pid)

    def kill(self, pid: int, sig: int) -> None:
        """Signal one registered rank; a rank already gone is not an error."""
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def dump_stacks(self, hb_dir: Path, records: "Mapping[int, HeartbeatRecord]") -> dict[str, str]:
        from supervisor.diagnosis.stacks import dump_stacks

        return dump_stacks(hb_dir, records)
