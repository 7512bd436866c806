"""HangDetector's timeouts on real heartbeat files (written in the trainer_hooks record format), and how the step
timeout is learned: across attempts and rlsup restarts, never from a first step or a survived stall."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

from rlsup_format import state_files
from rlsup_format.heartbeat_record import EXTRA, EXTRA_OFFSET
from supervisor.diagnosis.hang_detector import (FIRST_STEP_REPORTS, NO_REPORT_YET, RECUR_RATIO, STALL_RATIO,
                                      STALLS_IN_A_ROW, AutoTimeout, HangDetector, HangSettings, TimeoutOrigin,
                                      learned_key)
from supervisor.diagnosis.step_reports import JOB_RANK
from trainer_hooks.heartbeat import MAGIC, RECORD, RECORD_SIZE, SECTIONS, rank_file_name

S = 1_000_000_000


def write_record(directory: Path, rank: int, beat_ns: int = 0, section: str = "none", section_ns: int = 0,
                 step: int = 0) -> None:
    data = bytearray(RECORD_SIZE)
    RECORD.pack_into(data, 0, 2, MAGIC, os.getpid(), step, beat_ns, SECTIONS[section], section_ns, 0, 0, 0)
    (directory / rank_file_name(rank)).write_bytes(bytes(data))


def detector(directory: Path) -> HangDetector:
    d = HangDetector(directory, startup_timeout=10, save_timeout=100, explicit_timeout=5,
                     auto=AutoTimeout(5, 1, 600, 5))
    d.started_ns = 1_000 * S
    return d


def test_no_rank_registered_is_a_startup_timeout(tmp_path: Path) -> None:
    d = detector(tmp_path)
    assert d.check(now_ns=1_009 * S) is None
    verdict = d.check(now_ns=1_011 * S)
    assert verdict is not None and verdict.reason == "startup_timeout"


def test_a_long_first_restore_is_held_to_save_timeout_not_startup(tmp_path: Path) -> None:
    """A large checkpoint's first load outlasts startup_timeout: not a hang while within save_timeout."""
    d = detector(tmp_path)
    write_record(tmp_path, 0, section="load", section_ns=1_001 * S)
    assert d.check(now_ns=1_050 * S) is None  # 49 s in the load > startup_timeout 10 s
    verdict = d.check(now_ns=1_102 * S)
    assert verdict is not None and verdict.reason == "save_timeout" and verdict.rank == 0
    # The load ended at 1_090 s: startup counts from there (first step due within startup_timeout).
    write_record(tmp_path, 0, section="none", section_ns=1_090 * S)
    assert d.check(now_ns=1_099 * S) is None
    verdict = d.check(now_ns=1_101 * S)
    assert verdict is not None and verdict.reason == "startup_timeout"


def test_silence_after_heartbeats_is_a_hang(tmp_path: Path) -> None:
    d = detector(tmp_path)
    write_record(tmp_path, 0, beat_ns=1_002 * S, step=1)  # step 1 done (a fresh start counts from 0)
    write_record(tmp_path, 1, beat_ns=1_006 * S, step=1)
    assert d.check(now_ns=1_006 * S) is None
    verdict = d.check(now_ns=1_008 * S)
    assert verdict is not None and verdict.reason == "heartbeat_timeout" and verdict.rank == 0


def test_an_exiting_rank_is_held_to_save_timeout(tmp_path: Path) -> None:
    """After its last step a rank's interpreter teardown is not a hang (trainer_hooks marks 'exit')."""
    d = detector(tmp_path)
    write_record(tmp_path, 0, beat_ns=1_001 * S, section="exit", section_ns=1_002 * S)
    assert d.check(now_ns=1_050 * S) is None  # 48 s in the exit > heartbeat timeout 5 s: exiting, not hung
    verdict = d.check(now_ns=1_103 * S)
    assert verdict is not None and verdict.reason == "save_timeout" and verdict.rank == 0


def test_last_step_is_the_ranks_once_they_beat_beside_the_output(tmp_path: Path) -> None:
    """The output's record (``progress``; HF prints global_step + 1) does not set the last step once the
    ranks heartbeat themselves; alone, it does."""
    d = detector(tmp_path)
    write_record(tmp_path, -1, beat_ns=1_001 * S, step=10)
    d.scan()
    assert d.last_step() == 10
    write_record(tmp_path, 0, beat_ns=1_002 * S, step=4)
    d.scan()
    assert d.last_step() == 4


