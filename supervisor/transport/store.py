"""Where replicas received from peers live: ``root/<namespace>/<relpath>``, verified, never partial.

Names are validated strictly before anything touches the disk:

- namespace: ``[A-Za-z0-9][A-Za-z0-9._-]{0,127}`` (so it never starts with ``.``: every top-level
  dot name is reserved for the store itself, ``.incoming`` and ``.meta``);
- relpath: 1..32 ``/``-separated segments, at most 1024 characters in all, each segment 1..255
  characters of ``[A-Za-z0-9._+=@,~-]``; a segment may start with ``.`` (torch DCP writes
  ``.metadata``) but may not be ``.`` or ``..``; no empty segment, no leading ``/``, no backslash,
  no NUL, no percent sign.

Every access then walks the path component by component with ``O_NOFOLLOW`` directory file
descriptors relative to ``root``, so a symlink planted anywhere inside the store (by another user or
a bug) is refused instead of followed, even if it appears between a check and the use. ``path_of``
additionally checks that the resolved real path stays inside ``root``.

Writes: data goes to ``root/.incoming/<reserved temp name>`` (:mod:`rlsup_format.names`), is hashed while written, and is renamed into place
only after its size and xxh3-128 match what the sender declared; the file and the target directory
are fsync'ed, so a crash leaves either the old file or the new one, never a torn one. A failed or
aborted write leaves the existing file untouched.

Checksums (``index``): a sidecar per namespace, ``root/.meta/<namespace>.json``, maps each relpath to
``(size, mtime_ns, inode, xxh3_128)``; it is filled when a verified write commits. An entry is
trusted only while the file's ``lstat`` still shows the same size, mtime and inode; otherwise (a
file changed or put there behind the store's back) it is re-hashed. The sidecar is a cache: losing
it costs one re-hash, never a wrong answer short of someone forging mtimes.

One process should own a store root at a time: leftovers in ``.incoming`` (and temp sidecars in
``.meta``) are deleted when a store is opened.
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from rlsup_format.digest import FileEntry, hash_fd, new_hasher
from rlsup_format.fileio import UnsafeFileError, fsync_dir_fd, open_nofollow, open_regular_at, writev_all
from rlsup_format.names import Kind, parse_reserved, reserved_name

INCOMING = ".incoming"
META = ".meta"
MAX_RELPATH = 1024
MAX_DEPTH = 32
_NS_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_SEG_RE = re.compile(r"^[A-Za-z0-9._+=@,~-]{1,255}$")
_HEX128_RE = re.compile(r"^[0-9a-f]{32}$")
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
_PERSIST_EVERY_S = 2.0


class StoreError(Exception):
    """Base of the store's errors; ``status`` is the HTTP status the server answers with."""

    status = 400


class InvalidPath(StoreError):
    status = 400


class NotFound(StoreError):
    status = 404


class IntegrityError(StoreError):
    """The received bytes do not match the declared size or checksum."""

    status = 400


def validate_namespace(namespace: str) -> str:
    if not isinstance(namespace, str) or not _NS_RE.match(namespace):
        raise InvalidPath(f"invalid namespace {namespace!r}: want [A-Za-z0-9][A-Za-z0-9._-]{{0,127}}")
    return namespace


def validate_relpath(relpath: str, allow_empty: bool = False) -> tuple[str, ...]:
    """The segments of ``relpath``, or InvalidPath naming what is wrong."""
    if not isinstance(relpath, str):
        raise InvalidPath(f"invalid path {relpath!r}: not a string")
    if relpath == "" and allow_empty:
        return ()
    if not relpath:
        raise InvalidPath("empty path")
    if len(relpath) > MAX_RELPATH:
        raise InvalidPath(f"path longer than {MAX_RELPATH} characters")
    if "\x00" in relpath or "\\" in relpath:
        raise InvalidPath(f"invalid path {relpath!r}: NUL or backslash")
    if relpath.startswith("/"):
        raise InvalidPath(f"invalid path {relpath!r}: absolute")
    segs = tuple(relpath.split("/"))
    if len(segs) > MAX_DEPTH:
        raise InvalidPath(f"invalid path {relpath!r}: deeper than {MAX_DEPTH}")
    for s in segs:
        if s in ("", ".", ".."):
            raise InvalidPath(f"invalid path {relpath!r}: empty, '.' or '..' segment")
        if not _SEG_RE.match(s):
            raise InvalidPath(f"invalid path {relpath!r}: segment {s!r} has characters outside [A-Za-z0-9._+=@,~-]")
    return segs


