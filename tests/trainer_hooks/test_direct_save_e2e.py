"""The end-to-end half of test_direct_save.py (real processes, or waits on real time): the memory tier's direct
save (trainer_hooks.direct_save): the file built in a spare is byte for byte the file ``torch.save`` writes, a plan
that cannot place every tensor is refused, and a writer SIGKILLed while it builds a step never leaves a step that
verifies but does not load as what was saved."""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import torch

from rlsup_format.manifest import list_step_dirs, verify_step_dir
from support.procs import pid_alive
from support.waits import wait_for
from trainer_hooks.async_writer import AsyncSaveError, AsyncSaver
from trainer_hooks.step_writer import RankIdentity, StepTarget


def steps_that_verify(directory: Path) -> dict[int, Path]:
    return {step: path for step, path in list_step_dirs(directory) if verify_step_dir(path, full=True).valid}


def spares_in(directory: Path) -> list[str]:
    return [n for n in os.listdir(directory) if n.startswith(".staging-") and "_spare-" in n]


def test_writer_killed_while_it_builds_a_direct_step_never_leaves_a_valid_torn_one(tmp_path: Path) -> None:
    """Saves of a 64 MB state into a memory-tier directory, the writer SIGKILLed at random moments (and so at
    times while it fills a spare): every step that verifies loads with weights_only=True as exactly what was
    saved, the step before a kill stays valid, a new writer goes on with direct saves, and a dead writer's
    spare is removed by the next save; after close no spare is left."""
    tier = tmp_path / "tier"
    target = StepTarget(tier, keep_last=2, memory=True)
    who = RankIdentity(0, 1)
    saver = AsyncSaver()
    state = {"w": torch.zeros(8 << 20), "m": torch.zeros(8 << 20)}  # 64 MB
    saved: dict[int, float] = {}
    rng = random.Random(31)
    step, kills, direct = 0, 0, 0
    checked: set[int] = set()
    try:
        while kills < 3:
            step += 1
            state["w"].fill_(float(step))
            state["m"].fill_(-float(step))
            try:
                saver.save(target, step, {"state": state, "step": step}, who, preempted=False)
            except AsyncSaveError:
                saver.save(target, step, {"state": state, "step": step}, who, preempted=False)  # the killed one's
            saved[step] = float(step)
            if step % 3 == 0:
                writer = wait_for(lambda: saver.writer_pid, 30, "the writer process")
                newest = max(steps_that_verify(tier), default=0)
                time.sleep(rng.uniform(0.0, 0.05))
                os.kill(writer, signal.SIGKILL)
                wait_for(lambda: not pid_alive(writer), 10, "the killed writer to go")
                assert max(steps_that_verify(tier), default=0) >= newest  # the valid step before it stays
                kills += 1
            else:
                try:
                    saver.wait()
                except AsyncSaveError:
                    continue
                direct += bool(saver.completed[-1].result.get("direct"))
            for s, path in steps_that_verify(tier).items():
                if s in checked:
                    continue
                checked.add(s)
                loaded = torch.load(path / "rank_00000.pt", weights_only=True)
                assert loaded["step"] == s and torch.equal(loaded["state"]["w"], torch.full((8 << 20,), saved[s]))
                assert torch.equal(loaded["state"]["m"], torch.full((8 << 20,), -saved[s])), s
        try:
            saver.wait()
        except AsyncSaveError:
            pass  # the last kill landed while the writer wrote: reported (it may also have landed after)
        saver.save(target, step + 1, {"state": state, "step": step + 1}, who, preempted=False)
        saver.wait()
        assert direct >= 2, "no save went direct"
        assert len(spares_in(tier)) <= 1, spares_in(tier)  # dead writers' spares were removed
    finally:
        saver.close()
    assert spares_in(tier) == []
    assert step + 1 in steps_that_verify(tier)
