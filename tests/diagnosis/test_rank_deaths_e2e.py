"""supervisor.diagnosis.rank_deaths with real processes: a rank's death is seen through its pidfd and classified
from the zombie's exit status; a clean exit is not a death; the rank killed by a signal is named before
peers that exited 1 after it."""

from __future__ import annotations


import os
import signal
import subprocess
import sys

from support.waits import wait_for
from supervisor.diagnosis.rank_deaths import RankDeath, RankDeathWatch, zombie_status

PY = sys.executable


def spawn(code: str) -> subprocess.Popen:
    return subprocess.Popen([PY, "-c", code])


def until_zombie(proc: subprocess.Popen) -> int:
    """Not reaped on purpose (the watcher is not the rank's parent in real use): its status while a zombie."""
    wait_for(lambda: zombie_status(proc.pid) is not None, 30, f"pid {proc.pid} to exit")
    status = zombie_status(proc.pid)
    assert status is not None
    return status


def named_among(ranks: list[subprocess.Popen]) -> RankDeath | None:
    """The death the watch names when ranks 0, 1, ... (``ranks``) are all found dead together (every one a
    zombie before the watch looks); each is reaped afterwards."""
    for proc in ranks:
        until_zombie(proc)
    watch = RankDeathWatch()
    watch.track(list(enumerate(proc.pid for proc in ranks)))
    try:
        return watch.wait(1)
    finally:
        for proc in ranks:
            proc.wait()
        watch.close()


def test_signal_death_is_seen_at_once_with_rank_and_signal() -> None:
    proc = spawn("import time; time.sleep(60)")
    watch = RankDeathWatch()
    watch.track([(3, proc.pid)])
    assert watch.wait(0.01) is None  # alive
    os.kill(proc.pid, signal.SIGKILL)
    assert watch.wait(10) == RankDeath(3, proc.pid, None, "SIGKILL")
    proc.wait()
    watch.close()


def test_clean_exit_is_not_a_death_and_an_exit_code_is() -> None:
    ok, bad = spawn("pass"), spawn("import sys; sys.exit(7)")
    until_zombie(ok), until_zombie(bad)
    watch = RankDeathWatch()
    watch.track([(0, ok.pid)])
    assert watch.wait(1) is None
    watch.track([(1, bad.pid)])
    assert watch.wait(1) == RankDeath(1, bad.pid, 7, None)
    ok.wait(), bad.wait()


def test_the_rank_killed_by_a_signal_is_named_before_collateral_exits() -> None:
    collateral = spawn("import sys; sys.exit(1)")
    victim = spawn("import time; time.sleep(60)")
    os.kill(victim.pid, signal.SIGKILL)
    death = named_among([collateral, victim])
    assert death is not None and (death.rank, death.signal) == (1, "SIGKILL")


def test_a_reaped_rank_claims_nothing() -> None:
    proc = spawn("import sys; sys.exit(3)")
    watch = RankDeathWatch()
    watch.track([(0, proc.pid)])
    proc.wait()  # its parent reaped it first: the status is gone, the launcher's report will classify it
    assert watch.wait(1) is None


def test_the_signalled_rank_is_named_before_the_ranks_its_launcher_terminated() -> None:
    """ft_launcher and torchrun SIGTERM the ranks left when one dies: rank 0 ended by that teardown is not
    the cause, rank 1 SIGKILLed is (the lower rank used to win between two signals)."""
    terminated = spawn("import time; time.sleep(60)")
    victim = spawn("import time; time.sleep(60)")
    os.kill(victim.pid, signal.SIGKILL)
    os.kill(terminated.pid, signal.SIGTERM)
    death = named_among([terminated, victim])
    assert death is not None and (death.rank, death.signal) == (1, "SIGKILL")


def test_only_terminated_ranks_beside_a_reaped_one_claim_nothing() -> None:
    """The rank that failed first was reaped by its launcher before rlsup read it; the one left was ended by
    the launcher's SIGTERM: naming it would blame the teardown, so the launcher's report decides."""
    reaped = spawn("import sys; sys.exit(3)")
    terminated = spawn("import time; time.sleep(60)")
    os.kill(terminated.pid, signal.SIGTERM)
    until_zombie(terminated)
    watch = RankDeathWatch()
    watch.track([(0, terminated.pid), (1, reaped.pid)])
    reaped.wait()
    assert watch.wait(1) is None
    terminated.wait()
    watch.close()


def test_a_peer_exit_beside_a_reaped_rank_claims_nothing() -> None:
    """CI saw it: rank 1 SIGKILLed and reaped by ft_launcher before rlsup looked, rank 0 failing its
    collective a moment later (exit 1): rank 0's exit is the consequence, so the launcher's report decides."""
    reaped = spawn("import time; time.sleep(60)")
    peer = spawn("import sys; sys.exit(1)")
    until_zombie(peer)
    watch = RankDeathWatch()
    watch.track([(0, peer.pid), (1, reaped.pid)])
    os.kill(reaped.pid, signal.SIGKILL)
    reaped.wait()
    assert watch.wait(1) is None
    peer.wait()
    watch.close()


def test_a_peer_exit_seen_after_a_reaped_rank_claims_nothing() -> None:
    """CI saw it too (NVRx, rank 1 SIGKILLed): the watch woke for rank 1, already reaped by ft_launcher, while
    rank 0 still ran; rank 0 failed its collective a moment later and its exit 1 was named in the next wait.
    A rank reaped unread stays a possible cause for the rest of the attempt: the launcher's report decides."""
    reaped = spawn("import time; time.sleep(60)")
    peer = subprocess.Popen([PY, "-c", "import sys; sys.stdin.read(); sys.exit(1)"], stdin=subprocess.PIPE)
    watch = RankDeathWatch()
    watch.track([(0, peer.pid), (1, reaped.pid)])
    os.kill(reaped.pid, signal.SIGKILL)
    reaped.wait()
    assert watch.wait(10) is None  # woke for rank 1: its status is gone
    peer.stdin.close()  # rank 0's collective fails: exit 1
    until_zombie(peer)
    assert watch.wait(1) is None
    peer.wait()
    watch.close()


def test_a_rank_terminated_alone_is_still_named() -> None:
    proc = spawn("import time; time.sleep(60)")
    os.kill(proc.pid, signal.SIGTERM)
    assert named_among([proc]) == RankDeath(0, proc.pid, None, "SIGTERM")
