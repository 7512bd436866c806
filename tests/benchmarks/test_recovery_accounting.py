"""The realistic recovery harness's accounting (benchmarks/recovery_accounting.py) on recorded event lists:
useful steps are the final lineage's, redone steps are charged to the failure that lost them, and where a
failure's time went is read off the next training attempt's events."""

from __future__ import annotations

import pytest

from benchmarks.recovery_accounting import Kill, account, kill_schedule, young_cadence


def ev(ev: str, t: float, attempt: int, rank: int = 0, **kw: object) -> dict:
    return {"ev": ev, "t": t, "attempt": attempt, "rank": rank, "pid": 100 + attempt, **kw}


def attempt_events(attempt: int, t: float, resumed: int, steps: range, step_s: float = 1.0) -> list[dict]:
    """One attempt: start at t, rendezvous +0.5, resumed +1, then a step every step_s."""
    out = [ev("start", t, attempt), ev("rendezvous", t + 0.5, attempt), ev("resumed", t + 1.0, attempt, step=resumed)]
    out += [ev("step", t + 1.0 + step_s * (i + 1), attempt, step=s, dur=step_s) for i, s in enumerate(steps)]
    return out


def test_redone_steps_are_counted_once_and_charged_to_the_failure() -> None:
    # attempt 0: steps 1..5 at t=2..6, killed at 6.5 (saved step 3); attempt 1 starts at 8, resumes
    # from 3 at 9, trains 4..10 at t=10..16.
    evs = attempt_events(0, 0.0, 0, range(1, 6)) + attempt_events(1, 8.0, 3, range(4, 11))
    evs.append(ev("step", 3.0, 0, rank=1, step=2, dur=1.0))  # another rank's events never count
    trial = account(evs, [Kill(6.5, 1, 0)], t0=0.0, t_end=20.0, ref_step_s=0.5)
    assert trial.useful_steps == 10
    assert trial.trained_steps == 12
    assert trial.goodput == pytest.approx(10 * 0.5 / 20.0)
    (r,) = trial.recoveries
    assert r.redone == 2 and trial.redone_per_failure == 2
    assert r.to_start == pytest.approx(1.5)
    assert r.rendezvous == pytest.approx(0.5)
    assert r.restore == pytest.approx(0.5)
    assert r.first_step == pytest.approx(1.0)
    assert r.regained == pytest.approx(12.0 - 6.5)  # step 6 (past 5) at t=12
    assert r.failed_restarts == 0


def test_a_restart_that_never_trained_is_a_failed_restart_and_the_window_cuts_the_count() -> None:
    evs = attempt_events(0, 0.0, 0, range(1, 6))
    evs += [ev("start", 8.0, 1)]  # attempt 1 never gets past its start (e.g. connectFullMesh refused)
    evs += attempt_events(2, 20.0, 5, range(6, 30))
    trial = account(evs, [Kill(6.5, 0, 0)], t0=0.0, t_end=30.0, ref_step_s=1.0)
    (r,) = trial.recoveries
    assert r.failed_restarts == 1
    assert r.redone == 0
    assert r.to_start == pytest.approx(13.5)
    assert trial.useful_steps == 14  # steps up to t=30: attempt 2's steps at 22..30 are steps 6..14


def test_a_failure_not_recovered_inside_the_window_has_no_figures() -> None:
    evs = attempt_events(0, 0.0, 0, range(1, 6)) + [ev("start", 8.0, 1)]  # still starting at the end
    trial = account(evs, [Kill(6.5, 1, 0)], t0=0.0, t_end=10.0, ref_step_s=1.0)
    (r,) = trial.recoveries
    assert r.regained is None and r.redone is None and r.failed_restarts == 0
    assert trial.redone_per_failure is None
    assert trial.useful_steps == 5


def test_young_cadence_and_a_seeded_schedule() -> None:
    assert young_cadence(0.4, 30.0, 0.5) == 10  # sqrt(2 * 0.4 * 30) = 4.9 s = 9.8 steps
    assert young_cadence(0.0, 30.0, 0.5) == 1
    a = kill_schedule(7, 300.0, 20.0, 40.0, 2)
    assert a == kill_schedule(7, 300.0, 20.0, 40.0, 2)
    gaps = [y[0] - x[0] for x, y in zip([(0.0, 0)] + a, a)]
    assert all(20.0 <= g <= 40.0 for g in gaps) and a[-1][0] < 300.0 and 300.0 - a[-1][0] <= 40.0
    assert {r for _, r in a} <= {0, 1}


def test_a_kill_of_an_attempt_that_never_trained_belongs_to_the_failure_before() -> None:
    evs = attempt_events(0, 0.0, 0, range(1, 6))
    evs += [ev("start", 8.0, 1), ev("rendezvous", 8.5, 1)]  # stuck, then killed by the harness at 12
    evs += attempt_events(2, 15.0, 5, range(6, 10))
    trial = account(evs, [Kill(6.5, 0, 0), Kill(12.0, 1, 1)], t0=0.0, t_end=30.0, ref_step_s=1.0)
    assert trial.kills == 2 and trial.kills_in_recovery == 1
    (r,) = trial.recoveries
    assert r.to_start == pytest.approx(8.5) and r.failed_restarts == 1
