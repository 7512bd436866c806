"""The zygote's warm ranks: pre-started workers that torchrun's worker spawn hands its ranks to.

The warm launcher's zygote already knows the next attempt's torchrun arguments. It parses them with
torchrun's own parser and starts ``nproc_per_node`` warm ranks (``warm_rank.py``), each what torch's
``SubprocessHandler`` would spawn as a worker (``python -u``, own session, stdout/stderr inherited, the
attempt's environment with the ``OMP_NUM_THREADS=1`` torchrun adds, the working directory), plus a
message pipe and a parent-death signal so an unused one dies with the zygote.

They are **forked** from the zygote, which imported torch (and ``torch._dynamo``) once for all of them,
where a fork is what a spawn would be (:func:`fork_unfit`: the workers' interpreter, torch imported under
their start-up environment, no module the zygote imported found elsewhere from the worker's ``sys.path[0]``, a zygote of
one thread); a fork saves each rank its own import (~2 s of CPU on 2 cores, and its memory is shared until
written). Otherwise, and saying why, they are **spawned** as fresh interpreters that import torch
themselves. What a fork cannot make fresh: Python's ``str`` hash seed, drawn once per interpreter, is the
zygote's in all its ranks (a cold start draws one per rank unless ``PYTHONHASHSEED`` is set; no trainer can
rely on either, as hashes already differ between runs). Before ``torchrun.main()``
runs, :func:`install` replaces torch's ``get_subprocess_handler`` with one whose ``_popen`` gives a
ready warm rank the worker's ``{argv, env, cwd}`` and returns that rank's ``Popen``: torchrun's
monitoring, ``close()`` (killpg), exit codes and error files work unchanged.

With ``warm_cuda`` on a node with NVIDIA GPUs (``/dev/nvidiactl``; nothing more is looked at where it is
absent), warm rank *i* also creates its CUDA context on device *i* while it waits, and becomes the worker
of local rank *i* (torchrun's ``LOCAL_RANK``; the usual ``torch.cuda.set_device(LOCAL_RANK)``).

Anything unusual launches that worker cold, as torch would, and says so once on stderr: torchrun
options that change how workers start (``--no-python``, ``--run-path``, redirects or tee, NUMA
binding, virtual local ranks), a worker command other than the one warmed, a variable read at
interpreter start or import that differs between the warm rank's environment and the worker's, another
working directory, a warm rank that is not ready in time or died.

Loaded by path inside the zygote (which has the job's ``sys.path``, not rlsup's), so this file imports
only the standard library at module level; torch is imported lazily.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

WARM_RANK_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "warm_rank.py")
PREFIX = "[rlsup] warm ranks: "
READY_TIMEOUT = 30.0
# Read when an interpreter starts or torch (or a BLAS, or the allocator) is imported: a warm rank that
# started under other values is not what a cold start would be.
# CUDA_ and PYTORCH_ (CUDA_VISIBLE_DEVICES, PYTORCH_CUDA_ALLOC_CONF) act when a CUDA-warm rank starts CUDA.
STARTUP_PREFIXES = ("PYTHON", "OMP_", "MKL_", "KMP_", "GOMP_", "OPENBLAS_", "LD_", "MALLOC_", "LC_", "TORCH",
                    "CUDA_", "PYTORCH_")
STARTUP_NAMES = ("LANG", "TZ", "HOME", "TMPDIR")
# What torchrun's agent sets per worker itself (never read at import).
AGENT_SET_PREFIXES = ("TORCHELASTIC_",)
AGENT_SET_NAMES = ("TORCH_NCCL_ASYNC_ERROR_HANDLING",)
NVIDIA_CONTROL = "/dev/nvidiactl"  # the driver's control device: present on every node with NVIDIA GPUs


def rlsup_line(text: str) -> str:
    """``text`` in rlsup's line shape (time, node, attempt: supervisor/log.py, which this file cannot import),
    read from the attempt's environment the zygote runs under (no RLSUP_NODE_RANK: a single node, n0)."""
    ms = int(time.time() * 1000)
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ms // 1000)) + f".{ms % 1000:03d}Z"
    # rlsup_format.job_env.NODE_RANK and RESTART_COUNT, spelled here: this file imports only the standard library
    return (f"{stamp} n{os.environ.get('RLSUP_NODE_RANK', '0')} a{os.environ.get('RLSUP_RESTART_COUNT', '-')} "
            f"{PREFIX}{text}")