# ---------------------------------------------------------------- the learned timeout (issue 41)

class Writer:
    """A rank's heartbeat file as trainer_hooks writes it (previous beat included), on an injected clock."""

    def __init__(self, directory: Path, rank: int = 0, pid: int | None = None) -> None:
        self.path, self.rank, self.pid = directory / rank_file_name(rank), rank, pid or os.getpid()
        self.step, self.beat_ns, self.prev = -1, 0, (-1, 0)
        self.section, self.section_ns = "none", 0

    def beat(self, step: int, at_s: float) -> None:
        self.prev = (self.step, self.beat_ns)
        self.step, self.beat_ns = step, int(at_s * S)
        self._write()

    def enter(self, section: str, at_s: float) -> None:
        self.section, self.section_ns = section, int(at_s * S)
        self._write()

    def _write(self) -> None:
        data = bytearray(RECORD_SIZE)
        RECORD.pack_into(data, 0, 2, MAGIC, self.pid, self.step, self.beat_ns, SECTIONS[self.section],
                         self.section_ns, 0, 0, 0)
        EXTRA.pack_into(data, EXTRA_OFFSET, self.prev[0], self.prev[1], 0, 0)
        self.path.write_bytes(bytes(data))


def attempt_dir(root: Path, attempt: int) -> Path:
    d = root / f"attempt_{attempt}"
    d.mkdir()
    return d


def settings(**kw: float) -> HangSettings:
    base = dict(startup_timeout=60, save_timeout=100, heartbeat_timeout=None, heartbeat_timeout_initial=600,
                auto_timeout_factor=5, auto_timeout_floor=1, auto_timeout_min_intervals=3)
    return HangSettings(**{**base, **kw})


def run_steps(det: HangDetector, w: Writer, steps: list[tuple[int, float]]) -> None:
    """Each report, then a poll right after it (as rlsup's 0.1 s polls see steps slower than that)."""
    for step, at in steps:
        w.beat(step, at)
        assert det.check(now_ns=int(at * S) + 1) is None


def test_intervals_count_across_attempts_and_a_hang_in_the_third_is_caught_within_the_learned_timeout(
        tmp_path: Path) -> None:
    """Each attempt reports two steps (one interval): no attempt alone sees min_intervals (3), the run does. The
    third attempt's SIGSTOP-like silence is caught at the learned 5 x 1 s, not the initial 600 s."""
    s = settings()
    auto = AutoTimeout.from_settings(s)
    for attempt in range(3):
        det = HangDetector.from_settings(attempt_dir(tmp_path, attempt), s, auto, alive=lambda pid: True)
        t0 = 1_000.0 * (attempt + 1)
        w = Writer(det.directory)
        run_steps(det, w, [(1, t0 + 1), (2, t0 + 2)])
        if attempt < 2:
            assert det.timeout() == 600 and det.origin().source == "initial"
    assert det.timeout() == 5.0 and det.origin() == TimeoutOrigin(
        "learned", 3, 0, "learned from 3 step intervals: 5 x the longest step interval 1.00s")
    assert det.check(now_ns=int((t0 + 2 + 4.9) * S)) is None
    verdict = det.check(now_ns=int((t0 + 2 + 5.1) * S))
    assert verdict is not None and (verdict.reason, verdict.timeout_s, verdict.step) == ("heartbeat_timeout", 5.0, 2)


def test_two_reports_between_polls_teach_one_step_not_their_sum(tmp_path: Path) -> None:
    """Steps faster than the poll: the record's previous beat gives the last step's own interval."""
    auto = AutoTimeout(5, 0.1, 600, 1)
    det = HangDetector(tmp_path, 60, 100, None, auto)
    w = Writer(tmp_path)
    w.beat(1, 10.0)
    det.check(now_ns=int(10.01 * S))
    w.beat(2, 10.3)
    w.beat(3, 10.6)  # polled only now: 0.6 s since the last poll's beat, 0.3 s the step
    det.check(now_ns=int(10.61 * S))
    assert auto.basis == pytest.approx(0.3) and auto.intervals_seen == 1


