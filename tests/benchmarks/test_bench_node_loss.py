"""The node-loss harness's accounting (benchmarks/node_loss_accounting.py) on recorded event lists: the loss ->
first step is the next attempt's (a process started after the SIGKILL), each node's ranks started is the last of
them, steps redone are those reached at the SIGKILL and not restored, and goodput counts each step once."""

from __future__ import annotations

import pytest

from benchmarks.node_loss_accounting import after_kill, loss_figures, useful_time


def ev(ev: str, t: float, rank: int, pid: int, **kw: object) -> dict:
    return {"ev": ev, "t": t, "rank": rank, "pid": pid, "attempt": 0, **kw}


def attempt(t: float, resumed: int, steps: range, pid0: int, ranks: int = 4, started: dict[int, float] | None = None
            ) -> list[dict]:
    """One attempt of ``ranks`` ranks (pids pid0 + rank): every rank starts at t (or ``started[rank]``), rank 0
    meets at t + 1, restores at t + 2 and steps once a second from t + 3."""
    out = [ev("start", (started or {}).get(r, t), r, pid0 + r) for r in range(ranks)]
    out += [ev("rendezvous", t + 1, 0, pid0), ev("resumed", t + 2, 0, pid0, step=resumed)]
    out += [ev("step", t + 3 + i, 0, pid0, step=s, dur=0.5) for i, s in enumerate(steps)]
    return out


def test_loss_figures_of_a_loss_and_a_resume() -> None:
    # attempt 0: steps 1..10 at t=3..12; node 1 (ranks 2, 3) lost at 12.5 with step 7 the newest replicated;
    # attempt 1: node 0's ranks start at 16, node 1's replacement ranks at 18 and 19.5; resumes from 7 at 20.
    evs = attempt(0.0, 0, range(1, 11), 100) + attempt(18.0, 7, range(8, 20), 200, started={0: 16, 1: 16, 3: 19.5})
    evs.append(ev("step", 12.6, 0, 100, step=11, dur=0.5))  # a step the survivors finished after the SIGKILL
    f = loss_figures(evs, kill_t=12.5, nodes=2, ranks_per_node=2, pre_s=10.0, post_s=20.0)
    assert f.first_step == pytest.approx(21.0 - 12.5)
    assert f.nodes_started == (pytest.approx(3.5), pytest.approx(7.0))
    assert f.last_node_started == pytest.approx(7.0)
    assert (f.rendezvous, f.restored) == (pytest.approx(6.5), pytest.approx(7.5))
    assert (f.reached, f.resumed, f.redone) == (10, 7, 3)
    # window [2.5, 32.5]: steps 1..7 of attempt 0 (t 3..9) and 8..19 of attempt 1 (t 21..32): 19 x 0.5 s
    assert f.goodput == pytest.approx(19 * 0.5 / 30.0)
    assert f.steady_goodput == pytest.approx(10 * 0.5 / 10.0)  # steps 1..10 ended in [2.5, 12.5]


def test_a_next_attempt_that_never_stepped_leaves_its_figures_unknown() -> None:
    evs = attempt(0.0, 0, range(1, 6), 100) + [ev("start", 9.0, r, 300 + r) for r in (0, 1)]
    f = loss_figures(evs, kill_t=8.5, nodes=2, ranks_per_node=2, pre_s=5.0, post_s=5.0)
    assert (f.first_step, f.rendezvous, f.restored, f.resumed, f.redone) == (None, None, None, None, None)
    assert f.nodes_started == (pytest.approx(0.5), None) and f.last_node_started is None
    assert f.reached == 5


def test_a_redone_step_counts_once_and_only_the_final_lineage() -> None:
    evs = attempt(0.0, 0, range(1, 6), 100) + attempt(10.0, 2, range(3, 5), 200)
    # the final lineage at t=14: steps 1, 2 (attempt 0) and 3, 4 (attempt 1); attempt 0's 3..5 were lost
    assert useful_time(evs, 0.0, 14.0) == pytest.approx(4 * 0.5)
    assert useful_time(evs, 3.5, 14.0) == pytest.approx(3 * 0.5)  # step 1 ended at 3.0, before the window
    assert sorted(e["pid"] for e in after_kill(evs, 9.0)) == sorted([200 + r for r in range(4)] + [200] * 4)
