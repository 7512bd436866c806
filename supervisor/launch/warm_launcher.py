"""A pre-warmed ``torchrun``: the process that becomes the next attempt's job root, spawned ahead.

A restart of a ``torchrun`` job used to pay a fresh interpreter and ``import torch.distributed.run``
(1.5 s idle, ~3 s on a loaded node) before torchrun even spawned its workers. While an attempt runs,
the supervisor spawns a *zygote* instead: the job's own interpreter running this file, exactly
like a job root (own session, ``PR_SET_PDEATHSIG``, output piped, the job's environment and working
directory), which imports ``torch.distributed.run``, starts the workers' warm ranks (``warm_pool.py``),
reports ready on a pipe and blocks reading one JSON message on stdin. It runs with ``-u`` and imports
torch under the ``OMP_NUM_THREADS=1`` torchrun gives a several-rank node's workers (then drops it again),
as the workers start: so its ranks can be forked from it.
When the next attempt starts, the supervisor writes ``{argv0, argv, env, cwd, path0}``; the zygote
replaces its environment (clear + update, so the workers inherit exactly the attempt's environment),
changes directory, points stdin at /dev/null, sets ``sys.argv`` and runs ``sys.exit(main())`` as the
``torchrun`` console script does (same exit codes, same ChildFailedError report and error file).

A zygote that is not ready in time, died, or could not take the message is killed and the attempt is
launched cold; one never used is killed when the supervisor ends (and dies with it on SIGKILL).

Only ``torchrun ...`` (a standard console script: its interpreter read from the shebang, the one
torchrun itself would run under) and ``<python> -m torch.distributed.run ...`` are launched warm.
The zygote runs this file by path (``<python> .../supervisor/launch/warm_launcher.py``), not ``-m
supervisor.launch.warm_launcher``: the job's interpreter need not have rlsup installed, no PYTHONPATH entry
has to be added (and leak into the import), and a ``supervisor`` package in the job's directory
cannot shadow it. Its first act is to set ``sys.path[0]`` to what the cold launch has (the console
script's directory, or the working directory for ``-m``), so torch is imported exactly as there. So
this file imports nothing outside the standard library at module level (``supervisor.processes.job`` is
imported lazily, on the supervisor side only).
"""

from __future__ import annotations

import gc
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

if TYPE_CHECKING:
    from supervisor.processes.job import JobProcess

TORCHRUN_MODULE = "torch.distributed.run"
#: The seed of torch's default generator after an import that does not draw one at random (c10's
#: ``default_rng_seed_val``): ranks forked from the zygote then share its state, as cold ranks would.
TORCH_DEFAULT_SEED = 67280421310721
READY = b"R"
_FILE = os.path.abspath(__file__)
_PIP_SH_SHEBANG = re.compile(r"""^'''exec' "?([^"\s]+)"? "\$0" "\$@"$""", re.M)


# ------------------------------------------------------------------------------ supervisor side


class WarmSpec:
    """How a command would run warm: interpreter, torchrun's argv, and how the cold launch sets up
    ``sys.argv[0]`` and ``sys.path[0]`` (``script``: the console script; ``module``: ``-m``)."""

    def __init__(self, python: str, argv0: str, args: list[str], mode: str, path0: str) -> None:
        self.python, self.argv0, self.args, self.mode, self.path0 = python, argv0, args, mode, path0


def warm_spec(command: Sequence[str], env: Mapping[str, str], cwd: str | None = None) -> WarmSpec | None:
    """A :class:`WarmSpec` when ``command`` is ``torchrun ...`` or ``<python> -m torch.distributed.run ...``
    and its interpreter can be found; None otherwise (launched cold)."""
    if not command or not os.path.isfile(_FILE):
        return None
    cwd = cwd or os.getcwd()
    path = env.get("PATH", os.defpath)
    head = os.path.basename(command[0])
    if head == "torchrun":
        script = _which(command[0], path, cwd)
        python = _console_script_python(script, path, cwd) if script else None
        if python is None or script is None:
            return None
        # Python puts the script's directory (symlinks resolved) first on sys.path.
        return WarmSpec(python, script, list(command[1:]), "script", os.path.dirname(os.path.realpath(script)))
    if re.fullmatch(r"python[0-9.]*", head) and list(command[1:3]) == ["-m", TORCHRUN_MODULE]:
        python = _which(command[0], path, cwd)
        if python is None:
            return None
        return WarmSpec(python, "", list(command[3:]), "module", cwd)
    return None