@pytest.mark.parametrize("shape", ["bar drawn at 0 before the first step", "heartbeat right after the restore",
                                   "output's first line, start unknown"])
def test_a_first_step_20s_long_does_not_raise_the_timeout_and_is_held_to_startup(tmp_path: Path, shape: str) -> None:
    """Communicator set-up, compilation, the first batch: the first step after a launch or restore is not a
    step interval. 20 s of it neither teaches the timeout (5 x 1 s steps: 5 s, not 100 s) nor is a hang at the
    learned 5 s: it is held to startup_timeout (60 s), as a save is held to save_timeout."""
    start, rank = {"bar drawn at 0 before the first step": (0, JOB_RANK),
                   "heartbeat right after the restore": (40, 0),
                   "output's first line, start unknown": (None, JOB_RANK)}[shape]
    s = settings(auto_timeout_min_intervals=5)
    auto = AutoTimeout.from_settings(s)
    auto.basis = 1.0  # learned in earlier attempts: 5 s in force
    first = start if start is not None else 7  # its first reading: the step it starts from
    det = HangDetector.from_settings(tmp_path, s, auto, alive=lambda pid: True, start_step=start)
    w = Writer(tmp_path, rank)
    run_steps(det, w, [(first, 100.0)])
    assert det.check(now_ns=int(119 * S)) is None  # 19 s into the first step: no hang at 5 s
    run_steps(det, w, [(first + 1, 120.0)] + [(first + 1 + i, 120.0 + i) for i in range(1, 6)])
    assert (det.timeout(), auto.basis, auto.stalls) == (5.0, 1.0, 0), "the first step taught the timeout"
    # A first step that never ends is a startup_timeout, rank named.
    det = HangDetector.from_settings(attempt_dir(tmp_path, 1), s, auto, alive=lambda pid: True, start_step=start)
    w = Writer(det.directory, rank)
    run_steps(det, w, [(first, 200.0)])
    assert det.check(now_ns=int(259 * S)) is None
    verdict = det.check(now_ns=int(261 * S))
    assert verdict is not None and (verdict.reason, verdict.rank, verdict.timeout_s) == ("startup_timeout", rank, 60)


def test_the_step_after_a_restore_inside_the_attempt_is_a_first_step(tmp_path: Path) -> None:
    s = settings()
    auto = AutoTimeout.from_settings(s)
    auto.basis = 1.0
    det = HangDetector.from_settings(tmp_path, s, auto, alive=lambda pid: True)
    w = Writer(tmp_path)
    run_steps(det, w, [(1, 10.0), (2, 11.0)])
    w.enter("load", 11.5)
    assert det.check(now_ns=int(12 * S)) is None
    w.enter("none", 30.0)  # restored (18.5 s, held to save_timeout); the next step compiles again
    assert det.check(now_ns=int(45 * S)) is None  # 15 s > 5 s: no hang, it is a first step
    run_steps(det, w, [(3, 50.0), (4, 51.0)])
    assert auto.basis == 1.0 and auto.stalls == 0
    verdict = det.check(now_ns=int(57 * S))
    assert verdict is not None and verdict.reason == "heartbeat_timeout"


