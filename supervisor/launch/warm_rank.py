"""A pre-started torchrun worker: an interpreter with torch imported that becomes a rank when told.

A restart's new workers used to pay a fresh interpreter plus ``import torch`` (1.5-2 s on 2 cores)
after torchrun spawned them. The warm launcher's zygote (``warm_pool.py``) spawns these ahead, as
torch's ``SubprocessHandler`` spawns a worker (``python -u``, own session, the attempt's environment
and working directory), so the slow part is done while the previous attempt still runs. Each one
sets ``sys.path[0]`` to what the cold worker will have, imports torch and the ``warm_imports``
modules, reports ready on a pipe and blocks reading one JSON message on stdin: the worker's
``{argv, env, cwd}`` as torchrun computed them. It then makes itself what ``python -u script args``
(or ``python -u -m module args``) would have been: environment, directory, stdin, ``sys.argv``,
``sys.orig_argv``, ``sys.path``, a fresh ``__main__``, RNG seeds (Python's and NumPy's reseeded from
the OS as a new interpreter does; torch's default generator put back to its state right after
``import torch``), no parent-death signal, and runs the script.

CUDA-warm (``warm_cuda``, on a GPU node: ``--cuda-device N``): CUDA start-up (the driver's ``cuInit`` and
the device's primary context) is also done while it waits, on device N, the worker's local rank; the
current device is left as a cold start has it (torch's device 0, so a trainer that never calls
``set_device`` sees what it would cold). Skipped, the rank staying an import-only warm rank, where the
device is not in the default compute mode (an exclusive-process GPU would be taken from the running
attempt) or torch sees fewer devices. What differs from a cold start is what any CUDA initialisation
before the script implies: the script can no longer choose its GPUs by setting ``CUDA_VISIBLE_DEVICES``
itself, and a process it forks cannot use CUDA (``warm_cuda: false`` for such trainers).

Forked instead (:func:`forked`, where ``warm_pool.fork_unfit`` allows it), it skips the imports, which the
zygote did once, and on the hand-over also writes the worker's command line over the zygote's in
``/proc/PID/cmdline`` (``ps`` and rlsup's stacks see ``python -u script args``, padded with empty arguments).

Run by path (``<python> -u .../supervisor/launch/warm_rank.py``), not as ``-m supervisor.launch.warm_rank``: the job's
interpreter need not have rlsup installed, and nothing may be imported before ``sys.path[0]`` is set.
So this file imports only the standard library at module level, and nothing that a cold start would
not load on its own, except ``ctypes`` (for ``prctl``).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

READY = b"R"
#: The warm rank's own record of the rank it became, in the attempt's heartbeat directory: its
#: ``/proc/PID/environ`` stays the one it was spawned with (no ``RANK``), so this is where rlsup reads the
#: number of a hung warm-started rank (:func:`supervisor.diagnosis.stacks.tree_roles`).
#: It is rlsup_format.state_files.WARM_RANK_RECORD, spelled here: this file runs without rlsup installed.
RANK_RECORD = "warm_rank.{pid}.json"
#: Parts of torch that torch imports lazily on first use and nearly every trainer reaches at once: the
#: first optimizer built imports the compiler stack, ``torch._dynamo`` (1.5 s of a 2-core restart).
#: Imported ahead like torch itself; a torch without them is simply not warmed further.
TORCH_LAZY = ("torch._dynamo",)
FAILED = b"E"
_CU_DEVICE_ATTRIBUTE_COMPUTE_MODE = 20
_CU_COMPUTEMODE_DEFAULT = 0
_PR_SET_PDEATHSIG = 1
_SIGKILL = 9


def _prctl_pdeathsig(sig: int) -> None:
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)


def _worker_layout(argv: list[str]) -> tuple[str, str, list[str]]:
    """``("script"|"module", target, rest)`` from torchrun's worker command ``python -u [-m] target rest``."""
    if len(argv) >= 4 and argv[1] == "-u" and argv[2] == "-m":
        return "module", argv[3], list(argv[4:])
    if len(argv) >= 3 and argv[1] == "-u" and not argv[2].startswith("-"):
        return "script", argv[2], list(argv[3:])
    raise ValueError(f"not a 'python -u script' or 'python -u -m module' command: {argv[:4]}")