def nproc_hint(args: Sequence[str]) -> int | None:
    """torchrun's ``--nproc-per-node`` as a number, read without torch (1 when absent; None for ``auto``,
    ``gpu`` and the like): the zygote imports torch under the ``OMP_NUM_THREADS=1`` torchrun gives the
    workers of a several-rank node, so that its ranks may be forked from it (``warm_pool.fork_unfit``)."""
    from supervisor.launch.rank_pinning import TORCHRUN_FLAGS, TORCHRUN_VALUE_OPTIONS

    args = list(args)
    i = 0
    while i < len(args):
        arg = args[i]
        name, eq, value = arg.partition("=")
        if arg in TORCHRUN_FLAGS:
            i += 1
            continue
        if eq and name in TORCHRUN_VALUE_OPTIONS:
            i += 1
        elif arg in TORCHRUN_VALUE_OPTIONS and i + 1 < len(args):
            name, value = arg, args[i + 1]
            i += 2
        else:
            break  # the training script: what follows is its own
        if name in ("--nproc-per-node", "--nproc_per_node"):
            return int(value) if value.isdigit() else None
    return 1


def _which(name: str, path: str, cwd: str) -> str | None:
    if os.sep in name:
        full = os.path.join(cwd, name)
        return full if os.access(full, os.X_OK) and os.path.isfile(full) else None
    found = shutil.which(name, path=path)
    return os.path.abspath(found) if found else None


def _console_script_python(script: str, path: str, cwd: str) -> str | None:
    """The interpreter of a standard ``torchrun`` console script (the one cold torchrun runs under),
    or None for anything else: a wrapper script might do more than call ``main()``."""
    try:
        with open(script, "rb") as f:
            text = f.read(4096).decode("utf-8", "replace")
    except OSError:
        return None
    if "from torch.distributed.run import main" not in text or not text.startswith("#!"):
        return None
    shebang = text.splitlines()[0][2:].strip()
    if shebang in ("/bin/sh", "/usr/bin/sh"):  # pip's form for long paths: '''exec' "/path/python" "$0" "$@"
        m = _PIP_SH_SHEBANG.search(text)
        return m.group(1) if m and os.access(m.group(1), os.X_OK) else None
    parts = shebang.split()
    if not parts:
        return None
    if os.path.basename(parts[0]) == "env" and len(parts) == 2:
        return _which(parts[1], path, cwd)
    if len(parts) == 1 and os.path.isabs(parts[0]) and os.access(parts[0], os.X_OK):
        return parts[0]
    return None  # interpreter flags in the shebang: not something to reproduce here