def test_what_a_survived_stall_teaches(tmp_path: Path) -> None:
    """docs/hangs.md: a stall the job survived once (a partition, a blip) is counted, not learned, one among the
    first intervals neither; the same rank surviving one of about its length again, ordinary steps between (a
    periodic evaluation), is a recurring phase and is learned; STALLS_IN_A_ROW in a row on a rank are the step
    getting longer, and are learned."""
    auto = AutoTimeout(5, 1, 600, 5)
    for interval in (1.0, 90.0, 1.0, 1.1, 1.0):  # node cut off for 90 s while the timeout was still the initial
        auto.observe(interval, 0)
    assert (auto.current(), auto.stalls, auto.longest_held()) == (5.5, 1, 90.0)
    assert auto.origin().text == ("learned from 4 step intervals: 5 x the longest step interval 1.10s; "
                                  "1 survived stall(s) up to 90.0s not learned")
    for rank in range(4):  # a later blip: every rank of the node sees it once, then steps on as before
        auto.observe(4.0, rank)
    for rank in range(4):
        auto.observe(1.0, rank)
    auto.observe(50.0, 0)  # rank 0 cut off again, 50 s: not about its 90 s (more than RECUR_RATIO apart)
    assert 90 / 50 > RECUR_RATIO and auto.current() == 5.5 and auto.stalls == 6
    for _ in range(STALLS_IN_A_ROW - 1):
        auto.observe(12.0, 5)
    assert auto.current() == 5.5 and auto.stalls == 8
    assert auto.origin().text.endswith("; 8 survived stall(s) up to 90.0s not learned")
    auto.observe(12.0, 5)  # rank 5's steps now take 12 s, three in a row: that is the step, not a stall
    assert auto.current() == 60.0 and auto.stalls == 6 and auto.longest_held() == 90.0
    auto.observe(1.0, 1)
    assert auto.current() == 60.0  # never down

    # A 4 s evaluation every 100 steps, unmarked: survived once (a stall), survived again on the same rank with
    # ordinary steps between: a recurring phase, learned, so its third time is no hang.
    auto = AutoTimeout(5, 1, 600, 3)
    for interval in (1.0, 1.0, 1.0, 4.0, *[1.0] * 99, 4.4):
        auto.observe(interval, 0)
    assert auto.current() == 22.0 and auto.stalls == 0 and auto.learned == 104
    # While learning too: two evaluations among the first intervals (held as stalls) are learned at once.
    auto = AutoTimeout(5, 1, 600, 6)
    for interval in (1.0, 4.0, 1.0, 1.0, 3.8, 1.0):
        auto.observe(interval, 0)
    assert auto.current() == 20.0 and auto.stalls == 0
    # On another rank each, or one in a row with the first: stalls (a partition gives each rank one).
    auto = AutoTimeout(5, 1, 600, 3)
    for interval, rank in ((1.0, 0), (1.0, 0), (1.0, 0), (4.0, 0), (4.0, 1), (1.0, 0), (1.0, 1)):
        auto.observe(interval, rank)
    assert auto.current() == 5.0 and auto.stalls == 2


def test_a_phase_longer_than_the_learned_timeout_is_a_hang_and_the_incident_says_it_survived_once(
        tmp_path: Path) -> None:
    """docs/hangs.md: a 60 s evaluation survived under the initial timeout while learning is a stall; the learned
    timeout (5 x 1 s) is below it, so when it recurs it is a hang, never learned: the verdict says the rank
    survived as long before and how to mark it."""
    auto = AutoTimeout(5, 1, 600, 3)
    det = HangDetector(tmp_path, 60, 100, None, auto, alive=lambda pid: True)
    w = Writer(tmp_path)
    run_steps(det, w, [(1, 10.0), (2, 11.0), (3, 71.0), (4, 72.0), (5, 73.0)])
    assert (auto.current(), auto.stalls) == (5.0, 1)
    verdict = det.check(now_ns=int(78.1 * S))
    assert verdict is not None and verdict.reason == "heartbeat_timeout"
    assert verdict.note.startswith("this rank survived a 60.0s stall before, not learned"), verdict.note


def test_a_long_interval_with_the_outputs_other_bars_moving_is_a_stall_not_a_lesson(tmp_path: Path) -> None:
    """The output's signs of life (an evaluation bar, PyKEEN's batch bar inside every epoch) do not stop an
    interval from counting: PyKEEN learns its epoch, and an evaluation's long interval is a stall."""
    auto = AutoTimeout(5, 1, 600, 3)
    det = HangDetector(tmp_path, 60, 100, None, auto, alive=lambda pid: True)
    w = Writer(tmp_path, JOB_RANK)
    for step in range(1, 5):
        w.enter("none", 10.0 * step + 5)  # the batch bar moved mid-epoch
        run_steps(det, w, [(step, 10.0 * step + 10)])
    assert auto.basis == 10.0 and auto.learned == 3
    w.enter("none", 100.0)  # a 60 s evaluation, its bar moving
    run_steps(det, w, [(5, 110.0)])
    assert auto.basis == 10.0 and auto.stalls == 1


