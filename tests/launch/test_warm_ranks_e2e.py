"""Warm ranks: a restart's torchrun workers start from pre-started interpreters with torch imported,
and a trainer cannot tell them from cold ones.

Real processes throughout: rlsup runs 2-rank torchrun jobs (gloo on CPU) whose ranks dump what a
trainer can see of how it was started; attempt 0 fails on purpose, so attempt 1 starts from the warm
launcher and its warm ranks; attempt 0's cold ranks are the reference.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from support.env import clean_env
from support.procs import pid_alive, rlsup_cmd
from support.waits import wait_for

from supervisor.launch.warm_launcher import Zygote, warm_spec
from supervisor.launch.warm_pool import WarmPool, env_difference, skip_rendezvous_skew, startup_env

PY = sys.executable
TORCHRUN = str(Path(PY).parent / "torchrun")
FAST = ["--backoff-initial", "0.05", "--backoff-max", "0.2", "--kill-grace", "2"]
USED = "[rlsup] warm ranks: 2 local rank(s) started from warm ranks"

# Everything a trainer can see of how it was started, dumped per rank and attempt; on attempt 0 rank 1
# fails (after the collective, so both ranks dumped).
DUMPER = r'''
MAIN_KEYS = sorted(globals())
import __main__, json, os, pickle, random, signal, sys, threading
import numpy
import torch
import torch.distributed as dist


class Payload:
    def __init__(self, x):
        self.x = x


def pdeathsig():
    import ctypes
    sig = ctypes.c_int(-1)
    ctypes.CDLL(None, use_errno=True).prctl(2, ctypes.byref(sig), 0, 0, 0)
    return sig.value


def proc_status():
    with open("/proc/self/status") as f:
        return {k: v.strip() for k, v in (line.split(":", 1) for line in f) if k in ("SigBlk", "SigIgn", "SigCgt")}


seed = torch.initial_seed()
fresh = torch.Generator()
fresh.manual_seed(seed)
draws = {"random": [random.random() for _ in range(3)], "numpy": numpy.random.random_sample(3).tolist(),
         "torch": torch.rand(3).tolist()}
spec = __main__.__spec__
info = {
    "argv": sys.argv, "orig_argv": sys.orig_argv, "path": sys.path, "flags": list(sys.flags),
    "executable": sys.executable, "main_keys": MAIN_KEYS, "main_is_module": sys.modules["__main__"].__dict__ is globals(),
    "main": {"__file__": __main__.__dict__.get("__file__"), "__name__": __name__, "__package__": __package__,
             "__spec__": None if spec is None else [spec.name, spec.origin, spec.parent],
             "__loader__": type(__loader__).__name__, "loader_path": getattr(__loader__, "path", None),
             "__cached__": __main__.__dict__.get("__cached__"), "__doc__": __doc__,
             "__builtins__": type(__main__.__dict__["__builtins__"]).__name__},
    "env": dict(os.environ), "cwd": os.getcwd(), "stdin": os.readlink("/proc/self/fd/0"),
    "stdout": os.readlink("/proc/self/fd/1").split(":")[0], "stderr": os.readlink("/proc/self/fd/2").split(":")[0],
    "stdin_obj": [sys.stdin.name, sys.stdin.mode, sys.stdin.encoding, sys.stdin.errors, sys.stdin.seekable(),
                  sys.stdin.line_buffering, sys.stdin.write_through, sys.stdin.isatty()],
    "signals": {s.name: str(signal.getsignal(s)) for s in signal.valid_signals() if isinstance(s, signal.Signals)},
    "sigmask": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])), "proc_status": proc_status(),
    "pdeathsig": pdeathsig(), "session_leader": os.getsid(0) == os.getpid(), "threads": threading.active_count(),
    "affinity": sorted(os.sched_getaffinity(0)),
    "pickle": pickle.loads(pickle.dumps(Payload(7))).x,
    "torch_fresh": draws["torch"] == torch.rand(3, generator=fresh).tolist(),
    "uuid_shadowed": getattr(sys.modules.get("uuid"), "SHADOWED", False), "str_hash": hash("rlsup"),
    "pid": os.getpid(), "cmdline": open("/proc/self/cmdline").read().split("\0")[:3],
    "seed": seed, "draws": draws,
}
dist.init_process_group("gloo")
rank, attempt = dist.get_rank(), int(os.environ["RLSUP_RESTART_COUNT"])
t = torch.ones(1)
dist.all_reduce(t)
with open(f"{sys.argv[1]}.rank{rank}.attempt{attempt}.json", "w") as f:
    json.dump(info, f)
dist.destroy_process_group()
if attempt == 0 and rank == 1:
    sys.exit(3)
'''

# A warm import that records the draws a trainer would get if the warm rank were not reseeded, and uses
# the torch generator (the hand-off must put it back).
WARMPROBE = r'''
import json, os, random
import numpy, torch
r = random.Random()
r.setstate(random.getstate())
n = numpy.random.RandomState()
n.set_state(numpy.random.get_state())
torch.rand(5)
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), f"pre.{os.getpid()}.json"), "w") as f:
    json.dump({"random": [r.random() for _ in range(3)], "numpy": n.random_sample(3).tolist()}, f)
'''

# Values that differ between any two runs (or attempts), warm or cold.
RUN_SPECIFIC_ENV = {"MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE"}
PER_ATTEMPT_ENV = {"RLSUP_RESTART_COUNT", "RLSUP_HEARTBEAT_DIR", "RLSUP_RESUME_DIR", "RLSUP_RESUME_STEP"}


def _comparable(info: dict, drop_env: set[str], cmdline: bool = True) -> dict:
    """What a warm rank must share with a cold one; ``cmdline``: a forked rank writes the worker's command line
    over its zygote's (a spawned one keeps warm_rank.py's)."""
    drop = ("pid", "seed", "draws", "str_hash") if cmdline else ("pid", "cmdline", "seed", "draws", "str_hash")
    out = {k: v for k, v in info.items() if k not in drop}
    out["env"] = {k: v for k, v in info["env"].items() if k not in drop_env}
    return out


def _dumps(workdir: Path, out: str = "info") -> dict[str, dict]:
    return {p.name.split(".", 1)[1]: json.loads(p.read_text()) for p in workdir.glob(f"{out}.rank*.json")}


def _used_line(log: str) -> str:
    """rlsup's line naming the warm ranks the attempt's workers started from, and how they were started."""
    assert USED in log, log
    return log.split(USED)[1].splitlines()[0]


def _warm_started(info: dict, log: str) -> bool:
    """Whether the dumping rank is one that line names (a forked rank's command line is the worker's own)."""
    return USED in log and info["pid"] in {int(p) for p in re.findall(r"\d+", _used_line(log).split(";")[0])}


def _run_job(workdir: Path, launch: list[str], *extra: str) -> tuple[dict[str, dict], str, str]:
    """One rlsup run of the dumper (attempt 0 fails); the dumps, rlsup's stderr, attempt 1's output. Run in a
    user's environment, without the ``OMP_NUM_THREADS`` the suite sets (tests/conftest.py): torchrun adds it to the
    cold ranks of a 2-rank job, so the warm launcher must add the same to its warm ones."""
    env = {k: v for k, v in clean_env().items() if k != "OMP_NUM_THREADS"}
    # attempt 0 cold (--warm-first-attempt false): the reference every warm rank is compared with
    r = subprocess.run(rlsup_cmd("run", *FAST, "--max-restarts", "1", "--warm-first-attempt", "false", *extra, "--",
                                 *launch), cwd=workdir, env=env,
                       capture_output=True, text=True, timeout=280)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    log1 = (workdir / ".rlsup" / "attempts" / "attempt_0001" / "output.log").read_text()
    return _dumps(workdir), r.stderr, log1


def _cold_attempt_1_env(cold0: dict[str, str]) -> dict[str, str | None]:
    """The per-attempt variables a cold attempt 1 gets, from a cold attempt 0's (no checkpoint in between)."""
    env = {k: cold0.get(k) for k in PER_ATTEMPT_ENV}
    env["RLSUP_RESTART_COUNT"] = "1"
    env["RLSUP_HEARTBEAT_DIR"] = cold0["RLSUP_HEARTBEAT_DIR"].replace("attempt_0000", "attempt_0001")
    return env