class IncomingFile:
    """One upload in progress: ``write`` chunks, then ``commit`` (verify + rename) or ``abort``."""

    def __init__(self, store: "ReplicaStore", namespace: str, segs: tuple[str, ...], size: int, xxh3: str) -> None:
        self.store = store
        self.namespace = namespace
        self.segs = segs
        self.size = size
        self.xxh3 = xxh3
        self.received = 0
        self._hash = new_hasher()
        self._name = reserved_name(Kind.TMP, namespace)
        self._fd: int | None = os.open(self._name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                                       | getattr(os, "O_CLOEXEC", 0), 0o644, dir_fd=store._incoming_fd)
        self._done = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.write_many((data,))

    def write_many(self, chunks: Sequence[bytes | bytearray | memoryview]) -> None:
        """Hash and append ``chunks`` with one ``writev`` (a receiver batches a few MiB of socket reads
        per call: no concatenation copy, one thread hop)."""
        if self._fd is None:
            raise StoreError("write after commit/abort")
        n = sum(map(len, chunks))
        if self.received + n > self.size:
            raise IntegrityError(f"body longer than the declared {self.size} bytes")
        for c in chunks:
            self._hash.update(c)
        writev_all(self._fd, chunks)
        self.received += n

    def receive_with(self, fill: Callable[[int, Any, int], object]) -> None:
        """``fill(fd, hasher, n)`` writes and hashes the other ``n`` bytes itself (or raises)."""
        if self._fd is None:
            raise StoreError("write after commit/abort")
        fill(self._fd, self._hash, self.size - self.received)
        self.received = self.size

    def finish(self, chunks: Sequence[bytes | bytearray | memoryview] = ()) -> FileEntry:
        """The last ``chunks`` and :meth:`commit` in one call (aborted on any failure)."""
        try:
            if chunks:
                self.write_many(chunks)
        except BaseException:
            self.abort()
            raise
        return self.commit()

    def commit(self) -> FileEntry:
        """Verify, fsync and rename into place. On any failure the upload is aborted (and re-raised)."""
        try:
            if self.received != self.size:
                raise IntegrityError(f"body has {self.received} bytes, {self.size} declared")
            digest = self._hash.hexdigest()
            if digest != self.xxh3:
                raise IntegrityError(f"xxh3-128 mismatch: body {digest}, declared {self.xxh3}")
            assert self._fd is not None
            os.fsync(self._fd)
            st = os.fstat(self._fd)
            os.close(self._fd)
            self._fd = None
            self.store._install(self.namespace, self.segs, self._name, st, digest)
            self._done = True
            return FileEntry(self.size, digest)
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = None
        if not self._done:
            self._done = True
            try:
                os.unlink(self._name, dir_fd=self.store._incoming_fd)
            except FileNotFoundError:
                pass


