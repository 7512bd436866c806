"""The shrink benchmark's parts that need no processes: its accounting (benchmarks/shrink_accounting.py) on recorded
events and on the node-hours arithmetic BENCHMARKS.md shows, and the node command the node-loss harness builds for
each trainer (benchmarks/bench_node_loss.py's :class:`Launch`: node loss's command unchanged, the shrink's its own)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.bench_shrink import SIDES, TRAINER, Settings, state_mb_per_node
from benchmarks.shrink_accounting import (Assumptions, LossCost, loss_table, per_allocation, per_loss,
                                          poisson_at_least, step_durations)
from bench_node_loss import TRAINER as RECOVERY_TRAINER  # the module bench_shrink put on the path
from bench_node_loss import Job, Settings as NodeLossSettings, sides as node_loss_sides


def ev(ev: str, t: float, rank: int, pid: int, **kw: object) -> dict:
    return {"ev": ev, "t": t, "rank": rank, "pid": pid, "attempt": 0, **kw}


def test_step_times_before_the_loss_and_of_the_next_attempt() -> None:
    evs = [ev("start", 0.0, r, 100 + r) for r in range(3)]
    evs += [ev("step", 1.0 + i, 0, 100, step=i + 1, dur=0.5) for i in range(4)]  # 4 steps before the loss at 4.5
    evs.append(ev("step", 4.6, 0, 100, step=5, dur=0.9))  # the old attempt's rank 0 finished one more: not counted
    evs += [ev("start", 8.0, r, 200 + r) for r in range(2)]
    evs += [ev("step", 10.0 + i, 0, 200, step=4 + i, dur=0.75) for i in range(3)]
    before, after = step_durations(evs, kill_t=4.5)
    assert before == [0.5] * 4
    assert after == [0.75] * 3


def test_node_hours_per_loss_follow_the_formulas() -> None:
    a = Assumptions(rendezvous_timeout_s=600, restart_s=300, queue_wait_h=1.0, node_back_h=4.0)
    c = per_loss(128, spare_s=4.5, shrink_s=9.0, a=a)
    assert c.spare == pytest.approx(128 * 4.5 / 3600)
    # two restarts of every node (the shrink's and the grow-back's), and one node's share for D = 4 h
    assert c.shrink == pytest.approx(128 * 18.0 / 3600 + 4.0)
    assert c.requeue == pytest.approx(128 * (600 + 300 + 3600) / 3600)
    assert per_loss(128, 4.5, 9.0, a, grow_s=2.0).shrink == pytest.approx(128 * 11.0 / 3600 + 4.0)


def test_the_loss_table_has_a_row_per_n_and_a_column_per_assumption() -> None:
    table = loss_table([16, 1024], spare_s=9.0, shrink_s=18.0, backs_h=[1.0, 24.0], waits_h=[4.0])
    head, rule, *rows = table.splitlines()
    assert head == "| N | spare | shrink, D = 1 h | shrink, D = 24 h | requeue, queue wait 4 h |"
    assert rule.count("---:") == 5
    # 16 nodes: 16 x 9 s = 0.04; 16 x 36 s + 1 h = 1.16; + 24 h = 24.16; 16 x (600 + 300 s + 4 h) = 68
    assert rows == ["| 16 | 0.04 | 1.16 | 24.2 | 68.0 |", "| 1,024 | 2.56 | 11.2 | 34.2 | 4,352 |"]


def test_expected_node_hours_per_allocation() -> None:
    assert poisson_at_least(1.0, 0) == pytest.approx(1.0)
    assert poisson_at_least(1.23, 1) == pytest.approx(0.71, abs=0.01)  # the README's example
    assert poisson_at_least(1.23, 2) == pytest.approx(0.35, abs=0.01)
    cost = LossCost(nodes=128, spare=0.2, shrink=5.0, requeue=160.0)
    r = per_allocation(cost, hours=48.0, mtbf_h=5000.0)
    lam = 128 * 48 / 5000
    assert r.lam == pytest.approx(lam)
    assert (r.requeue, r.shrink) == (pytest.approx(lam * 160.0), pytest.approx(lam * 5.0))
    first = poisson_at_least(lam, 1)  # E[min(X, 1)]: the losses the one spare takes
    assert r.spare_then_requeue == pytest.approx(48.0 + first * 0.2 + (lam - first) * 160.0)
    assert r.spare_then_shrink == pytest.approx(48.0 + first * 0.2 + (lam - first) * 5.0)


def test_the_shrink_trainer_holds_100_mb_per_node() -> None:
    assert state_mb_per_node(Settings().width) == pytest.approx(100.0, abs=0.5)


def test_node_loss_command_is_the_recovery_trainer_s_and_the_shrink_s_its_own(tmp_path: Path) -> None:
    st = NodeLossSettings()
    for name in ("node_loss", "shrink"):
        (tmp_path / name).mkdir()  # a trial's root: the job writes its token there
    node_loss = Job(tmp_path / "node_loss", node_loss_sides(30.0)["spare"], st).cmd(2)
    rlsup, torchrun = node_loss[:node_loss.index("--")], node_loss[node_loss.index("--") + 1:]
    assert "--min-nodes" not in rlsup and rlsup[rlsup.index("--spares") + 1] == "1"
    assert torchrun[torchrun.index("--nproc-per-node") + 1] == "2"
    trainer = torchrun[torchrun.index(str(RECOVERY_TRAINER)):]
    assert trainer[trainer.index("--width") + 1] == str(st.width)
    assert trainer[trainer.index("--checkpoint-every") + 1] == "1"

    shrink = Job(tmp_path / "shrink", SIDES["shrink"], st, Settings().launch()).cmd(2)
    rlsup, torchrun = shrink[:shrink.index("--")], shrink[shrink.index("--") + 1:]
    assert rlsup[rlsup.index("--min-nodes") + 1] == "2" and "--spares" not in rlsup
    assert torchrun[torchrun.index("--nproc-per-node") + 1] == "1"
    assert torchrun[torchrun.index("--nnodes") + 1] == "3"
    assert str(TRAINER) in torchrun and str(RECOVERY_TRAINER) not in torchrun