@pytest.mark.parametrize("fork", [True, False], ids=["forked", "spawned"])
def test_warm_ranks_are_indistinguishable_from_cold_ones(workdir: Path, fork: bool) -> None:
    """Attempt 1's warm ranks against attempt 0's cold ones of the same run: equal in all a trainer can see
    but the per-attempt variables, which are what a cold attempt 1 gets; forked from the launcher (the
    default) or, with ``--warm-fork false``, spawned (then their command line is warm_rank.py's)."""
    (workdir / "dumper.py").write_text(DUMPER)
    (workdir / "warmprobe.py").write_text(WARMPROBE)
    launch = [TORCHRUN, "--standalone", "--nproc-per-node", "2", "dumper.py", "info"]
    dumps, stderr, warm_log1 = _run_job(workdir, launch, "--warm-imports", "warmprobe",
                                        *(() if fork else ("--warm-fork", "false")))
    assert "attempt 1: started by the warm launcher" in stderr, stderr
    assert USED in warm_log1 and "launching cold" not in warm_log1, warm_log1
    how = "forked from the launcher" if fork else "spawned: warm_fork is off"
    assert _used_line(warm_log1).endswith(f"; {how})"), warm_log1
    drop = RUN_SPECIFIC_ENV | PER_ATTEMPT_ENV
    for rank in (0, 1):
        w, c = dumps[f"rank{rank}.attempt1.json"], dumps[f"rank{rank}.attempt0.json"]
        assert _warm_started(w, warm_log1) and not _warm_started(c, warm_log1), (w["pid"], c["pid"], warm_log1)
        assert _comparable(w, drop, cmdline=fork) == _comparable(c, drop, cmdline=fork)
        assert fork or w["cmdline"][2].endswith("supervisor/launch/warm_rank.py")
        assert {k: w["env"].get(k) for k in PER_ATTEMPT_ENV} == _cold_attempt_1_env(c["env"])
        assert w["torch_fresh"] and w["pdeathsig"] == 0 and w["stdin"] == "/dev/null"
        pre = json.loads((workdir / f"pre.{w['pid']}.json").read_text())  # what the warm rank held before
        assert w["draws"]["random"] != pre["random"] and w["draws"]["numpy"] != pre["numpy"]
    w0, w1 = dumps["rank0.attempt1.json"], dumps["rank1.attempt1.json"]
    c0, c1 = dumps["rank0.attempt0.json"], dumps["rank1.attempt0.json"]
    assert w0["draws"]["random"] != w1["draws"]["random"] and w0["draws"]["numpy"] != w1["draws"]["numpy"]
    assert (w0["seed"] == w1["seed"]) == (c0["seed"] == c1["seed"])  # torch: as independent as cold ones
    assert c0["str_hash"] != c1["str_hash"]  # each cold interpreter draws its hash seed (no PYTHONHASHSEED here)
    assert (w0["str_hash"] == w1["str_hash"]) == fork  # forked ranks share their launcher's, spawned ones draw theirs


