"""A spare's guard and launcher (supervisor/cluster/spare_run.py, issue 31), with real processes.

- The spare guards its attempts before it arms the launcher, then hands the same ``OsProcesses`` to its node run:
  the node run's ``guard_attempts`` keeps that guard (the launcher, already a recorded root, stays alive), and its
  ``release_attempts`` ends what is left, as on any node (review finding: with a layer of its own the node run
  only shared the spare's tree, and an error in its loop left the job running).
- A launcher armed for one command is never started for another it cannot take (a spare armed with the command
  as typed must not run it in place of the pinned one): it is discarded and the attempt launches cold.
"""

from __future__ import annotations

from pathlib import Path

from support.env import PY, clean_env
from support.procs import pid_alive
from support.waits import wait_for

from supervisor.processes.job import OsProcesses, spawn_job_root
from supervisor.processes.tree_record import load, record_path
from supervisor.launch.warm_start import WarmStarts


def test_the_node_run_keeps_the_spares_guard_and_its_release_ends_what_is_left(tmp_path: Path) -> None:
    layer = OsProcesses(cgroups=False, guardian=False)
    layer.guard_attempts(tmp_path)  # the spare, before it arms
    launcher = spawn_job_root(["sleep", "300"], clean_env())  # stands for the launcher: a recorded root
    try:
        layer.guard_attempts(tmp_path)  # the node run's first attempt, on the layer it was handed
        assert launcher.poll() is None, "the node run's guard ended the spare's launcher"
        record = load(record_path(tmp_path))
        assert record is not None and launcher.pid in [r.pid for r in record.roots], record
        ended = layer.release_attempts()  # the node run ends (an error in its loop included)
        launcher.wait(timeout=10)  # ended (raises TimeoutExpired if it is still running)
        assert ended, "release_attempts ended nothing"
        assert not record_path(tmp_path).exists()
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()


def test_a_launcher_is_not_started_for_a_command_it_cannot_take(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("print('cold')\n")
    said: list[str] = []
    command = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", str(script)]
    warm = WarmStarts(command, enabled=True, warm_imports=(), log=said.append)
    env = clean_env()
    try:
        warm.arm(env, budget_left=True)
        spawned = [int(line.split()[3]) for line in said if "spawned" in line]
        assert spawned, said
        job = warm.start(0, env, [PY, str(script)], tmp_path / "output.log", 20)  # not a torchrun: cannot take it
        assert job is None, "the launcher ran the command it was armed for in place of another"
        assert any("launching cold" in line for line in said), said
        wait_for(lambda: not pid_alive(spawned[0]), 30, "the unusable launcher to be gone")
    finally:
        warm.discard()
