"""The suite's fixtures and its two tiers (``*_e2e.py`` modules get the ``e2e`` marker); the helpers tests share live in tests/support/."""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

# One intra-op thread per process, this one and every one a test starts (they inherit it; a test that needs another
# count sets its own): torchrun sets the same for 2+ local ranks, but a single-rank job, a node of one rank, or a
# trainer run alone would start a thread per core, and on the CI's 2 cores shared by 3 workers those threads spin
# against each other (a 1-rank node of the cluster tests: ~10% more CPU for the same steps and the same weights).
os.environ.setdefault("OMP_NUM_THREADS", "1")

from support.env import JOBS, ROOT, TESTS, clean_env
from support.hand_out import hand_out_order
from support.incidents import incidents
from support.netns import enter_own_network_namespace
from support.ports import free_ports
from support.procs import pid_alive, rlsup_cmd, run_rlsup, start_rlsup
from support.waits import wait_for

# Test modules import helpers from tests/support (``from support.procs import run_rlsup``); these names stay
# importable from conftest only for modules written before it existed, until they import from support too.
__all__ = ["JOBS", "ROOT", "clean_env", "free_ports", "incidents", "pid_alive", "rlsup_cmd", "run_rlsup",
           "start_rlsup", "wait_for"]


def pytest_addoption(parser: pytest.Parser) -> None:
    """``--soak MINUTES`` runs the soak tests (the ``soak`` marker: the randomised chaos soak in tests/chaos, the real
    multi-node SLURM jobs in tests/deploy); without it they are skipped. Here, so it works for any path given."""
    parser.addoption("--soak", type=float, default=None, metavar="MINUTES",
                     help="run the soak tests; the chaos soak runs for MINUTES with random seeds (printed for replay)")
    parser.addoption("--soak-seed", type=int, default=None, help="master seed of the chaos soak (default: random)")


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist (the suite's command: ``-n 4``) each worker gets a loopback of its own, so tests that
    use rlsup's fixed default ports, as users do, never meet another worker's run."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        why_not = enter_own_network_namespace()
        if why_not:
            config.issue_config_time_warning(pytest.PytestWarning(
                f"worker {os.environ['PYTEST_XDIST_WORKER']} shares the host's loopback ({why_not}): tests on "
                "fixed default ports may meet another worker's; run without -n, or as root"), stacklevel=2)
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False  # xdist would hand out modules by test count: see LONGEST_FIRST


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    return tmp_path


# ---- the two tiers, by file name ----
# A module named ``test_*_e2e.py`` is the end-to-end tier (marked ``e2e`` here): it starts rlsup, torchrun, trainers,
# servers or other processes. Every other ``test_*.py`` is the fast tier (`pytest -m "not e2e"`): the run loop over
# the fake process layer, policy tables, config, formats, the part protocol, layouts on built trees, all in this
# process. A module's tests sit beside the package they test (tests/cluster for supervisor/cluster, ...), so
# `pytest tests/cluster -m "not e2e"` is the loop for a coordinator edit. A fast test that starts a process fails
# (the ``_fast_tests_start_no_process`` fixture below), so no test can slow the fast tier by sitting in the wrong file.
E2E_SUFFIX = "_e2e.py"
# What starting a process raises as an audit event (sys.addaudithook): subprocess, fork, posix_spawn, exec, system.
PROCESS_EVENTS = frozenset({"subprocess.Popen", "os.posix_spawn", "os.exec", "os.spawn",
                            "os.system", "pty.spawn"})
_fast_test_running: list[str] = []  # the fast test now running (set only while one runs)
_processes_started: list[str] = []  # what the fast test now running tried to start


def _refuse_processes_in_fast_tests(event: str, args: tuple) -> None:
    if _fast_test_running and event in PROCESS_EVENTS:
        what = f"{event} {' '.join(map(str, args[1] if event == 'subprocess.Popen' else args[:1]))[:200]}"
        _processes_started.append(what)
        raise RuntimeError(f"a fast test started a process ({what}); it belongs in a *{E2E_SUFFIX} module")


sys.addaudithook(_refuse_processes_in_fast_tests)

# pytest rewrites each test module's asserts and caches the result as bytecode; under PYTHONDONTWRITEBYTECODE=1 (set
# in many containers, this one included) nothing is cached and every run rewrites every module again: 8 of the
# fast tier's 11 s of collection here. The suite writes its own bytecode (git ignores __pycache__); the processes
# tests start keep the environment they were given.
sys.dont_write_bytecode = False


def is_e2e(path: Path) -> bool:
    return path.name.endswith(E2E_SUFFIX)


@pytest.fixture(autouse=True)
def _fast_tests_start_no_process(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fails a fast test that starts a process (even from a thread, even one that caught the refusal)."""
    if request.node.get_closest_marker("e2e"):
        yield
        return
    _processes_started.clear()
    _fast_test_running[:] = [request.node.nodeid]
    try:
        yield
    finally:
        _fast_test_running.clear()
    if _processes_started:
        pytest.fail(f"this fast test started a process ({_processes_started[0]}): move it to a *{E2E_SUFFIX} "
                    "module, the end-to-end tier", pytrace=False)


def _module(item: pytest.Item) -> str | None:
    """The item's file relative to tests/ (``chaos/test_chaos_ci_e2e.py``), None for a file outside tests/."""
    path = Path(str(item.path))
    return path.relative_to(TESTS).as_posix() if path.is_relative_to(TESTS) else None


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Under exactly ``-m "not e2e"`` the end-to-end modules are not even imported (importing them, ray and
    verl and the trainers' helpers among them, costs the fast tier seconds); any other run collects them as usual."""
    if config.getoption("markexpr", "").strip() != "not e2e" or collection_path.suffix != ".py":
        return None
    return True if is_e2e(collection_path) else None


# The longest modules first (wait-bound ones spread out: tests/support/hand_out.py). Under pytest-xdist (`--dist
# loadfile`: a module stays on one worker; its reordering by test count is turned off in pytest_configure, or the
# many-test fast modules would go first) they are handed out
# first, so no worker starts one of them while the others are already done: the suite's wall time is the sum over
# workers, not the sum plus one long module at the end. The order is generated from the seconds and CPU each module
# took in a CI run (`.ci/run` writes JUnit XML; `python scripts/module_times.py .ci/junit.xml` rewrites
# tests/module_times.json). A stale or missing entry costs speed only: an unknown module runs after the timed ones.
MODULE_TIMES = TESTS / "module_times.json"
# Used only while tests/module_times.json is absent (a checkout from before the file was generated).
LONGEST_FIRST = ("chaos/test_chaos_ci_e2e.py", "thirdparty/test_thirdparty_trainers_e2e.py",
                 "thirdparty/test_recipe_verl_e2e.py", "thirdparty/test_recipe_ray_e2e.py",
                 "cluster/test_multinode_jobs_e2e.py", "cluster/test_multinode_spares_e2e.py",
                 "cluster/test_multinode_memory_e2e.py", "cluster/test_flight_recorder_multinode_e2e.py",
                 "chaos/test_partitions_e2e.py", "diagnosis/test_stragglers_e2e.py", "run/test_hung_fs_e2e.py",
                 "cluster/test_multinode_e2e.py", "trainer_hooks/test_ddp_exact_resume_e2e.py",
                 "cluster/test_multinode_early_death_e2e.py", "cluster/test_spare_first_connect_e2e.py",
                 "tiers/test_memory_tier_e2e.py", "layouts/test_layouts_hf_e2e.py",
                 "cluster/test_multinode_persistent_e2e.py", "trainer_hooks/test_async_save_e2e.py",
                 "deploy/test_deploy_slurm_e2e.py", "run/test_supervisor_run_e2e.py",
                 "cluster/test_multinode_etcd_e2e.py", "diagnosis/test_culprit_e2e.py",
                 "diagnosis/test_flight_recorder_e2e.py", "layouts/test_layouts_deepspeed_e2e.py",
                 "launch/test_warm_ranks_e2e.py", "cli/test_layouts_trainers_cli_e2e.py",
                 "thirdparty/test_thirdparty_pykeen_e2e.py", "launch/test_warm_launcher_e2e.py",
                 "layouts/test_layouts_lightning_e2e.py")


def _longest_first_order() -> dict[str, int]:
    """Each module's place in the hand-out order (support.hand_out: longest first, wait-bound modules spread)."""
    try:
        ranked = hand_out_order(json.loads(MODULE_TIMES.read_text()))
    except (OSError, ValueError, AttributeError):
        ranked = []
    return {m: i for i, m in enumerate(ranked or LONGEST_FIRST)}


def _longest_first(item: pytest.Item, order: dict[str, int]) -> int:
    return order.get(_module(item) or "", len(order))


_CPU_AT_SETUP = pytest.StashKey[float]()
_STARTED_AT = pytest.StashKey[float]()


def _cpu_s() -> float:
    """CPU seconds of this process and of the children it has waited for (a test's subprocesses, and theirs)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    item.stash[_CPU_AT_SETUP] = _cpu_s()
    item.stash[_STARTED_AT] = time.time()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """Each test's CPU, setup to teardown, as the JUnit property ``cpu_s`` (scripts/module_times.py sums it per
    module): the suite is bound by CPU, and a module long in wall time may be light in it (CONTRIBUTING.md, "Suite
    time"). What a test started and never waited for is not counted. Also when it started (Unix time) and on which
    worker: the hand-out order's effect (which modules ran together, where the workers waited) can be read back."""
    if call.when == "teardown" and _CPU_AT_SETUP in item.stash:
        item.user_properties.append(("cpu_s", f"{_cpu_s() - item.stash[_CPU_AT_SETUP]:.2f}"))
        item.user_properties.append(("started", f"{item.stash[_STARTED_AT]:.2f}"))
        item.user_properties.append(("worker", os.environ.get("PYTEST_XDIST_WORKER", "")))
    return (yield)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    soak = config.getoption("--soak", default=None)
    for item in items:
        if is_e2e(Path(str(item.path))):
            item.add_marker(pytest.mark.e2e)
        if "soak" in item.keywords and not soak:
            item.add_marker(pytest.mark.skip(reason="soak: pass --soak MINUTES (e.g. pytest tests/chaos --soak 30)"))
    if os.environ.get("PYTEST_XDIST_WORKER"):  # every worker sorts alike, so all collect the same list
        order = _longest_first_order()
        items.sort(key=lambda item: _longest_first(item, order))  # stable: the rest keep their order


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Every worker, at its end: SIGKILL the children of rlsup's forked calls (supervisor.bounded_calls) that never
    answered. A worker that ran torch's process groups or DTensor in process (test_world_change.py,
    test_layouts_dcp.py, ...) holds them in thread-local caches; a fork from another of its threads then clears those
    in the child, whose gloo destructor waits for threads the child does not have, before the child could set its
    death signal. Left, such a child outlives the worker and holds the suite's output pipe open (CI never ends).
    rlsup's own process never holds a process group."""
    import signal

    from supervisor.bounded_calls import child_pids

    for pid in child_pids():
        try:  # still this worker's child (a pid reaped and reused elsewhere is left alone)
            if int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]) == os.getpid():
                os.kill(pid, signal.SIGKILL)
        except (OSError, ValueError, IndexError):
            pass


@pytest.fixture(autouse=True)
def _no_process_group_left_in_dtensor_s_cache() -> Iterator[None]:
    """After a test that ran DTensor ops in process: empty torch's thread-local sharding cache, whose entries hold
    the test's process groups. Left there, a later fork from another thread of this worker (rlsup's forked bounded
    calls, tested in process) tears that cache down in the child, and the gloo group's destructor waits for threads
    the child does not have: the call's child hangs, the call gives its default after its deadline, and the test
    asserting on its answer fails only when such a module ran earlier on the same worker (seen in CI under
    ``--dist loadfile``; the stack is in pytest_sessionfinish's docstring)."""
    yield
    if "torch.distributed.tensor" in sys.modules:
        clear = getattr(sys.modules["torch"]._C, "_clear_DTensor_sharding_propagator_cache", None)
        if clear is not None:
            clear()