def _set_path0(mode: str, target: str) -> None:
    """``sys.path[0]`` as CPython computes it for ``python script`` (the script's directory, symlinks
    resolved) or ``python -m`` (the working directory); with ``-P``/PYTHONSAFEPATH there is none."""
    if not getattr(sys.flags, "safe_path", False):
        sys.path[0] = os.getcwd() if mode == "module" else os.path.dirname(os.path.realpath(target))


def _script_file(target: str) -> str:
    """``__main__.__file__``: CPython joins the working directory and a relative path without normalising."""
    return target if os.path.isabs(target) else os.getcwd() + os.sep + target


def _warm_up(layout: tuple[str, str, list[str]], imports: list[str]) -> Any:
    """Import torch (with :data:`TORCH_LAZY`) and the warm imports as the cold worker would find them;
    torch's fresh RNG state."""
    import importlib

    _set_path0(layout[0], layout[1])
    import torch

    state = torch.default_generator.get_state()
    for name in (*TORCH_LAZY, *imports):
        try:
            importlib.import_module(name)
        except ImportError:
            if name not in TORCH_LAZY:
                raise
    if layout[0] == "module" and layout[1] in sys.modules:  # runpy would warn about it; a cold start never does
        raise RuntimeError(f"warm_imports imported the -m module {layout[1]!r} itself")
    return state


def _compute_mode(device: int) -> int | None:
    """The device's CUDA compute mode through the driver API (``cuInit`` makes no context), None if unknown."""
    import ctypes

    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    handle, mode = ctypes.c_int(), ctypes.c_int()
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGet(ctypes.byref(handle), device) != 0:
        return None
    if cuda.cuDeviceGetAttribute(ctypes.byref(mode), _CU_DEVICE_ATTRIBUTE_COMPUTE_MODE, handle) != 0:
        return None
    return mode.value


def _warm_cuda(device: int) -> None:
    """Initialise CUDA and make ``device``'s primary context, leaving the current device where it was."""
    if _compute_mode(device) != _CU_COMPUTEMODE_DEFAULT:
        return
    import torch

    if device >= torch.cuda.device_count():
        return
    torch.cuda.init()
    with torch.cuda.device(device):  # cudaSetDevice makes the primary context; on exit torch's device is back
        torch.cuda.synchronize()


def _point_stdin(path: str) -> None:
    """fd 0 on what a cold worker inherits, and ``sys.stdin`` rebuilt as interpreter start-up builds it
    (a TextIOWrapper keeps, e.g., whether the file was seekable when it was made)."""
    import io

    fd = os.open(path, os.O_RDONLY)
    os.dup2(fd, 0)
    os.close(fd)
    old = sys.stdin
    if old is None:
        return
    buf = io.open(0, "rb", -1, None, None, None, False)
    buf.raw.name = "<stdin>"  # type: ignore[misc]
    buffered = not old.write_through  # start-up sets write_through exactly when stdio is unbuffered (-u)
    stream = io.TextIOWrapper(buf, old.encoding, old.errors, "\n", buffered and buf.raw.isatty(), not buffered)
    stream.mode = "r"  # type: ignore[misc]
    sys.stdin = sys.__stdin__ = stream  # type: ignore[misc]


def _reseed(torch_state: Any) -> None:
    """Fresh seeds where a new interpreter would have them; torch exactly as right after its import (``None``:
    seeded afresh, as an import that seeds at random does)."""
    import random

    random.seed()  # from os.urandom, as at a cold import of random
    numpy = sys.modules.get("numpy")
    if numpy is not None and hasattr(numpy, "random"):
        numpy.random.seed()
    import torch

    if torch_state is None:  # a fork of a zygote whose import seeded torch at random: a seed of its own, as its import
        torch.default_generator.seed()
    else:
        torch.default_generator.set_state(torch_state)


def _become(message: dict, torch_state: Any, layout: tuple[str, str, list[str]]) -> None:
    """Everything a cold ``python -u`` start would have set up differently from this process."""
    _prctl_pdeathsig(0)
    _default_signals(message.get("caught", []))
    _point_stdin(message.get("stdin", os.devnull))
    os.environ.clear()
    os.environ.update(message["env"])
    os.chdir(message["cwd"])
    sys.orig_argv = list(message["argv"])  # type: ignore[misc]
    mode, target, rest = layout
    _set_path0(mode, target)
    sys.argv = ["-m" if mode == "module" else target, *rest]
    _reseed(torch_state)
    _rearm_imports()
    _record_rank()