def test_module_entrypoint_starts_warm(workdir: Path) -> None:
    """``torchrun -m module``: runpy semantics; attempt 1 (warm) sees what attempt 0 (cold) saw."""
    (workdir / "dumpmod.py").write_text(DUMPER)
    dumps, stderr, log1 = _run_job(workdir, [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                                             "2", "-m", "dumpmod", "info"])
    assert USED in log1 and "launching cold" not in log1, log1
    assert _used_line(log1).endswith("; forked from the launcher)"), log1
    for rank in (0, 1):
        cold, warm = dumps[f"rank{rank}.attempt0.json"], dumps[f"rank{rank}.attempt1.json"]
        assert _warm_started(warm, log1) and not _warm_started(cold, log1)
        drop = RUN_SPECIFIC_ENV | PER_ATTEMPT_ENV
        assert _comparable(warm, drop) == _comparable(cold, drop)
        assert warm["main"]["__spec__"][0] == "dumpmod" and warm["argv"][0] == str(workdir / "dumpmod.py")


def test_unusual_options_launch_cold_and_say_so_once(workdir: Path) -> None:
    (workdir / "dumper.py").write_text(DUMPER)
    dumps, stderr, log1 = _run_job(workdir, [TORCHRUN, "--standalone", "--nproc-per-node", "2", "--redirects", "3",
                                             "--log-dir", str(workdir / "logs"), "dumper.py", "info"])
    assert "attempt 1: started by the warm launcher" in stderr, stderr
    said = [line.split(" ", 3)[3] for line in log1.splitlines() if " [rlsup] warm ranks:" in line]  # after the stamp
    assert said == ["[rlsup] warm ranks: worker output redirected (--redirects/--tee); launching cold"], log1
    assert USED not in log1, log1  # no rank of attempt 1 started warm


