"""RestartPolicy as a table: (settings, earlier failures, this failure) -> decision. In-process, no jobs."""

from __future__ import annotations

import dataclasses
import random

import pytest

from supervisor.config import SupervisorConfig
from supervisor.lifecycle import Action
from supervisor.run.restart_policy import RestartPolicy, RestartSettings

BASE = RestartSettings(max_restarts=3, restart_window=0.0, backoff_initial=1.0, backoff_max=8.0, backoff_jitter=0.0,
                       fatal_exit_codes=(42,), max_no_progress_attempts=0)
P, N = True, False  # the failed attempt made progress (a newer valid checkpoint) or not

# (id, settings changes, earlier failures [(exit code, progressed, time)], this failure, (action, delay))
CASES = [
    ("the first failure after a healthy run restarts at once", {}, [], (1, P, 0), (Action.RESTART, 0.0)),
    ("signal death (no exit code) restarts", {}, [], (None, P, 0), (Action.RESTART, 0.0)),
    ("fatal code is never retried", {}, [], (42, P, 0), (Action.FATAL, None)),
    ("fatal wins over an unused budget", {"max_restarts": 100}, [(1, P, 0)], (42, N, 1), (Action.FATAL, None)),
    ("max_restarts failures are restarted", {"max_restarts": 2}, [(1, P, 0)], (1, P, 1), (Action.RESTART, 0.0)),
    ("the job's first failure without progress restarts at once", {}, [], (1, N, 0), (Action.RESTART, 0.0)),
    ("backoff_initial from the second failure in a row", {}, [(1, N, 0)], (1, N, 1), (Action.RESTART, 1.0)),
    ("one more gives up", {"max_restarts": 2}, [(1, P, 0), (1, P, 1)], (1, P, 2), (Action.GIVE_UP, None)),
    ("max_restarts 0: the first failure gives up", {"max_restarts": 0}, [], (1, P, 0), (Action.GIVE_UP, None)),
    ("failures older than restart_window stop counting", {"max_restarts": 2, "restart_window": 10.0},
     [(1, P, 0), (1, P, 1)], (1, P, 100), (Action.RESTART, 0.0)),
    ("failures inside restart_window count", {"max_restarts": 2, "restart_window": 10.0},
     [(1, P, 0), (1, P, 1)], (1, P, 5), (Action.GIVE_UP, None)),
    ("backoff doubles while no progress", {"max_restarts": 10}, [(1, N, 0), (1, N, 1)], (1, N, 2),
     (Action.RESTART, 2.0)),
    ("backoff stops at backoff_max", {"max_restarts": 10}, [(1, N, t) for t in range(5)], (1, N, 5),
     (Action.RESTART, 8.0)),
    ("progress resets the backoff", {"max_restarts": 10}, [(1, N, 0), (1, N, 1), (1, N, 2)], (1, P, 3),
     (Action.RESTART, 0.0)),
    ("no_progress after max_no_progress_attempts in a row", {"max_restarts": 10, "max_no_progress_attempts": 3},
     [(1, N, 0), (1, N, 1)], (1, N, 2), (Action.NO_PROGRESS, None)),
    ("progress breaks the no-progress streak", {"max_restarts": 10, "max_no_progress_attempts": 3},
     [(1, N, 0), (1, P, 1), (1, N, 2)], (1, N, 3), (Action.RESTART, 2.0)),  # delays: 0, 0 (after P), 1, then 2
    ("max_no_progress_attempts 0 is off", {"max_restarts": 10}, [(1, N, t) for t in range(6)], (1, N, 6),
     (Action.RESTART, 8.0)),
]


@pytest.mark.parametrize(("changes", "history", "failure", "expected"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_decision_table(changes: dict, history: list, failure: tuple, expected: tuple) -> None:
    policy = RestartPolicy(dataclasses.replace(BASE, **changes))
    for code, progressed, now in history:
        assert policy.decide(code, progressed, now=now).restart
    decision = policy.decide(*failure[:2], now=failure[2])
    action, delay = expected
    assert decision.action is action
    assert decision.restart == (delay is not None)
    if delay is not None:
        assert decision.delay_s == pytest.approx(delay)


def test_jitter_stays_within_its_fraction() -> None:
    settings = dataclasses.replace(BASE, backoff_jitter=0.2)
    def second_failure(seed: int) -> float:
        policy = RestartPolicy(settings, rng=random.Random(seed))
        policy.decide(1, N, now=0)
        return policy.decide(1, N, now=1).delay_s

    delays = [second_failure(seed) for seed in range(200)]
    assert all(0.8 <= d <= 1.2 for d in delays) and max(delays) - min(delays) > 0.2


def test_budget_left_for_the_warm_launcher() -> None:
    policy = RestartPolicy(dataclasses.replace(BASE, max_restarts=1))
    assert policy.budget_left()
    policy.decide(1, P, now=0)
    assert not policy.budget_left()  # the next failure ends the run: no launcher is pre-spawned for it


def test_settings_from_config() -> None:
    cfg = SupervisorConfig(max_restarts=7, restart_window=5.0, backoff_initial=0.5, backoff_max=2.0,
                           backoff_jitter=0.1, fatal_exit_codes=[3, 4], max_no_progress_attempts=2)
    assert RestartPolicy.from_config(cfg).settings == RestartSettings(7, 5.0, 0.5, 2.0, 0.1, (3, 4), 2)
    assert RestartSettings() == RestartSettings.from_config(SupervisorConfig())  # defaults agree


@pytest.mark.parametrize(("action", "code", "step", "says"), [
    (Action.NO_PROGRESS, 76, 5, "giving up at step 5: 2 attempts in a row made no progress"),
    (Action.NO_PROGRESS, 76, None, "giving up: 2 attempts in a row made no progress"),  # none reported: none named
    (Action.GIVE_UP, 1, 120, "giving up after 4 attempts at step 120"),
    (Action.FATAL, 42, 7, "exit code 42 is fatal: not retrying at step 7"),
])
def test_the_give_up_line_names_the_step_reached_never_a_resume(action: Action, code: int, step: int | None,
                                                                 says: str) -> None:
    from supervisor.lifecycle import EndReason
    from supervisor.run.incidents import Incident
    from supervisor.run.restart_policy import give_up_code

    incident = Incident(0.0, 3, EndReason.EXIT_CODE if action == Action.FATAL else EndReason.SIGNAL,
                        42 if action == Action.FATAL else None, last_step=step, action=action)
    got_code, line = give_up_code(action, incident, 2)
    assert got_code == code and line.startswith(says) and "resum" not in line
