"""A filesystem that misbehaves on command: a pass-through FUSE mount (mfusepy over libfuse3) run as its own
process, told by a control file to hang every call, to answer EIO, to answer slowly, or to heal.

Why FUSE: a hung NFS or Lustre mount leaves its callers in uninterruptible sleep. A FUSE request the daemon
has read but not answered does the same: the caller sleeps killably until SIGKILL, then in state D (the
kernel's ``request_wait_answer``) until the daemon answers or the connection is aborted. So the tests see the
real thing: SIGKILL does not end a rank writing its checkpoint into a hung mount.

The parent side is :class:`SickFs` (a context manager): it mounts, flips modes, waits for the daemon to hold
calls, and at the end always heals, unmounts (``fusermount3 -u``, then lazily, then the connection's
``abort``) and kills the daemon, so no test leaves a process in state D behind. :func:`unavailable` names
why a machine cannot run it (no /dev/fuse, not root, no fusermount3, no mfusepy) for a skip.

Run as a script (the daemon): ``python sick_fs.py ROOT MOUNTPOINT CONTROL``; ``CONTROL`` holds one JSON
object ``{"mode": "ok"|"hang"|"eio"|"slow", "match": "", "ops": [], "delay": 0.0}`` (``match``: only paths
containing it; ``ops``: only these operations, all when empty); the daemon writes ``CONTROL.status``
(JSON: ``held`` calls now blocked, ``eio`` calls failed, ``paths`` the held ones) whenever those change.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

MODES = ("ok", "hang", "eio", "slow")
#: Every operation but ``flush`` (sent at each close of a descriptor, a forked child's close and exec included):
#: a hang of these holds every caller, yet lets a process that forks while one of its threads holds a file
#: open on the mount start its child (see RELIABILITY.md: that close blocks on a mount whose flush hangs).
ALL_BUT_FLUSH = ("getattr", "access", "readdir", "readlink", "mkdir", "rmdir", "unlink", "symlink", "rename",
                 "link", "chmod", "chown", "truncate", "utimens", "statfs", "open", "create", "read", "write",
                 "fsync")


def unavailable() -> str | None:
    """Why this machine cannot mount a sick filesystem, or None when it can."""
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse on this machine"
    if os.geteuid() != 0:
        return "FUSE tests need root (mounting, and reading other processes' /proc/<pid>/fd)"
    if shutil.which("fusermount3") is None:
        return "fusermount3 missing (Debian package fuse3: scripts/setup.sh installs it as root)"
    try:
        import mfusepy  # noqa: F401
    except (ImportError, OSError) as e:  # OSError: libfuse itself missing
        return f"mfusepy (the test extra) cannot load libfuse: {e}"
    return None


def _atomic_write(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


# ------------------------------------------------------------------ the daemon

class _Control:
    """The mode the control file asks for (re-read every 20 ms by a thread) and the calls held now."""

    def __init__(self, control: Path) -> None:
        self.path, self.status = control, control.with_name(control.name + ".status")
        self.mode: dict = {"mode": "ok"}
        self.changed = threading.Condition()
        self.held: dict[int, str] = {}
        self.eio = 0
        self._stamp: tuple[int, int] | None = None
        self._report()
        threading.Thread(target=self._poll, daemon=True, name="sick-fs-control").start()

    def _poll(self) -> None:
        while True:
            try:
                st = self.path.stat()
                stamp = (st.st_mtime_ns, st.st_ino)
                if stamp != self._stamp:
                    mode = json.loads(self.path.read_text())
                    with self.changed:
                        self._stamp, self.mode = stamp, mode
                        self.changed.notify_all()
                        self._report()  # the mode's seq: the parent waits for it before going on
            except (OSError, ValueError):
                pass
            time.sleep(0.02)

    def _applies(self, mode: dict, op: str, path: str) -> bool:
        ops = mode.get("ops") or []
        return (not ops or op in ops) and mode.get("match", "") in path

    def gate(self, op: str, path: str) -> None:
        """Before a call reaches the real directory: hold it while the mode says hang, fail it with EIO,
        or delay it."""
        with self.changed:
            mode = self.mode
            if mode.get("mode") == "hang" and self._applies(mode, op, path):
                key = threading.get_ident()
                self.held[key] = f"{op} {path}"
                self._report()
                while self.mode.get("mode") == "hang" and self._applies(self.mode, op, path):
                    self.changed.wait(0.1)
                del self.held[key]
                self._report()
                mode = self.mode
            if mode.get("mode") == "eio" and self._applies(mode, op, path):
                self.eio += 1
                self._report()
                raise OSError(errno.EIO, os.strerror(errno.EIO))
        if mode.get("mode") == "slow" and self._applies(mode, op, path):
            time.sleep(float(mode.get("delay", 0.2)))

    def _report(self) -> None:
        _atomic_write(self.status, {"held": len(self.held), "eio": self.eio, "paths": sorted(self.held.values()),
                                    "seq": self.mode.get("seq", 0)})


def _passthrough(root: str, control: _Control):
    import mfusepy

    def gated(fn):
        name = fn.__name__

        def call(self, path, *args):
            control.gate(name, path)
            return fn(self, path, *args)

        call.__name__ = name
        return call

    class Passthrough(mfusepy.Operations):
        """Every call on ``root``, through :meth:`_Control.gate`."""

        use_ns = True

        def _real(self, path: str) -> str:
            return os.path.join(root, path.lstrip("/"))

        @gated
        def getattr(self, path, fh=None):
            st = os.fstat(fh) if fh is not None else os.lstat(self._real(path))
            keys = ("st_mode", "st_nlink", "st_uid", "st_gid", "st_size", "st_ino", "st_dev", "st_blocks",
                    "st_atime_ns", "st_mtime_ns", "st_ctime_ns")
            out = {k.replace("_ns", ""): getattr(st, k) for k in keys}
            return out

        @gated
        def access(self, path, amode):
            if not os.access(self._real(path), amode):
                raise OSError(errno.EACCES, "")
            return 0

        @gated
        def readdir(self, path, fh):
            return [".", "..", *os.listdir(self._real(path))]

        @gated
        def readlink(self, path):
            return os.readlink(self._real(path))

        @gated
        def mkdir(self, path, mode):
            return os.mkdir(self._real(path), mode)

        @gated
        def rmdir(self, path):
            return os.rmdir(self._real(path))

        @gated
        def unlink(self, path):
            return os.unlink(self._real(path))

        @gated
        def symlink(self, path, target):
            return os.symlink(target, self._real(path))

        @gated
        def rename(self, path, new):
            control.gate("rename", new)
            return os.rename(self._real(path), self._real(new))

        @gated
        def link(self, path, target):
            return os.link(self._real(target), self._real(path))

        @gated
        def chmod(self, path, mode):
            return os.chmod(self._real(path), mode)

        @gated
        def chown(self, path, uid, gid):
            return os.chown(self._real(path), uid, gid)

        @gated
        def truncate(self, path, length, fh=None):
            if fh is not None:
                return os.ftruncate(fh, length)
            return os.truncate(self._real(path), length)

        @gated
        def utimens(self, path, times=None):
            return os.utime(self._real(path), ns=times) if times else os.utime(self._real(path))

        @gated
        def statfs(self, path):
            sv = os.statvfs(self._real(path))
            return {k: getattr(sv, k) for k in ("f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail",
                                                 "f_ffree", "f_files", "f_flag", "f_frsize", "f_namemax")}

        @gated
        def open(self, path, flags):
            return os.open(self._real(path), flags)

        @gated
        def create(self, path, mode, fi=None):
            return os.open(self._real(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)

        @gated
        def read(self, path, size, offset, fh):
            return os.pread(fh, size, offset)

        @gated
        def write(self, path, data, offset, fh):
            return os.pwrite(fh, data, offset)

        @gated
        def flush(self, path, fh):
            return 0

        @gated
        def fsync(self, path, datasync, fh):
            return os.fdatasync(fh) if datasync else os.fsync(fh)

        def release(self, path, fh):  # never held: the kernel sends it after the caller is gone
            os.close(fh)
            return 0

    return Passthrough()


def serve(root: str, mountpoint: str, control_path: str) -> None:
    """The daemon: mount ``root`` at ``mountpoint`` and serve until unmounted."""
    import mfusepy

    control = _Control(Path(control_path))
    mfusepy.FUSE(_passthrough(os.path.realpath(root), control), mountpoint, foreground=True, nothreads=False,
                 direct_io=True, attr_timeout=0, entry_timeout=0, negative_timeout=0, fsname="sickfs",
                 max_threads=64)


# ------------------------------------------------------------------ the parent side

class SickFs:
    """One sick mount for a test: ``with SickFs(root, mountpoint, control_dir) as fs: fs.hang()``."""

    def __init__(self, root: Path, mountpoint: Path, control_dir: Path) -> None:
        self.root, self.mountpoint = Path(root), Path(mountpoint)
        self.control = Path(control_dir) / "sick_fs.control"
        self.status_path = self.control.with_name(self.control.name + ".status")
        self.log_path = Path(control_dir) / "sick_fs.log"
        self.proc: subprocess.Popen | None = None
        self._seq = 0

    def __enter__(self) -> "SickFs":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self, timeout: float = 20.0) -> None:
        for path in (self.root, self.mountpoint, self.control.parent):
            path.mkdir(parents=True, exist_ok=True)
        self._set({"mode": "ok"})
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([sys.executable, __file__, str(self.root), str(self.mountpoint),
                                      str(self.control)], stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout
        while not os.path.ismount(self.mountpoint):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"sick_fs did not mount {self.mountpoint}: {self.log_path.read_text()[-2000:]}")
            time.sleep(0.05)

    def _set(self, mode: dict, timeout: float = 10.0) -> None:
        """Write the mode and wait until the daemon has it in force (its status echoes the mode's seq)."""
        self._seq += 1
        _atomic_write(self.control, {**mode, "seq": self._seq})
        if self.proc is None or self.proc.poll() is not None:
            return
        deadline = time.monotonic() + timeout
        while self.status().get("seq") != self._seq:
            if time.monotonic() > deadline:
                raise RuntimeError(f"sick_fs did not take mode {mode} within {timeout}s")
            time.sleep(0.01)

    def hang(self, match: str = "", ops: tuple[str, ...] = ()) -> None:
        """Every call (on paths containing ``match``, of ``ops``) blocks until :meth:`heal`."""
        self._set({"mode": "hang", "match": match, "ops": list(ops)})

    def eio(self, match: str = "", ops: tuple[str, ...] = ()) -> None:
        """Every call (on paths containing ``match``, of ``ops``) fails with EIO."""
        self._set({"mode": "eio", "match": match, "ops": list(ops)})

    def slow(self, delay: float, match: str = "", ops: tuple[str, ...] = ()) -> None:
        """Every call waits ``delay`` seconds before it is served."""
        self._set({"mode": "slow", "delay": delay, "match": match, "ops": list(ops)})

    def heal(self) -> None:
        self._set({"mode": "ok"})

    def status(self) -> dict:
        """What the daemon last reported: ``held`` (calls blocked now), ``eio``, ``paths``."""
        try:
            return json.loads(self.status_path.read_text())
        except (OSError, ValueError):
            return {"held": 0, "eio": 0, "paths": []}

    def close(self) -> None:
        """Heal, unmount (lazily and by aborting the connection when a plain unmount fails), end the daemon:
        whatever the test left blocked on the mount gets its answer or ENOTCONN, never state D forever."""
        try:
            self.heal()
        except RuntimeError:
            pass  # a daemon that no longer answers: the unmount and the connection's abort below still end it
        if self.proc is not None and self.proc.poll() is None:
            deadline = time.monotonic() + 5
            while self.status().get("held") and time.monotonic() < deadline:
                time.sleep(0.05)
        if self.mounted():
            if subprocess.run(["fusermount3", "-u", str(self.mountpoint)], capture_output=True).returncode != 0:
                self._abort_connection()
                subprocess.run(["fusermount3", "-uz", str(self.mountpoint)], capture_output=True)
        if self.proc is not None:
            if self.proc.poll() is None:
                try:
                    self.proc.wait(5)
                except subprocess.TimeoutExpired:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                    self.proc.wait(10)
            self.proc = None
        if self.mounted():  # the daemon is gone: what is left is a dead mount, removed lazily
            subprocess.run(["umount", "-l", str(self.mountpoint)], capture_output=True)

    def mounted(self) -> bool:
        """Whether the mount is in the table (read from /proc/self/mountinfo: a stat could hang on it)."""
        return _mount_dev(self.mountpoint) is not None

    def _abort_connection(self) -> None:
        """Write to the mount's ``/sys/fs/fuse/connections/<dev>/abort``: every waiting call ends (ENOTCONN)."""
        dev = _mount_dev(self.mountpoint)  # never stat: a hung mount would hold the test too
        if dev is None:
            return
        try:
            Path(f"/sys/fs/fuse/connections/{os.minor(dev)}/abort").write_text("1")
        except OSError:
            pass


def _mount_dev(mountpoint: Path) -> int | None:
    """The device number of ``mountpoint`` from /proc/self/mountinfo (stat would hang on a hung mount)."""
    where = os.path.abspath(mountpoint)  # no realpath: it would stat the mount
    try:
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            fields = line.split()
            if fields[4] == where:
                major, minor = fields[2].split(":")
                return os.makedev(int(major), int(minor))
    except (OSError, IndexError, ValueError):
        return None
    return None


if __name__ == "__main__":
    serve(*sys.argv[1:4])