def _say_line(text: str) -> None:
    """One of rlsup's lines on the launcher's stderr in one write: the zygote runs with ``-u``, where ``print``
    writes the text and its newline apart, and a rank's output could land in between."""
    sys.stderr.write(rlsup_line(text) + "\n")
    sys.stderr.flush()


def startup_env(env: Mapping[str, str]) -> dict[str, str]:
    """The part of an environment that acts at interpreter start or import."""
    return {k: v for k, v in env.items()
            if (k.startswith(STARTUP_PREFIXES) or k in STARTUP_NAMES)
            and not k.startswith(AGENT_SET_PREFIXES) and k not in AGENT_SET_NAMES}


def env_difference(spawned: Mapping[str, str], worker: Mapping[str, str]) -> list[str]:
    """Start-up variables that differ between a warm rank's environment and the worker's."""
    a, b = startup_env(spawned), startup_env(worker)
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))


def worker_command(args: Any, python: str) -> tuple[list[str] | None, str]:
    """torchrun's worker command for parsed ``args`` (``python -u [-m] target``), or None and why not."""
    if args.no_python:
        return None, "--no-python"
    if args.run_path:
        return None, "--run-path"
    if str(args.redirects) not in ("0", "") or str(args.tee) not in ("0", ""):
        return None, "worker output redirected (--redirects/--tee)"
    if getattr(args, "numa_binding", None) is not None:
        return None, "--numa-binding"
    if getattr(args, "virtual_local_rank", False):
        return None, "--virtual-local-rank"
    if args.module:
        return [python, "-u", "-m", args.training_script], ""
    script = args.training_script
    if not os.path.isfile(script) or script.endswith((".pyc", ".pyo")) or zipfile.is_zipfile(script):
        return None, f"training script {script!r} is not a plain source file"
    return [python, "-u", script], ""