class Zygote:
    """A spawned, importing-or-waiting warm launcher; :meth:`start` turns it into a job root.

    Spawned like a cold job root, with the running attempt's environment and the supervisor's working
    directory (relative PYTHONPATH entries, LOGLEVEL and the like act at start-up and import time)."""

    def __init__(self, spec: WarmSpec, env: Mapping[str, str], cwd: str | None = None,
                 warm_imports: Sequence[str] = (), warm_cuda: bool = False, warm_fork: bool = True) -> None:
        from supervisor.processes.job import JobProcess, spawn_job_root

        self.spec = spec
        self.output_left = ""  # what a zygote that was discarded unused had printed (an import error)
        self.warm_pids: list[int] = []  # its warm ranks (warm_pool.py), known once it is ready
        ready_r, ready_w = os.pipe()
        # ``-u`` as torchrun starts its workers: ranks forked from the zygote keep its flags
        argv = [spec.python, "-u", _FILE, "--ready-fd", str(ready_w), "--path0", spec.path0,
                "--args-json", json.dumps(list(spec.args)), "--warm-imports", json.dumps(list(warm_imports)),
                "--warm-cuda", "1" if warm_cuda else "0", "--warm-fork", "1" if warm_fork else "0",
                "--omp-one", "1" if warm_fork and "OMP_NUM_THREADS" not in env and (nproc_hint(spec.args) or 1) > 1
                else "0"]
        try:
            self.popen = spawn_job_root(argv, env, cwd=cwd, stdin=subprocess.PIPE, pass_fds=(ready_w,))
        except BaseException:
            os.close(ready_r)
            raise
        finally:
            os.close(ready_w)
        self._ready_r: int | None = ready_r
        self._ready = False
        self.pid = self.popen.pid
        self.spawned = time.monotonic()
        JobProcess.helpers.add(self.pid)  # not a member of the running attempt's tree

    def alive(self) -> bool:
        return self.popen.poll() is None

    def wait_ready(self, timeout: float) -> bool:
        """True once the zygote imported torchrun and waits for its message; False if it died or is late."""
        deadline = time.monotonic() + timeout
        while not self._ready and self._ready_r is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            readable, _, _ = select.select([self._ready_r], [], [], min(left, 0.5))
            if readable:
                data = os.read(self._ready_r, 65536)
                os.close(self._ready_r)
                self._ready_r = None
                self._ready = data.startswith(READY)
                self._note_warm_ranks(data[len(READY):])
        return self._ready and self.alive()

    def _note_warm_ranks(self, data: bytes) -> None:
        """The zygote's warm ranks are rlsup's helpers until the attempt starts (if the zygote dies they
        are re-parented to rlsup, and must not look like members of the running attempt)."""
        from supervisor.processes.job import JobProcess

        try:
            self.warm_pids = [int(p) for p in json.loads(data or b"[]")]
        except (ValueError, TypeError):
            self.warm_pids = []
        JobProcess.helpers.update(self.warm_pids)

    def start(self, args: Sequence[str] | None, env: Mapping[str, str], cwd: str, log_path: Path,
              tail_lines: int, ready_timeout: float = 30.0) -> "JobProcess | None":
        """Hand the zygote its attempt; the running job, or None (zygote discarded: launch cold)."""
        from supervisor.processes.job import JobProcess

        if not self.wait_ready(ready_timeout):
            self.discard()
            return None
        message = {"argv0": self.spec.argv0, "argv": list(self.spec.args if args is None else args),
                   "env": dict(env), "cwd": cwd, "mode": self.spec.mode}
        assert self.popen.stdin is not None
        try:
            self.popen.stdin.write(json.dumps(message).encode())
            self.popen.stdin.close()
        except (BrokenPipeError, OSError, ValueError):
            self.discard()
            return None
        JobProcess.helpers.discard(self.pid)
        JobProcess.helpers.difference_update(self.warm_pids)  # now workers of the attempt, or killed by it
        return JobProcess.from_popen(self.popen, log_path, tail_lines)

    def discard(self) -> None:
        """Kill an unused zygote (its own session) and reap it."""
        from supervisor.processes.job import JobProcess

        JobProcess.helpers.discard(self.pid)
        _kill(self.warm_pids)  # first, while they are the zygote's (unreaped, so their pids are not reused)
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.popen.kill()
        except OSError:
            pass
        try:
            self.popen.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        if self.popen.stdout is not None and not self.popen.stdout.closed:
            try:  # the pipe's writer is gone: this never blocks, but do not rely on it
                os.set_blocking(self.popen.stdout.fileno(), False)
                self.output_left = (self.popen.stdout.read(65536) or b"").decode("utf-8", "replace")
            except (OSError, ValueError):
                pass
        for stream in (self.popen.stdin, self.popen.stdout):
            try:
                if stream is not None:
                    stream.close()
            except OSError:
                pass
        if self._ready_r is not None:
            os.close(self._ready_r)
            self._ready_r = None
        _reap(self.warm_pids)
        JobProcess.helpers.difference_update(self.warm_pids)