class ReplicaStore:
    """Verified replica files under ``root``; see the module docstring. Thread-safe."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root).absolute()
        self.root.mkdir(parents=True, exist_ok=True)
        if self.root.is_symlink():
            raise StoreError(f"store root {self.root} is a symlink")
        self._root_fd = os.open(self.root, _DIR_FLAGS)
        for name in (INCOMING, META):
            try:
                os.mkdir(name, 0o700, dir_fd=self._root_fd)
            except FileExistsError:
                pass
        self._incoming_fd = os.open(INCOMING, _DIR_FLAGS, dir_fd=self._root_fd)
        self._meta_fd = os.open(META, _DIR_FLAGS, dir_fd=self._root_fd)
        self._remove_leftovers()
        self._lock = threading.RLock()
        self._meta: dict[str, dict[str, list]] = {}
        self._dirty: set[str] = set()
        self._persisted_at: dict[str, float] = {}
        self._closed = False

    def _remove_leftovers(self) -> None:
        """What a crashed owner left: every upload in ``.incoming``, every temp sidecar in ``.meta``
        (the store's owner is the only writer of both; see the module docstring)."""
        for name in os.listdir(self._incoming_fd):
            _unlink_quietly(name, self._incoming_fd)
        for name in os.listdir(self._meta_fd):
            res = parse_reserved(name)
            if res is not None and res.kind is Kind.TMP:
                _unlink_quietly(name, self._meta_fd)

    # ------------------------------------------------------------ paths

    def _open_dir(self, namespace: str, segs: tuple[str, ...], create: bool) -> int:
        """An O_NOFOLLOW fd of ``root/namespace/segs...`` (created when ``create``); NotFound if absent."""
        fd = os.dup(self._root_fd)
        try:
            for s in (namespace, *segs):
                try:
                    nfd = os.open(s, _DIR_FLAGS, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        raise NotFound(f"{namespace}/{'/'.join(segs)}: not found") from None
                    try:
                        os.mkdir(s, 0o755, dir_fd=fd)
                        fsync_dir_fd(fd)
                    except FileExistsError:
                        pass
                    nfd = self._open_component(fd, s, namespace, segs)
                except OSError as e:
                    if e.errno in (errno.ELOOP, errno.ENOTDIR):
                        raise InvalidPath(f"{namespace}/{'/'.join(segs)}: component {s!r} is a symlink "
                                          f"or not a directory") from None
                    raise
                os.close(fd)
                fd = nfd
            return fd
        except BaseException:
            os.close(fd)
            raise

    @staticmethod
    def _open_component(fd: int, s: str, namespace: str, segs: tuple[str, ...]) -> int:
        try:
            return os.open(s, _DIR_FLAGS, dir_fd=fd)
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENOTDIR):
                raise InvalidPath(f"{namespace}/{'/'.join(segs)}: component {s!r} is a symlink "
                                  f"or not a directory") from None
            raise

    def path_of(self, namespace: str, relpath: str) -> Path:
        """The on-disk path of a stored file (validated; every existing component checked for symlinks)."""
        validate_namespace(namespace)
        segs = validate_relpath(relpath)
        path = self.root / namespace / Path(*segs)
        cur = self.root
        for s in (namespace, *segs):
            cur = cur / s
            try:
                if stat.S_ISLNK(os.lstat(cur).st_mode):
                    raise InvalidPath(f"{namespace}/{relpath}: component {s!r} is a symlink")
            except FileNotFoundError:
                break
        real = os.path.realpath(path)
        root_real = os.path.realpath(self.root)
        if os.path.commonpath([real, root_real]) != root_real:
            raise InvalidPath(f"{namespace}/{relpath}: resolves outside the store")
        return path

    # ------------------------------------------------------------ writes

    def begin_write(self, namespace: str, relpath: str, size: int, xxh3: str) -> IncomingFile:
        validate_namespace(namespace)
        segs = validate_relpath(relpath)
        if not isinstance(size, int) or size < 0:
            raise InvalidPath(f"invalid size {size!r}")
        xxh3 = (xxh3 or "").lower()
        if not _HEX128_RE.match(xxh3):
            raise InvalidPath(f"invalid xxh3-128 {xxh3!r}: want 32 lowercase hex digits")
        self._check_target(namespace, segs)
        return IncomingFile(self, namespace, segs, size, xxh3)

    def _check_target(self, namespace: str, segs: tuple[str, ...]) -> None:
        """Refuse early (before the body is read) what _install would refuse anyway."""
        try:
            fd = self._open_dir(namespace, segs[:-1], create=False)
        except NotFound:
            return
        try:
            st = os.stat(segs[-1], dir_fd=fd, follow_symlinks=False)
            if not stat.S_ISREG(st.st_mode):
                raise InvalidPath(f"{namespace}/{'/'.join(segs)}: exists and is not a regular file")
        except FileNotFoundError:
            pass
        finally:
            os.close(fd)

    def _install(self, namespace: str, segs: tuple[str, ...], incoming_name: str, st: os.stat_result,
                 digest: str) -> None:
        fd = self._open_dir(namespace, segs[:-1], create=True)
        try:
            try:
                old = os.stat(segs[-1], dir_fd=fd, follow_symlinks=False)
                if not stat.S_ISREG(old.st_mode):
                    raise InvalidPath(f"{namespace}/{'/'.join(segs)}: exists and is not a regular file")
            except FileNotFoundError:
                pass
            os.replace(incoming_name, segs[-1], src_dir_fd=self._incoming_fd, dst_dir_fd=fd)
            fsync_dir_fd(fd)
            final = os.stat(segs[-1], dir_fd=fd, follow_symlinks=False)
        finally:
            os.close(fd)
        self._remember(namespace, "/".join(segs), final, digest)

    def put_file(self, namespace: str, relpath: str, src: str | os.PathLike, entry: FileEntry) -> FileEntry:
        """Copy a local file into the store through the same verify-then-rename path as an upload.
        ``src`` must be a regular file, not a symlink (InvalidPath): a checkpoint file never is one."""
        src = Path(src)
        try:
            src_fd = open_nofollow(src.parent, src.name)
        except UnsafeFileError as e:
            raise InvalidPath(f"source {src}: {e.strerror}") from None
        with os.fdopen(src_fd, "rb") as f:
            return self._put_from(namespace, relpath, f, entry)

    def _put_from(self, namespace: str, relpath: str, f, entry: FileEntry) -> FileEntry:
        inc = self.begin_write(namespace, relpath, entry.size, entry.xxh3_128)
        try:
            while chunk := f.read(4 << 20):
                inc.write(chunk)
        except BaseException:
            inc.abort()
            raise
        return inc.commit()

    # ------------------------------------------------------------ reads

    def open_read(self, namespace: str, relpath: str) -> tuple[int, FileEntry]:
        """An fd open for reading (caller closes) and its entry. NotFound / InvalidPath otherwise."""
        validate_namespace(namespace)
        segs = validate_relpath(relpath)
        dfd = self._open_dir(namespace, segs[:-1], create=False)
        try:
            try:
                fd = open_regular_at(dfd, segs[-1])
            except FileNotFoundError:
                raise NotFound(f"{namespace}/{relpath}: not found") from None
            except UnsafeFileError as e:
                if e.errno == errno.ELOOP:
                    raise InvalidPath(f"{namespace}/{relpath}: is a symlink") from None
                raise NotFound(f"{namespace}/{relpath}: not a regular file") from None
        finally:
            os.close(dfd)
        try:
            st = os.fstat(fd)
            entry = self._entry_for(namespace, "/".join(segs), st, fd)
            return fd, entry
        except BaseException:
            os.close(fd)
            raise

    def entry(self, namespace: str, relpath: str) -> FileEntry:
        fd, entry = self.open_read(namespace, relpath)
        os.close(fd)
        return entry

    def index(self, namespace: str) -> dict[str, FileEntry]:
        """Every regular file of ``namespace`` (symlinks and other oddities skipped) with size and xxh3."""
        validate_namespace(namespace)
        try:
            nfd = self._open_dir(namespace, (), create=False)
        except NotFound:
            return {}
        out: dict[str, FileEntry] = {}
        seen: set[str] = set()
        try:
            for rel, name, dfd in self._walk_files(nfd):
                try:
                    validate_relpath(rel)
                except InvalidPath:
                    continue  # put there by hand; not addressable through the API
                try:
                    fd = open_regular_at(dfd, name)  # symlinks and non-regular files are not offered
                except OSError:
                    continue
                try:
                    out[rel] = self._entry_for(namespace, rel, os.fstat(fd), fd)
                    seen.add(rel)
                finally:
                    os.close(fd)
        finally:
            os.close(nfd)
        with self._lock:
            meta = self._load_meta(namespace)
            gone = set(meta) - seen
            for rel in gone:
                del meta[rel]
            if gone:
                self._dirty.add(namespace)
            self._persist(namespace, force=False, min_age=0.0)
        return out

    def _walk_files(self, top_fd: int) -> Iterator[tuple[str, str, int]]:
        """(relpath, name, dir_fd) of every non-directory below ``top_fd``; never follows symlinks."""
        fd_copy = os.dup(top_fd)
        try:
            for dirpath, _dirnames, filenames, dfd in os.fwalk(".", dir_fd=fd_copy, follow_symlinks=False):
                base = "" if dirpath == "." else dirpath[2:] + "/"
                for name in filenames:
                    yield base + name, name, dfd
        finally:
            os.close(fd_copy)

    # ------------------------------------------------------------ delete

    def delete(self, namespace: str, prefix: str) -> int:
        """Delete ``prefix`` (a file, or a directory and everything under it) from ``namespace``;
        ``prefix=""`` deletes the whole namespace. Prefixes match whole segments: ``step_1`` never
        deletes ``step_10``. Returns the number of files removed (0 when nothing matched)."""
        validate_namespace(namespace)
        segs = validate_relpath(prefix, allow_empty=True)
        removed = 0
        try:
            if not segs:
                pfd = os.dup(self._root_fd)
                name = namespace
            else:
                pfd = self._open_dir(namespace, segs[:-1], create=False)
                name = segs[-1]
        except NotFound:
            return 0
        try:
            try:
                st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
            except FileNotFoundError:
                return 0
            if stat.S_ISDIR(st.st_mode):
                dfd = os.open(name, _DIR_FLAGS, dir_fd=pfd)
                try:
                    removed = self._rmtree_contents(dfd)
                finally:
                    os.close(dfd)
                os.rmdir(name, dir_fd=pfd)
            else:
                os.unlink(name, dir_fd=pfd)
                removed = 1
            fsync_dir_fd(pfd)
        finally:
            os.close(pfd)
        with self._lock:
            meta = self._load_meta(namespace)
            pre = "/".join(segs)
            for rel in [r for r in meta if not pre or r == pre or r.startswith(pre + "/")]:
                del meta[rel]
            self._dirty.add(namespace)
            self._persist(namespace, force=True)
        return removed

    def _rmtree_contents(self, dfd: int) -> int:
        removed = 0
        for name in os.listdir(dfd):
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                sub = os.open(name, _DIR_FLAGS, dir_fd=dfd)
                try:
                    removed += self._rmtree_contents(sub)
                finally:
                    os.close(sub)
                os.rmdir(name, dir_fd=dfd)
            else:
                os.unlink(name, dir_fd=dfd)  # a symlink itself is removed, never its target
                removed += 1
        return removed

    # ------------------------------------------------------------ checksum cache

    def _meta_name(self, namespace: str) -> str:
        return namespace + ".json"

    def _load_meta(self, namespace: str) -> dict[str, list]:
        meta = self._meta.get(namespace)
        if meta is None:
            meta = {}
            try:
                fd = os.open(self._meta_name(namespace), os.O_RDONLY | os.O_NOFOLLOW, dir_fd=self._meta_fd)
                with os.fdopen(fd, "rb") as f:
                    data = json.loads(f.read())
                if isinstance(data, dict):
                    for k, v in data.items():
                        if (isinstance(v, list) and len(v) == 4 and all(isinstance(x, int) for x in v[:3])
                                and isinstance(v[3], str) and _HEX128_RE.match(v[3])):
                            meta[k] = v
            except (OSError, ValueError):
                pass
            self._meta[namespace] = meta
        return meta

    def _remember(self, namespace: str, rel: str, st: os.stat_result, digest: str) -> None:
        with self._lock:
            self._load_meta(namespace)[rel] = [st.st_size, st.st_mtime_ns, st.st_ino, digest]
            self._dirty.add(namespace)
            self._persist(namespace, force=False)

    def _entry_for(self, namespace: str, rel: str, st: os.stat_result, fd: int) -> FileEntry:
        with self._lock:
            cached = self._load_meta(namespace).get(rel)
        if cached and cached[0] == st.st_size and cached[1] == st.st_mtime_ns and cached[2] == st.st_ino:
            return FileEntry(st.st_size, cached[3])
        entry = hash_fd(fd)  # a fresh fd: from offset 0 (readers of open_read's fd use pread)
        st2 = os.fstat(fd)
        if st2.st_size == st.st_size and st2.st_mtime_ns == st.st_mtime_ns:
            self._remember(namespace, rel, st2, entry.xxh3_128)
        return entry

    def _persist(self, namespace: str, force: bool, min_age: float = _PERSIST_EVERY_S) -> None:
        """Write the sidecar if dirty (and, unless forced, not written within ``min_age`` seconds)."""
        if namespace not in self._dirty or self._closed:
            return
        now = time.monotonic()
        if not force and now - self._persisted_at.get(namespace, 0.0) < min_age:
            return
        data = json.dumps(self._meta.get(namespace, {}), separators=(",", ":")).encode()
        tmp = reserved_name(Kind.TMP, self._meta_name(namespace))
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=self._meta_fd)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, self._meta_name(namespace), src_dir_fd=self._meta_fd, dst_dir_fd=self._meta_fd)
        except OSError:
            try:
                os.unlink(tmp, dir_fd=self._meta_fd)
            except OSError:
                pass
            return
        self._dirty.discard(namespace)
        self._persisted_at[namespace] = now

    def flush(self) -> None:
        with self._lock:
            for ns in list(self._dirty):
                self._persist(ns, force=True)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self.flush()
            self._closed = True
            for fd in (self._incoming_fd, self._meta_fd, self._root_fd):
                try:
                    os.close(fd)
                except OSError:
                    pass

    def __enter__(self) -> "ReplicaStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()





def _unlink_quietly(name: str, dir_fd: int) -> None:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except OSError:
        pass