class WarmRank:
    """One pre-started worker: its Popen (what torchrun will hold), its ready pipe, and where its spec goes
    (the Popen's stdin for a spawned rank, a pipe of its own for a forked one)."""

    def __init__(self, popen: subprocess.Popen, ready_r: int, cuda_device: int | None,
                 message_w: int | None = None) -> None:
        self.popen = popen
        self.pid = popen.pid
        self.cuda_device = cuda_device  # the device it made its CUDA context on (None: not CUDA-warm)
        self._ready_r: int | None = ready_r
        self._message_w = message_w
        self._state = ""  # "", "ready", or why not

    @classmethod
    def spawned(cls, command: Sequence[str], imports: Sequence[str], env: Mapping[str, str],
                cuda_device: int | None = None) -> "WarmRank":
        """A fresh ``python -u warm_rank.py`` that imports torch itself, as torch's handler spawns a worker."""
        ready_r, ready_w = os.pipe()
        cuda = [] if cuda_device is None else ["--cuda-device", str(cuda_device)]
        try:
            popen = subprocess.Popen(
                [command[0], "-u", WARM_RANK_FILE, "--ready-fd", str(ready_w), "--parent", str(os.getpid()),
                 "--command", json.dumps(list(command)), "--imports", json.dumps(list(imports)), *cuda],
                env=dict(env), stdin=subprocess.PIPE, start_new_session=True, pass_fds=(ready_w,))
        except BaseException:
            os.close(ready_r)
            raise
        finally:
            os.close(ready_w)
        return cls(popen, ready_r, cuda_device)

    @classmethod
    def forked(cls, command: Sequence[str], imports: Sequence[str], env: Mapping[str, str],
               cuda_device: int | None, torch_state: Any) -> "WarmRank":
        """A child of this zygote, which already imported torch (:func:`fork_unfit` said it may fork)."""
        rank = _warm_rank_module()
        ready_r, ready_w = os.pipe()
        message_r, message_w = os.pipe()
        parent = os.getpid()
        sys.stdout.flush()
        sys.stderr.flush()

        def child() -> None:
            rank.forked(ready_w, message_r, parent, list(command), list(imports), dict(env), cuda_device,
                        torch_state)

        # No ``finally`` here, nor below the fork: the child's trainer leaves through these frames (SystemExit)
        # and must meet no clean-up of the zygote's (these numbers are its files by then).
        try:
            popen = _ForkedPopen(child)
        except OSError:
            for fd in (ready_r, ready_w, message_r, message_w):
                os.close(fd)
            raise
        os.close(ready_w)
        os.close(message_r)
        return cls(popen, ready_r, cuda_device, message_w)

    def wait_ready(self, timeout: float) -> str:
        """"" once the rank imported everything and waits; else why it cannot be used."""
        deadline = time.monotonic() + timeout
        while self._state == "" and self._ready_r is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                return f"warm rank pid {self.pid} not ready after {timeout:.0f}s"
            readable, _, _ = select.select([self._ready_r], [], [], min(left, 0.5))
            if readable:
                data = os.read(self._ready_r, 4096)
                os.close(self._ready_r)
                self._ready_r = None
                self._state = "ready" if data == b"R" else (
                    f"warm rank pid {self.pid} failed: {data[1:].decode('utf-8', 'replace')}" if data
                    else f"warm rank pid {self.pid} died")
        if self._state == "ready" and self.popen.poll() is not None:
            self._state = f"warm rank pid {self.pid} died (exit {self.popen.returncode})"
        return "" if self._state == "ready" else self._state

    def hand_over(self, message: dict) -> str:
        """Send the worker's spec; "" when the rank took it."""
        data = json.dumps(message).encode()
        try:
            if self._message_w is not None:
                fd, self._message_w = self._message_w, None
                try:
                    view = memoryview(data)
                    while view:
                        view = view[os.write(fd, view):]
                finally:
                    os.close(fd)
            else:
                assert self.popen.stdin is not None
                self.popen.stdin.write(data)
                self.popen.stdin.close()
        except (BrokenPipeError, OSError, ValueError):
            return f"warm rank pid {self.pid} died"
        return ""

    def kill(self) -> None:
        try:
            self.popen.kill()
            self.popen.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            pass
        for f in (self.popen.stdin,):
            try:
                if f is not None:
                    f.close()
            except OSError:
                pass
        if self._message_w is not None:
            os.close(self._message_w)
            self._message_w = None
        if self._ready_r is not None:
            os.close(self._ready_r)
            self._ready_r = None


class _ForkedPopen(subprocess.Popen):
    """A ``Popen`` whose child is a fork of this process running ``child`` (never an exec): torchrun's
    handler polls, waits for and signals it as any worker it spawned."""

    def __init__(self, child: Callable[[], None]) -> None:
        self._child_main = child
        super().__init__(["(forked warm rank)"])

    def _execute_child(self, *args: Any, **kwargs: Any) -> None:
        pid = os.fork()
        if pid == 0:
            try:  # the trainer's end leaves as SystemExit (or KeyboardInterrupt) to the interpreter's own exit
                self._child_main()
            except (SystemExit, KeyboardInterrupt):
                raise
            except BaseException:  # noqa: BLE001 - anything else would run the zygote's clean-up in the child
                os._exit(1)
            os._exit(1)
        self.pid = pid
        self._child_created = True


def _warm_rank_module() -> Any:
    """``warm_rank.py`` beside this file, by path (the zygote's sys.path is the job's, not rlsup's)."""
    name = "_rlsup_warm_rank"
    if name not in sys.modules:
        import importlib.util

        spec = importlib.util.spec_from_file_location(name, WARM_RANK_FILE)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