def _record_rank() -> None:
    """Write :data:`RANK_RECORD` (pid, RANK, LOCAL_RANK) where rlsup's attempt keeps its heartbeats; nothing
    where the worker has no rank or no such directory (a warm rank outside rlsup), or it cannot be written."""
    # "RLSUP_HEARTBEAT_DIR" is rlsup_format.job_env.HEARTBEAT_DIR, spelled here: this file runs without rlsup installed
    directory, rank = os.environ.get("RLSUP_HEARTBEAT_DIR"), os.environ.get("RANK", "")
    if not directory or not rank.isdigit() or not os.path.isdir(directory):
        return
    pid = os.getpid()
    path = os.path.join(directory, RANK_RECORD.format(pid=pid))
    tmp = f"{path}.tmp"
    try:
        with open(tmp, "w") as fh:
            json.dump({"pid": pid, "rank": int(rank), "local_rank": os.environ.get("LOCAL_RANK")}, fh)
        os.replace(tmp, path)  # whole or not at all
    except OSError:
        pass


def _default_signals(caught: list[int]) -> None:
    """The signals the launcher catches start at their default in a worker it executes (SIGINT:
    Python's KeyboardInterrupt handler, as a fresh interpreter installs it)."""
    import signal

    for num in caught:
        try:
            signal.signal(num, signal.default_int_handler if num == signal.SIGINT else signal.SIG_DFL)
        except (ValueError, OSError):
            pass


def _rearm_imports() -> None:
    """A warm import that armed a parent-death signal at import (trainer_hooks does, under rlsup) had it
    cleared with ours: arm it again, under the worker's environment, as its cold import would have."""
    heartbeat = sys.modules.get("trainer_hooks.heartbeat")
    arm = getattr(heartbeat, "_arm_at_import", None)
    if callable(arm):
        arm()


def _fresh_main() -> Any:
    """A ``__main__`` like the one interpreter start-up creates, registered in place of this file's."""
    import builtins
    import types

    main = types.ModuleType("__main__")
    main.__dict__.update({"__annotations__": {}, "__builtins__": builtins})
    sys.modules["__main__"] = main
    return main


def _run(mode: str, target: str) -> None:
    main = _fresh_main()
    if mode == "module":
        import runpy

        runpy._run_module_as_main(target, alter_argv=True)  # type: ignore[attr-defined]
        return
    from importlib.machinery import SourceFileLoader

    filename = _script_file(target)
    main.__dict__.update({"__file__": filename, "__cached__": None,
                          "__loader__": SourceFileLoader("__main__", filename)})
    with open(filename, "rb") as f:
        code = compile(f.read(), filename, "exec", dont_inherit=True)
    exec(code, main.__dict__)


def _run_as_main(mode: str, target: str) -> None:
    """Run the trainer; an uncaught exception is reported as the interpreter would, without our frames."""
    try:
        _run(mode, target)
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as e:  # noqa: BLE001 - the rank's own error, reported to the zygote as a cold start would show it
        tb = e.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
            tb = tb.tb_next
        try:
            sys.excepthook(type(e), e.with_traceback(tb), tb)  # the printer reads e.__traceback__
        finally:
            sys.exit(1)  # whatever the trainer's own hook raised