def test_the_docs_state_the_stall_rule_the_code_has() -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "hangs.md").read_text()
    assert f"{STALL_RATIO:g} x" in doc and f"{STALLS_IN_A_ROW} in a row" in doc, "docs/hangs.md: stall rule stale"
    assert f"**{RECUR_RATIO:g} x** the shorter" in doc, "docs/hangs.md: recurrence rule stale"
    assert f"**{FIRST_STEP_REPORTS}rd report**" in doc, "docs/hangs.md: first-step rule stale"


def test_the_learned_timeout_survives_an_rlsup_restart_and_a_bad_file_is_ignored(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    s = settings()
    path, command = tmp_path / state_files.LEARNED_TIMEOUT, ["python", "train.py"]
    auto = AutoTimeout.from_settings(s, path, command)
    for interval in (1.0, 1.2, 1.1, 50.0):
        auto.observe(interval)
        auto.persist()
    again = AutoTimeout.from_settings(s, path, command)  # the next rlsup of this command
    assert (again.current(), again.origin()) == (6.0, auto.origin()) and again.stalls == 1
    path.unlink()
    partial = AutoTimeout.from_settings(s, path, command)
    partial.observe(1.0)  # still learning: one of the three needed seen
    partial.persist()
    resumed = AutoTimeout.from_settings(s, path, command)
    assert resumed.origin().text == "initial: 1 of the 3 step intervals needed to learn it seen"
    resumed.observe(1.0)
    resumed.observe(1.0)
    assert resumed.current() == 5.0 and resumed.origin().intervals == 3
    assert AutoTimeout.from_settings(s, path, ["python", "other.py"]).current() == 600  # another job's
    for bad in ("{not json", json.dumps({"version": 2, "command": command, "basis": -1}),
                json.dumps({"version": 1}), "[]"):
        path.write_text(bad)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="supervisor.diagnosis.hang_detector"):
            fresh = AutoTimeout.from_settings(s, path, command)
        assert fresh.current() == 600 and fresh.origin().source == "initial"
        (rec,) = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert str(path) in rec.getMessage() and "ignoring" in rec.getMessage(), rec.getMessage()
        fresh.observe(1.0)
        fresh.persist()
        assert json.loads(path.read_text())["learning"] == [1.0]  # replaced by a good one


def test_metrics_show_how_the_timeout_was_reached() -> None:
    from supervisor.cli.metrics import SupervisorMetrics

    m = SupervisorMetrics(node="n")
    auto = AutoTimeout(5, 1, 600, 2)
    m.heartbeat_timeout(auto.origin())
    assert m.registry.get_sample_value("rlsup_heartbeat_timeout_source",
                                       {"rlsup_heartbeat_timeout_source": "initial"}) == 1
    for interval in (1.0, 1.0, 9.0):
        auto.observe(interval)
    m.heartbeat_timeout(auto.origin())
    assert m.registry.get_sample_value("rlsup_heartbeat_timeout_source",
                                       {"rlsup_heartbeat_timeout_source": "learned"}) == 1
    assert m.registry.get_sample_value("rlsup_heartbeat_timeout_intervals") == 2
    assert m.registry.get_sample_value("rlsup_heartbeat_stalls") == 1
    m.heartbeat_timeout(auto.origin(explicit=30.0))
    assert m.registry.get_sample_value("rlsup_heartbeat_timeout_source",
                                       {"rlsup_heartbeat_timeout_source": "explicit"}) == 1


def test_the_last_steps_interval_counts_when_the_rank_exits_right_after_it(tmp_path: Path) -> None:
    """An attempt that reports its second step and exits before the next poll (trainer_hooks marks the exit) still
    teaches that step; a save inside an interval does not."""
    auto = AutoTimeout(5, 0.1, 600, 1)
    det = HangDetector(tmp_path, 60, 100, None, auto)
    w = Writer(tmp_path)
    w.beat(1, 10.0)
    det.scan()
    w.beat(2, 11.0)
    w.enter("exit", 11.001)
    det.scan()
    assert auto.basis == 1.0 and auto.intervals_seen == 1
    w = Writer(attempt_dir(tmp_path, 1), pid=os.getpid() + 1)
    det = HangDetector(w.path.parent, 60, 100, None, auto)
    w.beat(1, 20.0)
    w.enter("save", 20.1)
    det.scan()
    w.enter("none", 29.0)
    w.beat(2, 30.0)
    det.scan()
    assert auto.intervals_seen == 1, "an interval with a save in it was learned"