# A module beside the script with the name of one torch imports (the standard ``uuid``), as a cold worker finds it
# first on its sys.path; it is the standard one, marked.
SHADOW = r'''
import importlib.util, os, sysconfig
_spec = importlib.util.spec_from_file_location("uuid", os.path.join(sysconfig.get_paths()["stdlib"], "uuid.py"))
_real = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_real)
globals().update({k: v for k, v in vars(_real).items() if not k.startswith("__")})
SHADOWED = True
'''


def test_a_module_beside_the_script_that_the_launcher_imported_gets_spawned_ranks(workdir: Path) -> None:
    """``uuid.py`` beside the script: a cold worker imports it with torch, the zygote imported the standard one. So
    the ranks are spawned (each imports torch after taking the script's sys.path[0]), not forked, say why, and see
    what a cold rank sees: the module beside the script."""
    (workdir / "dumper.py").write_text(DUMPER)
    (workdir / "uuid.py").write_text(SHADOW)
    dumps, stderr, log1 = _run_job(workdir, [TORCHRUN, "--standalone", "--nproc-per-node", "2", "dumper.py", "info"])
    assert "attempt 1: started by the warm launcher" in stderr, stderr
    assert "spawned: the worker's directory" in _used_line(log1) and "(uuid)" in _used_line(log1), log1
    drop = RUN_SPECIFIC_ENV | PER_ATTEMPT_ENV
    for rank in (0, 1):
        cold, warm = dumps[f"rank{rank}.attempt0.json"], dumps[f"rank{rank}.attempt1.json"]
        assert _warm_started(warm, log1) and warm["cmdline"][2].endswith("supervisor/launch/warm_rank.py")
        assert cold["uuid_shadowed"] and warm["uuid_shadowed"]
        assert _comparable(warm, drop, cmdline=False) == _comparable(cold, drop, cmdline=False)


def test_fit_checks() -> None:
    """What makes a worker launch cold although warm ranks exist (no process needed)."""
    spawned = {"OMP_NUM_THREADS": "1", "PATH": "/bin", "RLSUP_RESTART_COUNT": "0", "LD_PRELOAD": ""}
    worker = dict(spawned, RLSUP_RESTART_COUNT="1", RANK="1", TORCHELASTIC_RUN_ID="x",
                  TORCH_NCCL_ASYNC_ERROR_HANDLING="1")
    assert env_difference(spawned, worker) == []
    assert env_difference(spawned, dict(worker, OMP_NUM_THREADS="4")) == ["OMP_NUM_THREADS"]
    assert env_difference(spawned, dict(worker, PYTHONHASHSEED="0", MALLOC_ARENA_MAX="2")) == [
        "MALLOC_ARENA_MAX", "PYTHONHASHSEED"]
    assert "PATH" not in startup_env(worker) and "LD_PRELOAD" in startup_env(worker)
    pool = WarmPool("", [PY, "-u", "train.py"], spawned, 2)
    pool.ranks = [object()]  # type: ignore[list-item]  # one "warm rank", never reached
    unfit = pool._unfit  # the checks take() makes before it touches a warm rank
    assert "start-up environment differs (OMP_NUM_THREADS)" in unfit([PY, "-u", "train.py"],
                                                                      dict(worker, OMP_NUM_THREADS="4"), False)
    assert "is not the warmed" in unfit([PY, "-u", "other.py"], worker, False)
    assert "is not the warmed" in unfit([PY, "train.py"], worker, False)  # no -u
    assert "is not the warmed" in unfit([PY, "-u", "-m", "train"], worker, False)
    assert "files" in unfit([PY, "-u", "train.py"], worker, True)


