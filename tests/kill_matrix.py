"""SIGKILL a real checkpoint writer between its files: the mid-save kill matrix of issue 18.

A trainer's save is a sequence of file operations (create a file for writing, rename, remove, mkdir,
symlink). Run the writer once to record that sequence (:func:`record_events`), then once per event
of the save under test with the process SIGKILLed just *before* that event (:func:`run_killed_at`):
every prefix of the save is then on disk, which is what a crash between files leaves.

The hook is a ``sitecustomize`` module put first on ``PYTHONPATH`` (so torchrun's and DataLoader's
child processes get it too); it is a :func:`sys.addaudithook`, which sees Python's own file
operations (``open``, ``os.*``, ``shutil.rmtree``), not bytes written by C++/Rust writers into a file
already open (``safetensors``' Rust writer opens its file itself: the next event is the kill point
after it). Only events under ``root`` count, per process; ``only_pid_env`` restricts the counting to
processes whose environment has that variable set to ``"0"`` (e.g. ``RANK``), so a multi-rank
writer's rank 0 is the one killed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

KILL_AT = "RLSUP_TEST_KILL_AT"
EVENTS_LOG = "RLSUP_TEST_FILE_EVENTS"
EVENTS_UNDER = "RLSUP_TEST_EVENTS_UNDER"
ONLY_WHERE = "RLSUP_TEST_EVENTS_ONLY_WHERE"  # "NAME": count only where os.environ[NAME] in ("", "0")
# "EVENT\tSUFFIX\tN": SIGKILL just before the N-th EVENT on a path ending with SUFFIX (a kill point named by what
# it is, where the index would need a recording run first)
KILL_AT_MATCH = "RLSUP_TEST_KILL_AT_MATCH"

_SITECUSTOMIZE = r'''
import os as _os
import sys as _sys


def _rlsup_install_kill_hook():
    root = _os.environ.get("RLSUP_TEST_EVENTS_UNDER")
    if not root:
        return
    only = _os.environ.get("RLSUP_TEST_EVENTS_ONLY_WHERE")
    if only and _os.environ.get(only, "0") != "0":
        return
    import signal
    kill_at = int(_os.environ.get("RLSUP_TEST_KILL_AT") or 0)
    match = _os.environ.get("RLSUP_TEST_KILL_AT_MATCH", "").split("\t")
    match_event, match_suffix, match_n = (match[0], match[1], int(match[2])) if len(match) == 3 else ("", "", 0)
    matched = [0]
    log_path = _os.environ.get("RLSUP_TEST_FILE_EVENTS")
    log_fd = _os.open(log_path, _os.O_WRONLY | _os.O_APPEND | _os.O_CREAT, 0o644) if log_path else None
    count = [0]
    writing = _os.O_WRONLY | _os.O_RDWR | _os.O_CREAT | _os.O_TRUNC | _os.O_APPEND
    busy = [False]

    def paths_of(event, args):
        if event == "open":
            path, mode, flags = args
            if isinstance(path, int) or path is None:
                return ()
            if isinstance(mode, str) and any(c in mode for c in "wax+"):
                return (path,)
            if isinstance(flags, int) and flags & writing:
                return (path,)
            return ()
        if event in ("os.rename", "os.replace", "os.symlink", "os.link"):
            return (args[0], args[1])
        if event in ("os.remove", "os.rmdir", "os.mkdir", "shutil.rmtree", "os.truncate"):
            return (args[0],)
        return ()

    def hook(event, args):
        if busy[0] or event not in ("open", "os.rename", "os.replace", "os.symlink", "os.link", "os.remove",
                                    "os.rmdir", "os.mkdir", "shutil.rmtree", "os.truncate"):
            return
        busy[0] = True
        try:
            paths = [p for p in paths_of(event, args) if not isinstance(p, int)]
            names = [_os.path.abspath(_os.fsdecode(p)) for p in paths]
            if not any(n == root or n.startswith(root + _os.sep) for n in names):
                return
            count[0] += 1
            if log_fd is not None:
                _os.write(log_fd, ("%d\t%d\t%s\t%s\n" % (_os.getpid(), count[0], event, "\t".join(names))).encode())
            if kill_at and count[0] == kill_at:
                _os.kill(_os.getpid(), signal.SIGKILL)
            if match_n and event == match_event and any(n.endswith(match_suffix) for n in names):
                matched[0] += 1
                if matched[0] == match_n:
                    _os.kill(_os.getpid(), signal.SIGKILL)
        finally:
            busy[0] = False

    _sys.addaudithook(hook)
    _sys.meta_path.insert(0, _NativeWriters())


class _NativeWriters:
    """Writers that open their file in C++/Rust raise no audit event: announce it as an "open" first."""

    PATCHES = {"torch.serialization": ("_open_zipfile_writer", 0), "safetensors.torch": ("save_file", 1)}

    def find_spec(self, name, path, target=None):
        if name not in self.PATCHES or self._skip == name:
            return None
        import importlib.util
        try:
            self._skip = name
            spec = importlib.util.find_spec(name)
        finally:
            self._skip = None
        if spec is None or spec.loader is None:
            return spec
        attr, index = self.PATCHES[name]
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            original = getattr(module, attr)

            def announced(*args, **kwargs):
                target = args[index] if len(args) > index else kwargs.get("filename", kwargs.get("f"))
                if isinstance(target, (str, bytes, _os.PathLike)):
                    _sys.audit("open", _os.fspath(target), "wb", 0)
                return original(*args, **kwargs)

            setattr(module, attr, announced)

        spec.loader.exec_module = exec_and_patch
        return spec

    _skip = None


_rlsup_install_kill_hook()
'''


@dataclass(frozen=True)
class FileEvent:
    """One counted file operation of one process: its 1-based index in that process, and its paths."""

    pid: int
    index: int
    event: str
    paths: tuple[str, ...]

    @property
    def path(self) -> str:
        return self.paths[0]

    def describe(self) -> str:
        return f"#{self.index} {self.event} {' -> '.join(self.paths)}"


def _hook_dir() -> Path:
    d = Path(tempfile.mkdtemp(prefix="rlsup-killhook-"))
    (d / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    return d


def _env(base: Mapping[str, str] | None, root: Path, log: Path | None, kill_at: int | None,
         only_where: str | None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    hook = _hook_dir()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(hook), env.get("PYTHONPATH", "")) if p)
    env[EVENTS_UNDER] = str(Path(root).resolve())
    if log is not None:
        env[EVENTS_LOG] = str(log)
    if kill_at:
        env[KILL_AT] = str(kill_at)
    if only_where:
        env[ONLY_WHERE] = only_where
    return env


def kill_at_match(event: str, suffix: str, n: int) -> dict[str, str]:
    """The environment that kills a process just before its ``n``-th ``event`` on a path ending with ``suffix``."""
    return {KILL_AT_MATCH: f"{event}\t{suffix}\t{n}"}


def read_events(log: Path) -> list[FileEvent]:
    out = []
    for line in log.read_text().splitlines() if log.exists() else []:
        pid, index, event, *paths = line.split("\t")
        out.append(FileEvent(int(pid), int(index), event, tuple(paths)))
    return out


def record_events(cmd: Sequence[str], root: Path, *, env: Mapping[str, str] | None = None, cwd: Path | None = None,
                  timeout: float = 600, only_where: str | None = None) -> tuple[list[FileEvent], str]:
    """Run ``cmd`` to completion (it must exit 0); its counted file events under ``root`` and its output."""
    log = Path(tempfile.mkdtemp(prefix="rlsup-events-")) / "events.tsv"
    proc = subprocess.run(list(cmd), env=_env(env, root, log, None, only_where), cwd=cwd, timeout=timeout,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.returncode == 0, f"{cmd} exited {proc.returncode}:\n{proc.stdout[-6000:]}"
    return read_events(log), proc.stdout


def run_killed_at(cmd: Sequence[str], root: Path, kill_at: int, *, env: Mapping[str, str] | None = None,
                  cwd: Path | None = None, timeout: float = 600, only_where: str | None = None
                  ) -> list[FileEvent]:
    """Run ``cmd`` and SIGKILL it just before its ``kill_at``-th counted file event; the events it made
    (the last one is the kill point, not carried out). Fails if the process was not killed there."""
    log = Path(tempfile.mkdtemp(prefix="rlsup-events-")) / "events.tsv"
    proc = subprocess.run(list(cmd), env=_env(env, root, log, kill_at, only_where), cwd=cwd, timeout=timeout,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    events = read_events(log)
    killed = proc.returncode == -signal.SIGKILL or (proc.returncode != 0 and any(e.index == kill_at for e in events))
    assert killed, f"{cmd} was not killed at event {kill_at} (exit {proc.returncode}):\n{proc.stdout[-4000:]}"
    return events


def python() -> str:
    return sys.executable