# ---------------------------------------------------------------- review of issue 41's first-step rule

def learned_auto() -> tuple[HangSettings, AutoTimeout]:
    s = settings(auto_timeout_min_intervals=3)
    auto = AutoTimeout.from_settings(s)
    auto.basis = 1.0  # learned before: 5 s in force
    return s, auto


def test_a_bar_drawn_at_0_then_at_the_resumed_step_does_not_end_the_first_step(tmp_path: Path) -> None:
    """HF/TRL: resumed from step 70, the bar is drawn at 0/N, then jumps to 70 before the first step: the first
    step (20 s, 70 -> 71) is held to startup_timeout, not the learned 5 s, and teaches nothing."""
    s, auto = learned_auto()
    det = HangDetector.from_settings(tmp_path, s, auto, alive=lambda pid: True, start_step=70)
    w = Writer(tmp_path, JOB_RANK)
    run_steps(det, w, [(0, 100.0), (70, 101.0)])
    assert det.check(now_ns=int(120 * S)) is None, "the resumed position ended the first step"
    run_steps(det, w, [(71, 121.0), (72, 122.0), (73, 123.0)])
    assert (auto.basis, auto.stalls, auto.intervals_seen) == (1.0, 0, 2)
    verdict = det.check(now_ns=int(128.1 * S))  # past the first step: the learned timeout holds
    assert verdict is not None and (verdict.reason, verdict.timeout_s) == ("heartbeat_timeout", 5.0)


def test_a_start_the_reports_never_pass_ends_the_first_step_at_its_third_report(tmp_path: Path) -> None:
    """A trainer whose heartbeat counts from 0 in each attempt (or a start above where it really resumed) is
    not held to startup_timeout for the whole attempt: the FIRST_STEP_REPORTS-th report ends its first step."""
    s, auto = learned_auto()
    det = HangDetector.from_settings(tmp_path, s, auto, alive=lambda pid: True, start_step=40)
    w = Writer(tmp_path)
    run_steps(det, w, [(step, 100.0 + step) for step in range(FIRST_STEP_REPORTS)])
    assert det.in_first_step(det.records[0]) is False
    run_steps(det, w, [(FIRST_STEP_REPORTS, 100.0 + FIRST_STEP_REPORTS)])
    assert auto.intervals_seen == 1  # the interval after the report that ended it
    verdict = det.check(now_ns=int((100 + FIRST_STEP_REPORTS + 5.1) * S))
    assert verdict is not None and verdict.reason == "heartbeat_timeout"


def test_an_unknown_start_is_the_highest_step_an_earlier_attempt_reported(tmp_path: Path) -> None:
    """PyKEEN: one file rewritten in place (rlsup cannot tell where an attempt resumes) and its epoch printed
    only at each save. Past the first attempt, a report beyond the highest step earlier attempts reported ends
    the first step: a hang after it is caught at the timeout in force, not at startup_timeout, and each attempt's
    interval after it teaches. Before any report, startup_timeout still holds; launch -> first report teaches
    nothing."""
    s = settings(auto_timeout_min_intervals=3, startup_timeout=60)
    auto = AutoTimeout.from_settings(s)
    for attempt in range(4):  # each attempt prints two epochs: 2a+1 and 2a+2
        det = HangDetector.from_settings(attempt_dir(tmp_path, attempt), s, auto, alive=lambda pid: True,
                                         start_step=None)
        t0 = 1_000.0 * (attempt + 1)
        det.started_ns = int(t0 * S)
        assert det.check(now_ns=int((t0 + 59) * S)) is None
        w = Writer(det.directory, JOB_RANK)
        run_steps(det, w, [(2 * attempt + 1, t0 + 59.5), (2 * attempt + 2, t0 + 60.5)])
    assert auto.intervals_seen == 3 and auto.current() == 5.0, "attempts 1-3 taught their interval"
    # Startup: no report within startup_timeout is a startup_timeout, however much was learned.
    det = HangDetector.from_settings(attempt_dir(tmp_path, 4), s, auto, alive=lambda pid: True, start_step=None)
    det.started_ns = 5_000 * S
    verdict = det.check(now_ns=5_060_100_000_000)
    assert verdict is not None and (verdict.reason, verdict.note) == ("startup_timeout", NO_REPORT_YET)
    # One print per attempt: the print past epoch 8 ends the first step; a hang after it waits 5 s, not 60 s.
    det = HangDetector.from_settings(attempt_dir(tmp_path, 5), s, auto, alive=lambda pid: True, start_step=None)
    det.started_ns = 6_000 * S
    w = Writer(det.directory, JOB_RANK)
    run_steps(det, w, [(8, 6_001.0)])  # bar drawn at the resumed epoch: a position
    assert det.check(now_ns=6_030 * S) is None
    run_steps(det, w, [(9, 6_040.0)])  # its first epoch done (39 s, held to startup_timeout, not learned)
    assert auto.basis == 1.0
    verdict = det.check(now_ns=int(6_045.1 * S))
    assert verdict is not None and (verdict.reason, verdict.timeout_s) == ("heartbeat_timeout", 5.0)