def _read_message(fd: int = 0) -> bytes:
    chunks = []
    while True:
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def forked(ready_fd: int, message_fd: int, parent: int, command: list[str], imports: list[str],
           env: dict[str, str], cuda_device: int | None, torch_state: Any) -> None:
    """A warm rank forked from the zygote (``warm_pool.WarmRank.forked``), which imported torch and
    :data:`TORCH_LAZY` once for all its ranks under the ranks' start-up environment (the fork saves each
    rank that import: ~2 s of CPU). Made what a spawned warm rank is, then what the worker is: own session,
    parent-death signal, no descriptor of the zygote's, its stdin not the zygote's message pipe, the warm
    environment; on the hand-over also the worker's command line in ``/proc/PID/cmdline``.

    Runs on the zygote's stack: it never returns into the zygote's code. The trainer's end (return,
    ``sys.exit``) leaves as ``SystemExit`` through the zygote's frames, none of which catches it, so the
    interpreter ends as a cold one does (threads joined, atexit, buffers flushed); anything that fails
    before the trainer starts ends the child here."""
    import importlib

    try:
        os.setsid()
        _prctl_pdeathsig(_SIGKILL)  # an unused warm rank dies with the zygote
        if os.getppid() != parent:
            os._exit(1)
        _close_inherited(keep=(0, 1, 2, ready_fd, message_fd))
        null = os.open(os.devnull, os.O_RDONLY)  # not the zygote's message pipe
        os.dup2(null, 0)
        os.close(null)
        os.environ.clear()
        os.environ.update(env)
        layout = _worker_layout(command)
        _set_path0(layout[0], layout[1])
        for name in imports:
            importlib.import_module(name)
        if layout[0] == "module" and layout[1] in sys.modules:  # runpy would warn about it; a cold start never does
            raise RuntimeError(f"the -m module {layout[1]!r} is imported before the worker starts")
        if cuda_device is not None:
            _warm_cuda(cuda_device)
    except BaseException as e:  # noqa: BLE001 - a cold start would have failed or behaved differently: tell the zygote
        os.write(ready_fd, FAILED + f"{type(e).__name__}: {e}".encode("utf-8", "replace")[:2000])
        os._exit(1)
    try:
        os.write(ready_fd, READY)
        os.close(ready_fd)
        data = _read_message(message_fd)
        os.close(message_fd)
        if not data:  # the zygote closed the pipe without a message: never used
            os._exit(0)
        message = json.loads(data)
        layout = _worker_layout(message["argv"])
        _become(message, torch_state, layout)
        _set_cmdline(message["argv"])
    except BaseException:  # noqa: BLE001 - never back into the zygote's code as a second zygote
        os._exit(1)
    del data, message
    _run_as_main(layout[0], layout[1])
    raise SystemExit(0)  # the script ran to its end: exit 0 as a cold interpreter does, never returning


def _close_inherited(keep: tuple[int, ...]) -> None:
    """Close every descriptor but ``keep`` (what ``Popen(close_fds=True)`` gives a spawned rank)."""
    try:
        fds = [int(fd) for fd in os.listdir("/proc/self/fd")]
    except OSError:
        return
    for fd in fds:
        if fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass  # the directory's own descriptor, already gone


def _set_cmdline(argv: list[str]) -> None:
    """``/proc/PID/cmdline`` as the cold worker's (``python -u script args``), written over the zygote's own
    argument strings (the area is the zygote's command line, longer than the worker's: it holds the same
    arguments JSON-quoted); ``ps``, psutil and rlsup's stacks then see the worker, not the zygote. Cut to the
    area where longer; left as it is where /proc does not say where the area is."""
    import ctypes

    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end (proc(5): fields 48 and 49)
    except (OSError, IndexError, ValueError):
        return
    size = end - start
    if size <= 1:
        return
    text = b"\0".join(a.encode("utf-8", "surrogateescape") for a in argv)[:size - 1] + b"\0"
    ctypes.memmove(start, text.ljust(size, b"\0"), size)


def main(argv: list[str]) -> None:
    ready_fd = int(argv[argv.index("--ready-fd") + 1])
    _prctl_pdeathsig(_SIGKILL)  # an unused warm rank dies with the zygote
    if os.getppid() != int(argv[argv.index("--parent") + 1]):
        os._exit(1)  # the zygote died before prctl took effect
    layout = _worker_layout(json.loads(argv[argv.index("--command") + 1]))
    try:
        torch_state = _warm_up(layout, json.loads(argv[argv.index("--imports") + 1]))
        if "--cuda-device" in argv:
            _warm_cuda(int(argv[argv.index("--cuda-device") + 1]))
    except BaseException as e:  # noqa: BLE001 - a cold start would have failed or behaved differently: tell the zygote
        os.write(ready_fd, FAILED + f"{type(e).__name__}: {e}".encode("utf-8", "replace")[:2000])
        os._exit(1)
    import gc

    gc.collect()
    gc.freeze()  # the warmed-up heap (torch, its compiler stack) lives to the end: no GC pass need scan it
    os.write(ready_fd, READY)
    os.close(ready_fd)
    data = _read_message()
    if not data:  # the zygote closed the pipe without a message: never used
        os._exit(0)
    message = json.loads(data)
    layout = _worker_layout(message["argv"])
    _become(message, torch_state, layout)
    del data, message, argv
    _run_as_main(layout[0], layout[1])


if __name__ == "__main__":
    main(sys.argv[1:])