class WarmPool:
    """The warm ranks of one zygote, and the decision, per worker, whether one of them becomes it."""

    def __init__(self, reason: str = "", command: Sequence[str] = (), env: Mapping[str, str] | None = None,
                 nproc: int = 0) -> None:
        self.reason, self.command, self.env, self.nproc = reason, list(command), dict(env or {}), nproc
        self.cwd = os.getcwd()
        self.ranks: list[WarmRank] = []
        self.used: list[int] = []
        self.fork_why = ""  # why its ranks were spawned, not forked from the zygote ("" : forked)
        self._said = False

    @classmethod
    def spawn(cls, torchrun_args: Sequence[str], imports: Sequence[str], warm_cuda: bool = False,
              start: "ForkStart | None" = None) -> "WarmPool":
        """Parse torchrun's arguments as it will, and start its workers' warm ranks (or say why not);
        ``warm_cuda``: on a GPU node, rank *i* makes its CUDA context on device *i*; ``start``: how this
        zygote imported torch, so its ranks may be forked from it (:func:`fork_unfit`); None: spawned."""
        try:
            from torch.distributed.run import determine_local_world_size, parse_args

            args = parse_args(list(torchrun_args))
            nproc = determine_local_world_size(args.nproc_per_node)
        except (Exception, SystemExit) as e:  # noqa: BLE001 - torchrun's parser raises anything on odd arguments: the cold path reports them
            return cls(f"torchrun's arguments not understood ({e})")
        command, why = worker_command(args, os.getenv("PYTHON_EXEC", sys.executable))
        if command is None:
            return cls(why)
        env = dict(os.environ)
        if nproc > 1 and "OMP_NUM_THREADS" not in env:  # what torchrun's config_from_args will add
            env["OMP_NUM_THREADS"] = "1"
        pool = cls("", command, env, nproc)
        cuda = warm_cuda and os.path.exists(NVIDIA_CONTROL)
        pool.fork_why = "warm_fork is off" if start is None else (fork_unfit(command, env, start) or _threads_unfit())
        try:
            for i in range(nproc):
                device = i if cuda else None
                pool.ranks.append(WarmRank.spawned(command, imports, env, device) if pool.fork_why else
                                  WarmRank.forked(command, imports, env, device, start.torch_state))  # type: ignore[union-attr]
        except (OSError, subprocess.SubprocessError) as e:
            pool.discard()
            return cls(f"could not start a warm rank ({e})")
        return pool

    def pids(self) -> list[int]:
        return [r.pid for r in self.ranks]

    def take(self, args: Sequence[str], env: Mapping[str, str], output_files: bool) -> subprocess.Popen | None:
        """The Popen of a warm rank that became this worker, or None: launch it cold (said once)."""
        why = self._unfit(args, env, output_files)
        rank = None if why else self._rank_for(env)
        if rank is None and not why:
            why = f"no warm rank made its CUDA context for LOCAL_RANK {env.get('LOCAL_RANK')}"
        if rank is not None:
            self.ranks.remove(rank)
            why = rank.wait_ready(READY_TIMEOUT) or rank.hand_over(
                {"argv": list(args), "env": dict(env), "cwd": os.getcwd(), "stdin": os.devnull,
                 "caught": _caught_signals()})
            if not why:
                self.used.append(rank.pid)
                return rank.popen
            rank.kill()
        self._say(why)
        return None

    def _rank_for(self, env: Mapping[str, str]) -> WarmRank | None:
        """The next warm rank, or for CUDA-warm ones the one whose device is the worker's LOCAL_RANK."""
        if self.ranks[0].cuda_device is None:
            return self.ranks[0]
        local = env.get("LOCAL_RANK", "")
        return next((r for r in self.ranks if str(r.cuda_device) == local), None)

    def _unfit(self, args: Sequence[str], env: Mapping[str, str], output_files: bool) -> str:
        if self.reason:
            return self.reason
        if output_files:
            return "worker output goes to files (log redirects or tee)"
        if list(args[:len(self.command)]) != self.command:
            return f"worker command {list(args[:len(self.command)])} is not the warmed {self.command}"
        differ = env_difference(self.env, env)
        if differ:
            return f"start-up environment differs ({', '.join(differ)})"
        if os.getcwd() != self.cwd:
            return f"working directory changed ({self.cwd} -> {os.getcwd()})"
        try:
            stdin = os.readlink("/proc/self/fd/0")
        except OSError:
            stdin = "?"
        if stdin != os.devnull:
            return f"the launcher's stdin is {stdin}, not {os.devnull}"
        if not self.ranks:
            return "no warm rank left (torchrun restarted its workers, or more workers than warmed)"
        return ""

    def _say(self, why: str) -> None:
        if not self._said:
            self._said = True
            _say_line(f"{why}; launching cold")

    def round_done(self) -> None:
        """torchrun started its workers: say which came from warm ranks, kill the unused ones."""
        if self.used and not self._said:
            how = "forked from the launcher" if not self.fork_why else f"spawned: {self.fork_why}"
            _say_line(f"{len(self.used)} local rank(s) started from warm ranks (pids "
                      f"{', '.join(map(str, self.used))}; {how})")
        self.used = []
        self.discard()

    def discard(self) -> None:
        ranks, self.ranks = self.ranks, []
        for rank in ranks:
            rank.kill()