def test_fork_checks(tmp_path: Path) -> None:
    """When a zygote's warm ranks are forked from it, and why not (no process needed)."""
    import uuid

    from supervisor.launch.warm_pool import ForkStart, fork_unfit

    bin_dir, job = tmp_path / "bin", tmp_path / "job"
    bin_dir.mkdir()
    job.mkdir()
    (job / "train.py").write_text("")
    env = {"OMP_NUM_THREADS": "1", "PATH": "/bin"}
    start = ForkStart(dict(env), str(bin_dir), None)
    modules = {"uuid": uuid, "torch": uuid}  # what the zygote imported (any module objects)
    script = [PY, "-u", str(job / "train.py")]
    assert fork_unfit(script, env, start, modules) == ""
    assert fork_unfit(script, dict(env, PATH="/usr/bin"), start, modules) == ""  # not read at start-up
    assert "not the launcher's interpreter" in fork_unfit(["/bin/sh", *script[1:]], env, start, modules)  # PYTHON_EXEC
    assert "another start-up environment (OMP_NUM_THREADS)" in fork_unfit(script, {"PATH": "/bin"}, start, modules)
    (job / "uuid.py").write_text("")
    assert "has modules the launcher imported from elsewhere (uuid)" in fork_unfit(script, env, start, modules)
    assert fork_unfit(script, env, ForkStart(dict(env), None, None), modules) == ""  # -P: no directory first
    assert fork_unfit(script, env, ForkStart(dict(env), str(job), None), modules) == ""  # the same first directory
    (job / "uuid.py").unlink()
    own = type(uuid)("mine")
    own.__file__ = str(bin_dir / "mine.py")
    assert "from its own directory" in fork_unfit(script, env, start, dict(modules, mine=own))
    cwd = os.getcwd()
    os.chdir(job)
    try:  # -m: the worker's first directory is the working directory
        (job / "torch").mkdir()
        assert "(torch)" in fork_unfit([PY, "-u", "-m", "train"], env, start, modules)
    finally:
        os.chdir(cwd)


def test_nproc_hint_reads_torchruns_options_without_torch() -> None:
    """The zygote imports torch under OMP_NUM_THREADS=1 exactly where torchrun will give it to the workers."""
    from supervisor.launch.warm_launcher import nproc_hint

    assert nproc_hint(["--standalone", "--nproc-per-node", "2", "t.py", "--nproc-per-node", "8"]) == 2
    assert nproc_hint(["--nproc_per_node=4", "t.py"]) == 4
    assert nproc_hint(["--nnodes", "1", "-m", "t", "--nproc-per-node", "8"]) == 1  # the trainer's own option
    assert nproc_hint(["--nproc-per-node", "auto", "t.py"]) is None
    assert nproc_hint(["t.py"]) == 1


@pytest.mark.parametrize("nodes, skewed", [(["--standalone"], False), (["--nnodes", "1"], False),
                                            (["--nnodes", "2"], True), (["--nnodes", "1:2"], True)])