def test_a_startup_timeout_says_whether_a_step_was_reported(tmp_path: Path) -> None:
    s, auto = learned_auto()
    det = HangDetector.from_settings(tmp_path, s, auto, alive=lambda pid: True, start_step=0)
    det.started_ns = 100 * S
    verdict = det.check(now_ns=161 * S)
    assert verdict is not None and (verdict.reason, verdict.rank, verdict.note) == ("startup_timeout", None,
                                                                                    NO_REPORT_YET)
    w = Writer(tmp_path, 3)
    w.beat(0, 110.0)  # a heartbeat before the first step: a position
    verdict = det.check(now_ns=171 * S)
    assert verdict is not None and verdict.reason == "startup_timeout" and verdict.rank == 3
    assert verdict.note == "first step after launch too long (last report: step 0)", verdict.note
    run_steps(det, w, [(1, 171.0), (2, 172.0)])
    w.enter("load", 172.5)
    det.check(now_ns=173 * S)
    w.enter("none", 180.0)
    verdict = det.check(now_ns=241 * S)
    assert verdict is not None and verdict.note == "first step after a restore too long (last report: step 2)"


def test_what_was_learned_is_kept_across_a_requeue_onto_other_nodes(tmp_path: Path) -> None:
    """torchrun's head node, port, rendezvous id and node rank change with the allocation: not part of the key."""
    s = settings()
    path = tmp_path / state_files.LEARNED_TIMEOUT
    here = ["torchrun", "--nnodes", "2", "--node-rank", "0", "--master-addr", "n01", "--master-port=29500",
            "--rdzv-endpoint", "n01:29400", "--rdzv_id=771", "train.py", "--resume={resume?{dir}:none}"]
    there = ["torchrun", "--nnodes", "2", "--node_rank=1", "--master_addr", "n07", "--master-port", "29511",
             "--rdzv_endpoint=n07:29400", "--rdzv-id", "772", "train.py", "--resume={resume?{dir}:none}"]
    assert learned_key(here) == learned_key(there) == ["torchrun", "--nnodes", "2", "train.py",
                                                       "--resume={resume?{dir}:none}"]
    auto = AutoTimeout.from_settings(s, path, here)
    for interval in (1.0, 1.0, 1.0):
        auto.observe(interval)
    auto.reached(9)
    auto.persist()
    again = AutoTimeout.from_settings(s, path, there)
    assert (again.current(), again.step_reached) == (5.0, 9)
    other = AutoTimeout.from_settings(s, path, [*learned_key(there)[:-2], "eval.py", "--resume=x"])
    assert other.current() == 600 and other.step_reached is None


def test_survived_stalls_and_the_step_reached_survive_an_rlsup_restart(tmp_path: Path) -> None:
    s = settings()
    path = tmp_path / state_files.LEARNED_TIMEOUT
    auto = AutoTimeout.from_settings(s, path, ["python", "train.py"])
    for interval in (1.0, 1.0, 1.0, 4.0, 1.0):
        auto.observe(interval, 2)
    auto.reached(5)
    auto.persist()
    again = AutoTimeout.from_settings(s, path, ["python", "train.py"])
    assert (again.survived, again.stalls, again.step_reached) == ({2: [4.0]}, 1, 5)
    again.observe(4.2, 2)  # the same phase once more, after the requeue: learned
    assert again.current() == 21.0 and again.stalls == 0
