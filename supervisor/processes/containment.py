"""One rlsup run's record of what it supervises, kept where its guardian and its successor find it.

:class:`AttemptTree` makes the run's cgroup (where cgroup v2 allows), a child group per job root,
starts the guardian (:mod:`supervisor.processes.guardian`), and rewrites ``attempt_tree.json``
(:mod:`supervisor.processes.tree_record`) when a root is spawned, a new descendant is seen or a root's attempt
ends. Writes happen only on change (a few hundred microseconds each), never per poll.
"""

from __future__ import annotations

import itertools
import logging
import os
from pathlib import Path

from supervisor.processes.cgroup import child_cgroup, create_run_cgroup, kill_cgroup, remove_cgroup
from supervisor.processes.leftovers import Ended, end_leftovers
from supervisor.processes.tree_record import ProcRef, RootRef, TreeRecord, load, proc_start, record_path, save

log = logging.getLogger(__name__)


class AttemptTree:
    """The run's cgroup, guardian and record. ``use_cgroup`` False forces the fallback (sessions and
    recorded pids), as on a host where no cgroup can be made; ``guardian`` False: no guardian process."""

    def __init__(self, state_dir: Path, use_cgroup: bool = True, guardian: bool = True) -> None:
        self.path = record_path(state_dir)
        me = ProcRef(os.getpid(), proc_start(os.getpid()) or 0)
        cgroup = create_run_cgroup(f"rlsup.{me.pid}.{me.start}") if use_cgroup else None
        self.cgroup = cgroup
        self.record = TreeRecord(me, str(cgroup) if cgroup else None)
        self._names = itertools.count()
        self._known: set[int] = set()
        self._empty: list[Path] = []  # ended roots' groups not yet removable (the kernel empties them lazily)
        self.shared = False  # another run in this process records its roots here too (tests, simulated nodes)
        self._save()
        self.guardian = None
        if guardian:
            from supervisor.processes.guardian import Guardian

            try:
                self.guardian = Guardian(Path(state_dir))
            except OSError as e:
                log.warning("attempt guardian not started (%s): a SIGKILLed rlsup leaves its attempt to the next", e)

    def new_root_cgroup(self) -> str | None:
        """A fresh group for the next job root (joined between fork and exec); None: no cgroup."""
        if self.cgroup is None:
            return None
        path = child_cgroup(self.cgroup, f"root.{next(self._names)}")
        return str(path) if path is not None else None

    def root_spawned(self, pid: int, cgroup: str | None) -> None:
        start = proc_start(pid)
        if start is None:
            return
        self.record.roots.append(RootRef(pid, start, cgroup))
        self._known.add(pid)
        self._save()

    def seen(self, pids: list[int]) -> None:
        """Descendants seen under a root (``JobProcess.refresh``); written when one is new."""
        new = [pid for pid in pids if pid not in self._known]
        if not new:
            return
        for pid in new:
            self._known.add(pid)
            start = proc_start(pid)
            if start is not None:
                self.record.pids.append(ProcRef(pid, start))
        self._save()

    def kill_root(self, pid: int) -> list[int]:
        """SIGKILL a root's whole cgroup at once (daemonised members included); the pids it held."""
        root = self._root(pid)
        return kill_cgroup(Path(root.cgroup), timeout=1.0) if root is not None and root.cgroup else []

    def root_ended(self, pid: int) -> None:
        """A root's tree is gone: forget it, its pids that are dead, and its cgroup."""
        root = self._root(pid)
        if root is None:
            return
        self.record.roots.remove(root)
        if root.cgroup:
            self._empty.append(Path(root.cgroup))
        self._empty = [path for path in self._empty if not remove_cgroup(path, timeout=0)]  # never waits: restart path
        self.record.pids = [ref for ref in self.record.pids if ref.matches()]
        self._known = {ref.pid for ref in self.record.pids} | {r.pid for r in self.record.roots}
        self._save()

    def close(self) -> list[Ended]:
        """The run ends: end anything still recorded (after an error in the loop), drop the record and
        the cgroup, and let the guardian go."""
        ended = [] if self.shared else end_leftovers(self.record)  # never another run's jobs
        try:
            self.path.unlink()
        except OSError:
            pass
        if self.cgroup is not None:
            remove_cgroup(self.cgroup)
        if self.guardian is not None:
            self.guardian.close()
        return ended

    def _root(self, pid: int) -> RootRef | None:
        return next((r for r in self.record.roots if r.pid == pid), None)

    def _save(self) -> None:
        try:
            save(self.path, self.record)
        except OSError as e:
            log.warning("could not write %s (%s)", self.path, e)


def end_predecessor(state_dir: Path, cgroup: bool = True) -> tuple[int, list[Ended]] | None:
    """A dead rlsup's attempt, ended before this one launches: (its pid, what was ended); None when
    there is no record or its rlsup still lives."""
    path = record_path(state_dir)
    record = load(path)
    if record is None or record.owner.pid == os.getpid() or (record.this_boot() and record.owner_alive()):
        return None
    ended = end_leftovers(record, cgroup=cgroup) if record.this_boot() else []  # a reboot ended them all
    try:
        path.unlink()
    except OSError:
        pass
    return record.owner.pid, ended