def test_a_single_node_skips_the_rendezvous_skew(nodes: list[str], skewed: bool) -> None:
    """The warm zygote drops torch's random 0-0.3 s sleep before round 0 on a single node only; the 1 s
    poll of a waiting join is kept (torch's own delay is swapped for a recorder to see what reaches it)."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous
    from torch.distributed.run import parse_args

    original, asked = dynamic_rendezvous._delay, []
    dynamic_rendezvous._delay = asked.append
    try:
        skip_rendezvous_skew(parse_args([*nodes, "--nproc-per-node", "2", "train.py"]))
        dynamic_rendezvous._delay((0, 0.3))
        dynamic_rendezvous._delay(1)
    finally:
        dynamic_rendezvous._delay = original
    assert asked == ([(0, 0.3), 1] if skewed else [1])


def _ready_warm_ranks(zygote: Zygote, n: int) -> list[int]:
    assert zygote.wait_ready(120)
    assert len(zygote.warm_pids) == n
    launch = Path(__file__).resolve().parents[2] / "supervisor" / "launch"
    started = ([str(launch / "warm_rank.py")], [str(launch / "warm_launcher.py")])  # spawned; forked (the zygote's)
    for pid in zygote.warm_pids:
        # The zygote says ready once its own imports are done; a spawned warm rank may still be inside its execve
        # (an empty cmdline under load), so its cmdline is waited for.
        wait_for(lambda: psutil.Process(pid).cmdline()[2:3] in started, 60, f"warm rank {pid} to run")
    return list(zygote.warm_pids)


@pytest.mark.parametrize("how", ["sigkill", "discard"])
def test_unused_warm_ranks_die_with_the_zygote(workdir: Path, how: str) -> None:
    env = clean_env()
    spec = warm_spec([TORCHRUN, "--standalone", "--nproc-per-node", "2", str(workdir / "t.py")], env, str(workdir))
    (workdir / "t.py").write_text("print('never run')\n")
    assert spec is not None
    zygote = Zygote(spec, env, cwd=str(workdir))
    try:
        pids = _ready_warm_ranks(zygote, 2)
        if how == "sigkill":
            os.kill(zygote.pid, signal.SIGKILL)
        else:
            zygote.discard()
        for pid in pids:
            wait_for(lambda: not pid_alive(pid), 20, f"warm rank {pid} to die with its zygote")
    finally:
        zygote.discard()


def test_warm_ranks_torchrun_does_not_use_are_killed(workdir: Path) -> None:
    """Warmed for 2 workers, started with 1: the spare dies as soon as torchrun started its workers."""
    script = workdir / "wait.py"
    script.write_text("import os, sys, time\nfrom pathlib import Path\nPath(sys.argv[1]).write_text(str(os.getpid()))\n"
                      "while not Path(sys.argv[2]).exists():\n    time.sleep(0.05)\n")
    started, done = workdir / "started", workdir / "done"
    env = clean_env(OMP_NUM_THREADS="1")  # as torchrun sets it for the 2 workers warmed
    spec = warm_spec([TORCHRUN, "--standalone", "--nproc-per-node", "2", str(script), str(started), str(done)],
                     env, str(workdir))
    assert spec is not None
    zygote = Zygote(spec, env, cwd=str(workdir))
    job = None
    try:
        pids = _ready_warm_ranks(zygote, 2)
        job = zygote.start(["--standalone", "--nproc-per-node", "1", str(script), str(started), str(done)], env,
                           str(workdir), workdir / "out.log", 40, ready_timeout=120)
        assert job is not None
        worker = int(wait_for(lambda: started.exists() and started.read_text(), 120, "the worker to start"))
        assert worker == pids[0]  # the first warm rank became local rank 0
        wait_for(lambda: not pid_alive(pids[1]), 20, "the spare warm rank to be killed")
        done.touch()
        assert job.wait_exit(120) == 0
        job.output.join(5)
        assert "[rlsup] warm ranks: 1 local rank(s) started from warm ranks" in (workdir / "out.log").read_text()
    finally:
        done.touch()
        if job is None:
            zygote.discard()