@dataclass(frozen=True)
class ForkStart:
    """How the zygote imported torch, for :func:`fork_unfit`: the start-up environment then, its
    ``sys.path[0]`` then (None under ``-P``), and torch's default generator state right after the import (None
    where that import seeded it at random: each fork then draws a seed of its own)."""

    env: Mapping[str, str]
    path0: str | None
    torch_state: Any


def fork_unfit(command: Sequence[str], env: Mapping[str, str], start: ForkStart,
               modules: Mapping[str, Any] | None = None) -> str:
    """Why the workers' warm ranks cannot be forked from this zygote ("" : they can).

    A fork has what the zygote imported, as the zygote imported it: so only where a spawned rank would have
    imported the same. The workers' interpreter must be the zygote's (not another ``PYTHON_EXEC``); its start-up
    environment must be the workers' (libgomp, the allocator and torch read
    theirs when torch is loaded: the supervisor starts the zygote with torchrun's ``OMP_NUM_THREADS=1`` for
    that), and no module the zygote imported may resolve otherwise from the worker's ``sys.path[0]`` (a
    module of that name beside the script, or one the zygote found in its own first directory)."""
    modules = sys.modules if modules is None else modules
    if os.path.realpath(command[0]) != os.path.realpath(sys.executable):  # PYTHON_EXEC: another interpreter
        return f"the workers run {command[0]}, not the launcher's interpreter {sys.executable}"
    differ = env_difference(start.env, env)
    if differ:
        return f"the launcher imported torch under another start-up environment ({', '.join(differ)})"
    if start.path0 is None:
        return ""
    mode, target = ("module", command[3]) if len(command) > 3 and command[2] == "-m" else ("script", command[2])
    path0 = os.getcwd() if mode == "module" else os.path.dirname(os.path.realpath(target))
    loaded = {name.partition(".")[0] for name in modules}
    try:
        beside = {entry.partition(".")[0] for entry in os.listdir(path0)} if path0 != start.path0 else set()
    except OSError as e:
        return f"the worker's directory cannot be listed ({e})"
    shadowed = sorted(loaded & beside)
    if shadowed:
        return f"the worker's directory {path0} has modules the launcher imported from elsewhere ({', '.join(shadowed)})"
    own = sorted(name for name, module in modules.items() if path0 != start.path0
                 and os.path.dirname(str(getattr(module, "__file__", None) or "")) == start.path0)
    if own:
        return f"the launcher imported modules from its own directory {start.path0} ({', '.join(own)})"
    return ""