def _kill(pids: Sequence[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _reap(pids: Sequence[int], timeout: float = 5.0) -> None:
    """A dead zygote's warm ranks are re-parented to rlsup (a subreaper): collect them."""
    left = set(pids)
    deadline = time.monotonic() + timeout
    while left and time.monotonic() < deadline:
        for pid in list(left):
            try:
                if os.waitpid(pid, os.WNOHANG)[0] == pid:
                    left.discard(pid)
            except ChildProcessError:  # not (yet) re-parented to us, or reaped elsewhere
                if not os.path.exists(f"/proc/{pid}"):
                    left.discard(pid)
        if left:
            time.sleep(0.02)


# ------------------------------------------------------------------------------ zygote side


def _arg(argv: list[str], name: str, default: str) -> str:
    return argv[argv.index(name) + 1] if name in argv else default


def _load_warm_pool() -> Any:
    """``warm_pool.py`` beside this file, by path: the zygote's sys.path is the job's, not rlsup's."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_rlsup_warm_pool", os.path.join(os.path.dirname(_FILE),
                                                                                  "warm_pool.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _zygote_main(argv: list[str]) -> None:
    ready_fd = int(argv[argv.index("--ready-fd") + 1])
    # The cold launch's sys.path[0] (not this file's directory) before anything is imported; with
    # PYTHONSAFEPATH / -P neither launch prepends a directory, and sys.path[0] is not ours to change.
    safe_path = getattr(sys.flags, "safe_path", False)
    if not safe_path:
        sys.path[0] = argv[argv.index("--path0") + 1]
    omp_one = _arg(argv, "--omp-one", "0") == "1" and "OMP_NUM_THREADS" not in os.environ
    if omp_one:  # torch loads libgomp, which reads it then: as the workers' own import will (fork_unfit)
        os.environ["OMP_NUM_THREADS"] = "1"
    import torch.distributed.run as torchrun  # the slow part, done before the attempt starts
    gc.collect()
    gc.freeze()  # torch's objects live as long as the launcher: never walked by the collector again (0.4 s at exit)

    warm_pool = _load_warm_pool()
    fork = _arg(argv, "--warm-fork", "1") == "1"
    generator = sys.modules["torch"].default_generator
    state = generator.get_state() if generator.initial_seed() == TORCH_DEFAULT_SEED else None
    if fork:  # under the environment the fork check compares with the workers'
        environ = dict(os.environ)
        warm_pool.import_lazy()
        os.environ.clear()  # what the import set (torch._inductor: TORCHINDUCTOR_CACHE_DIR) is not the workers'
        os.environ.update(environ)
    start = warm_pool.ForkStart(dict(os.environ), None if safe_path else sys.path[0], state)
    if omp_one:
        del os.environ["OMP_NUM_THREADS"]
    pool = warm_pool.WarmPool.spawn(json.loads(_arg(argv, "--args-json", "[]")),
                                    json.loads(_arg(argv, "--warm-imports", "[]")),
                                    warm_cuda=_arg(argv, "--warm-cuda", "0") == "1",
                                    start=start if fork else None)
    os.write(ready_fd, READY + json.dumps(pool.pids()).encode())
    os.close(ready_fd)
    data = sys.stdin.buffer.read()
    if not data:  # the supervisor closed the pipe without a message: never used
        pool.discard()
        sys.exit(0)
    message = json.loads(data)
    null = os.open(os.devnull, os.O_RDONLY)  # a cold job root has stdin on /dev/null; workers inherit it
    os.dup2(null, 0)
    os.close(null)
    os.environ.clear()
    os.environ.update(message["env"])
    os.chdir(message["cwd"])
    if message["mode"] == "module":  # python -m torch.distributed.run: argv[0] is the module file
        argv0 = torchrun.__file__
        if not safe_path:
            sys.path[0] = os.getcwd()
    else:  # the console script: sys.path[0] is already its directory
        argv0 = message["argv0"].removesuffix(".exe")
    sys.argv = [argv0, *message["argv"]]
    warm_pool.install(pool, message["argv"])
    # Mirrors the torchrun console script: ``sys.exit(main())``; a ChildFailedError propagates (traceback
    # with torchrun's root-cause report, exit 1) exactly as there.
    sys.exit(torchrun.main())


if __name__ == "__main__":
    _zygote_main(sys.argv[1:])