def import_lazy() -> None:
    """Import :data:`warm_rank.TORCH_LAZY` in the zygote, once for every forked rank, under the start-up environment
    :class:`ForkStart` records (before it is built)."""
    import gc
    import importlib

    for name in _warm_rank_module().TORCH_LAZY:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    gc.collect()
    gc.freeze()  # as a spawned warm rank's heap: no collection in a fork walks (and so copies) the imports


def _threads_unfit() -> str:
    """Only a process of one thread forks safely (a thread pool that ran, OpenMP's, hangs the child)."""
    try:
        threads = len(os.listdir("/proc/self/task"))
    except OSError as e:
        return f"the launcher's threads cannot be counted ({e})"
    return "" if threads == 1 else f"the launcher runs {threads} threads"


def install(pool: WarmPool, torchrun_args: Sequence[str]) -> None:
    """Make torchrun's worker spawn use ``pool`` (before ``torchrun.main()`` with ``torchrun_args``)."""
    import torch.distributed.elastic.multiprocessing.api as mp_api
    from torch.distributed.run import determine_local_world_size, parse_args
    from torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler import SubprocessHandler

    class WarmSubprocessHandler(SubprocessHandler):
        """torch's handler; its process is a warm rank when one fits."""

        def _popen(self, args: tuple, env: dict[str, str]) -> subprocess.Popen:
            proc = pool.take(args, env, self._stdout is not None or self._stderr is not None)
            return proc if proc is not None else super()._popen(args, env)

    def get_subprocess_handler(*args: Any, **kwargs: Any) -> SubprocessHandler:
        handler = WarmSubprocessHandler(*args, **kwargs)
        if handler.local_rank_id >= workers - 1 or not pool.ranks:
            pool.round_done()
        return handler

    try:  # how many workers torchrun starts now (the arguments may differ from those warmed)
        args = parse_args(list(torchrun_args))
        workers = determine_local_world_size(args.nproc_per_node)
    except (Exception, SystemExit):  # noqa: BLE001 - odd arguments: warm workers are not used, torchrun reports them itself
        args, workers = None, 0
    mp_api.get_subprocess_handler = get_subprocess_handler  # type: ignore[assignment]
    if args is not None:
        skip_rendezvous_skew(args)


def skip_rendezvous_skew(args: Any) -> None:
    """No random 0-0.3 s sleep before a single node's first rendezvous round.

    torch's dynamic rendezvous sleeps ``uniform(0, 0.3)`` s before round 0 "to skew the rendezvous
    attempts across the nodes"; a single node (``--standalone``, ``--nnodes 1``) has no other node to skew
    against, and every restart of a warm attempt paid it (0.15 s on average, the spread of the restart
    benchmark). Only that tuple-valued delay goes; the 1 s poll of a waiting join stays; several nodes
    keep the skew."""
    from torch.distributed.run import parse_min_max_nnodes
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    try:
        single = bool(args.standalone) or parse_min_max_nnodes(args.nnodes)[1] == 1
    except (Exception, SystemExit):  # noqa: BLE001 - an odd --nnodes: torchrun reports it itself, the skew stays
        return
    delay = dynamic_rendezvous.__dict__.get("_delay")  # absent in some torch: then nothing is changed
    if not single or not callable(delay):
        return

    def no_skew(seconds: float | tuple[float, float]) -> None:
        if not isinstance(seconds, tuple):
            delay(seconds)

    dynamic_rendezvous._delay = no_skew  # type: ignore[attr-defined]


def _caught_signals() -> list[int]:
    """Signals this launcher handles now (torchrun's agent catches SIGTERM, SIGINT, SIGHUP, SIGQUIT
    before it starts workers): a worker it executes starts with them at their default, while a warm
    rank, spawned earlier, inherited whatever this process had then (SIG_IGN under ``nohup``)."""
    import signal

    out = []
    for s in signal.valid_signals():
        try:
            handler = signal.getsignal(s)
        except (ValueError, OSError):
            continue
        if callable(handler):
            out.append(int(s))
    return out
