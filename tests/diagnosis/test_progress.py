"""Progress read from an unmodified trainer's output (issue 20): the presets read each trainer's real
line, and a job that only prints verl-format progress and then freezes is caught as hung within the
learned timeout, with py-spy stacks in the incident, and restarted. Real processes throughout."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from rlsup_format.heartbeat_record import read_record
from supervisor.diagnosis.hang_detector import AutoTimeout, HangDetector
from supervisor.processes.job import OutputTail
from supervisor.diagnosis.step_reports import (JOB_RANK, PRESETS, ProgressRecorder, StepTracker, not_training_markdown,
                                 presets_markdown, progress_pattern)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_each_preset_reads_its_trainers_line(name: str, tmp_path: Path) -> None:
    rec = ProgressRecorder(progress_pattern(name, ""), tmp_path, pid=4242)
    rec.feed(PRESETS[name].example)
    (path,) = tmp_path.glob("rank_*.hb")
    record = read_record(path)
    assert record is not None and (record.rank, record.step, record.pid) == (JOB_RANK, 12, 4242)
    assert record.beat_ns > 0
    for other in set(PRESETS) - {name}:  # no preset reads another trainer's line as progress
        assert not progress_pattern(other, "").search(PRESETS[name].example), (other, name)


def test_a_tqdm_bar_is_read_as_it_redraws(tmp_path: Path) -> None:
    """The HF preset sees each ``\\r`` redraw at once, not only when the bar's line ends."""
    import threading

    read_fd, write_fd = os.pipe()
    steps: list[int] = []
    seen = threading.Event()

    class Spy(ProgressRecorder):
        def beat(self, step: int) -> None:
            steps.append(step)
            if step == 3:
                seen.set()

    tail = OutputTail(5, tmp_path / "out.log", echo=open(os.devnull, "w"))
    tail.on_segment = Spy(progress_pattern("hf", ""), tmp_path, pid=1).feed
    tail.start(os.fdopen(read_fd, "rb", buffering=0))
    for step in (1, 2, 3):
        os.write(write_fd, f"\r {step * 10}%|█         | {step}/10 [00:0{step}<00:09,  1.00it/s]".encode())
    assert seen.wait(10), steps  # no newline written yet
    os.write(write_fd, b"\n{'loss': 1.5, 'epoch': 0.3}\n")
    os.close(write_fd)
    tail.join(10)
    assert sorted(set(steps)) == [1, 2, 3] and steps == sorted(steps)  # a redraw may be read twice, never lost
    assert tail.tail()[-1] == "{'loss': 1.5, 'epoch': 0.3}"


def test_presets_and_ignored_bars_are_documented_as_the_code_has_them() -> None:
    """docs/progress.md's preset table and list of ignored bars are the ones generated from the code."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "progress.md").read_text()
    assert presets_markdown() in doc and not_training_markdown() in doc, (
        "docs/progress.md is stale: paste supervisor.diagnosis.step_reports.presets_markdown() and not_training_markdown()")


def test_the_progress_key_names_every_preset() -> None:
    import dataclasses

    from supervisor.config import SupervisorConfig

    (field,) = [f for f in dataclasses.fields(SupervisorConfig) if f.name == "progress"]
    help_text = field.metadata["help"]
    assert all(name in help_text for name in PRESETS), help_text


def test_verl_line_interleaved_with_another_ranks_write_still_counts(tmp_path: Path) -> None:
    """torchrun's ranks share one pipe: another rank's text can land right before verl's 'step:N'."""
    rec = ProgressRecorder(progress_pattern("verl", ""), tmp_path, pid=1)
    rec.feed("freezing before step 4step:3 - actor/pg_loss:4.1483 - training/global_step:3 - timing_s/step:0.2")
    record = read_record(next(tmp_path.glob("rank_*.hb")))
    assert record is not None and record.step == 3


def test_areal_done_line_is_its_last_step_only() -> None:
    done = re.compile(PRESETS["areal"].done)
    line = "20251124-08:41:03.123 StatsLogger INFO: Epoch 3/3 Step 200/200 Train step {}/600 done."
    assert done.search(line.format(600)) and not done.search(line.format(60))
    assert not done.search(line.format(599)) and not done.search(line.format(6))
    assert all(not p.done for name, p in PRESETS.items() if name != "areal")  # they exit 0 when done


def test_metrics_follow_the_ranks_once_they_beat_beside_the_output() -> None:
    """The output's record is ``local_rank="job"`` while it alone beats; once ranks beat, their records
    count: the saves of rank 0 are counted (the output's record never saves) and the "job" series goes."""
    import time

    from rlsup_format.heartbeat_record import HeartbeatRecord
    from supervisor.cli.metrics import SupervisorMetrics

    m = SupervisorMetrics("job")
    now = time.monotonic_ns()
    job = HeartbeatRecord(JOB_RANK, 10, 3, now, "none", 0, False)
    m.heartbeats({JOB_RANK: job}, 30.0)
    assert m.registry.get_sample_value("rlsup_heartbeat_age_seconds", {"local_rank": "job"}) is not None
    assert m.registry.get_sample_value("rlsup_heartbeat_age_seconds", {"local_rank": "-1"}) is None
    ranks = {r: HeartbeatRecord(r, 20 + r, 4, now, "none", 0, False, saves=2, save_ns=10**8) for r in (0, 1)}
    m.heartbeats({JOB_RANK: job, **ranks}, 30.0)
    assert m.registry.get_sample_value("rlsup_checkpoint_saves_total") == 2
    assert m.registry.get_sample_value("rlsup_heartbeat_age_seconds", {"local_rank": "job"}) is None
    assert m.registry.get_sample_value("rlsup_heartbeat_age_seconds", {"local_rank": "0"}) is not None
    assert m.registry.get_sample_value("rlsup_last_step") == 4


# Real output captured from the real trainers (tests/data/progress/capture.py; versions.txt): the bytes
# each wrote into a pipe, \r redraws and tqdm's cursor-up escapes included.
DATA = Path(__file__).resolve().parents[1] / "data" / "progress"


class _Chunks:
    """A pipe's read end that hands the output over in the given pieces (what one read returns)."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks

    def read1(self, _size: int) -> bytes:
        return self.chunks.pop(0) if self.chunks else b""


def _events(preset: str, data: bytes, tmp_path: Path, chunks: list[bytes] | None = None) -> list[str]:
    """The output through OutputTail (segments at \\n and \\r, redraws fed before their line ends) into a
    recorder: each beat as its step, each sign of life as 'a'."""
    events: list[str] = []

    class Spy(ProgressRecorder):
        def beat(self, step: int) -> None:
            events.append(str(step))
            super().beat(step)

        def alive(self) -> None:
            events.append("a")
            super().alive()

    tail = OutputTail(5, tmp_path / "out.log", echo=open(os.devnull, "w"))
    tail.on_segment = Spy(progress_pattern(preset, ""), tmp_path, pid=1).feed
    tail.start(_Chunks(chunks if chunks is not None else [data]))
    tail.join(10)
    return events


def _steps(events: list[str]) -> list[int]:
    return [int(e) for e in events if e != "a"]


def _pieces(data: bytes, size: int) -> list[bytes]:
    """``data`` cut every ``size`` bytes and right before every escape: each redraw of a nested bar is
    also read without its cursor-up escape, as a reader that wakes between tqdm's two writes sees it."""
    out: list[bytes] = []
    for part in data.split(b"\x1b"):
        out.extend(part[i:i + size] for i in range(0, len(part), size))
        out.append(b"\x1b")
    return out[:-1]


@pytest.mark.parametrize("size", [0, 7])
def test_hf_trainer_output_beats_on_training_steps_only(size: int, tmp_path: Path) -> None:
    """transformers 5.x Trainer with a datasets map/filter, an evaluation and a save every 6 of 14 steps:
    every training step beats once, in order; the datasets bars, the evaluation bar (drawn under the
    training bar, read with and without its escape) and 'Writing model shards: 1/1' never do (before,
    the last step read after every save was 1). They are signs of life."""
    data = (DATA / "hf_trainer.out").read_bytes()
    assert b"Writing model shards: 100%" in data and b"Map: 100%" in data and b"| 8/8 [" in data
    events = _events("hf", data, tmp_path, _pieces(data, size) if size else None)
    assert _steps(events) == list(range(15)), events
    assert events.count("a") >= 6 and events[:4] == ["a"] * 4  # Map and Filter, before training
    record = read_record(next(tmp_path.glob("rank_*.hb")))
    assert record is not None and record.step == 14


def test_a_redraw_of_the_same_step_is_not_a_heartbeat(tmp_path: Path) -> None:
    """tqdm redraws a stuck bar (new elapsed time, a log line written above it, its monitor thread): the
    beat time stays the step's, so a hang is caught within the timeout of its last step."""
    rec = ProgressRecorder(progress_pattern("hf", ""), tmp_path, pid=os.getpid())
    rec.feed(" 40%|████      | 4/10 [00:04<00:06,  1.00it/s]")
    first = read_record(rec.path)
    rec.feed(" 50%|█████     | 5/10 [00:05<00:05,  1.00it/s]")
    beat5 = read_record(rec.path)
    for elapsed in range(6, 80):
        rec.feed(f" 50%|█████     | 5/10 [00:{elapsed:02d}<00:05,  1.00it/s]")
    rec.feed("{'loss': '4.167', 'grad_norm': '0.753', 'learning_rate': '0.0006429', 'epoch': '0.375'}")
    rec.feed(" 50%|█████     | 5/10 [01:20<00:05,  1.00it/s]")
    assert read_record(rec.path) == beat5 and beat5.step == 5 and beat5.beat_ns > first.beat_ns
    detector = HangDetector(tmp_path, startup_timeout=600, save_timeout=600, explicit_timeout=60.7,
                            auto=AutoTimeout(5, 1, 600, 5))
    detector.check(now_ns=beat5.beat_ns)
    verdict = detector.check(now_ns=beat5.beat_ns + 61 * 10**9)
    assert verdict is not None and verdict.reason == "heartbeat_timeout" and verdict.step == 5


def test_a_full_training_bar_holds_the_final_save_and_exit_to_save_timeout(tmp_path: Path) -> None:
    """Seen in CI: TRL finished its 120 steps, saved the model, and its exit took longer than the learned step
    timeout (3 s there): a false hang killed a finished job. A full bar over the steps is the end of the training
    loop; the silence after it is held to save_timeout, as trainer_hooks' exit section is. A bar not yet full
    stays under the learned timeout."""
    rec = ProgressRecorder(progress_pattern("hf", ""), tmp_path, pid=os.getpid())
    for n in (8, 9):
        rec.feed(f" {n * 10}%|████████  | {n}/10 [00:0{n}<00:01,  1.00it/s]")
    running = read_record(rec.path)
    assert running.section == "none"
    detector = HangDetector(tmp_path, startup_timeout=600, save_timeout=600, explicit_timeout=3,
                            auto=AutoTimeout(5, 1, 600, 5))
    verdict = detector.check(now_ns=running.beat_ns + 4 * 10**9)
    assert verdict is not None and verdict.reason == "heartbeat_timeout", verdict
    rec.feed("100%|██████████| 10/10 [00:10<00:00,  1.00it/s]")
    done = read_record(rec.path)
    assert done.step == 10 and done.section == "exit" and done.section_ns == done.beat_ns
    rec.feed("  0%|          | 0/4 [00:00<?, ?it/s]")  # the final evaluation's bar, read before its escape
    rec.feed(" 25%|██▌       | 1/4 [00:00<00:01,  2.00it/s]")
    assert read_record(rec.path).section == "exit", "an evaluation after the last step ended the exit hold"
    detector = HangDetector(tmp_path, startup_timeout=600, save_timeout=600, explicit_timeout=3,
                            auto=AutoTimeout(5, 1, 600, 5))
    assert detector.check(now_ns=done.beat_ns + 60 * 10**9) is None
    verdict = detector.check(now_ns=done.beat_ns + 601 * 10**9)
    assert verdict is not None and verdict.reason == "save_timeout", verdict
    (tmp_path / "again").mkdir()
    again = ProgressRecorder(progress_pattern("hf", ""), tmp_path / "again", pid=os.getpid())
    for line in ("100%|██████████| 10/10 [00:10<00:00,  1.00it/s]", "  0%|          | 0/10 [00:00<?, ?it/s]",
                 " 10%|█         | 1/10 [00:01<00:09,  1.00it/s]"):  # another train() call: the same bar again
        again.feed(line)
    assert read_record(again.path).section == "none"


def test_a_step_going_back_is_not_the_step(tmp_path: Path) -> None:
    """A lower step (another loop's line, a launcher restarting the trainer inside the attempt) neither
    replaces the highest step (what rlsup status, metrics and incidents show) nor beats; steps redone
    after such a restart are signs of life until the highest is passed."""
    tracker = StepTracker(progress_pattern("verl", ""))
    feed = [tracker.feed(f"step:{s} - actor/pg_loss:0.1") for s in (5, 6, 3, 7, 7, 4, 5, 6, 7, 8)]
    assert feed == ["beat", "beat", None, "beat", None, None, "alive", "alive", "alive", "beat"]
    assert tracker.step == 8


def test_bars_that_are_not_training_are_never_steps_whatever_the_pattern(tmp_path: Path) -> None:
    """A progress_regex written for 'any tqdm bar' (the old hf preset) still never reads transformers'
    shard bars, datasets' or TRL's data bars or Lightning's evaluation bars as steps."""
    any_bar = re.compile(r"\|\s*(\d+)/\d+ \[")
    for line in ["Writing model shards: 100%|██████████| 1/1 [00:00<00:00, 443.00it/s]",
                 "Loading checkpoint shards: 100%|██████████| 2/2 [00:01<00:00,  1.20it/s]",
                 "Map: 100%|██████████| 500/500 [00:00<00:00, 9000.00 examples/s]",
                 "Map (num_proc=4): 100%|██████████| 500/500 [00:00<00:00, 9000.00 examples/s]",
                 "Filter: 100%|██████████| 32/32 [00:00<00:00, 15784.75 examples/s]",
                 "Generating train split: 100%|██████████| 400/400 [00:00<00:00, 9000.00 examples/s]",
                 "Tokenizing train dataset: 100%|██████████| 400/400 [00:00<00:00, 2000.00 examples/s]",
                 "Validation DataLoader 0: 100%|██████████| 4/4 [00:00<00:00, 1291.05it/s]\x1b[A",
                 "Sanity Checking DataLoader 0: 100%|██████████| 2/2 [00:00<00:00, 193.04it/s]"]:
        tracker = StepTracker(any_bar)
        assert tracker.feed(line) == "alive" and tracker.step == -1, line
        assert tracker.feed(line) is None  # the same bar drawn again: not even a sign of life


def test_the_evaluation_bar_is_not_the_training_bar() -> None:
    """HF's prediction_bar has the training bar's shape (no description): drawn under a running training
    bar it ends with the cursor-up escape, and read before that escape arrives it has another total; after
    training (trainer.evaluate() at position 0) its steps are below the last step."""
    tracker = StepTracker(progress_pattern("hf", ""))
    assert [tracker.feed(f" {s * 10}%|█         | {s}/10 [00:0{s}<00:09,  1.00it/s]") for s in (1, 2)] == ["beat"] * 2
    assert tracker.feed("  0%|          | 0/8 [00:00<?, ?it/s]\x1b[A") == "alive"
    assert tracker.feed(" 50%|█████     | 4/8 [00:00<00:00, 34.65it/s]") == "alive"  # its escape not read yet
    assert tracker.feed("100%|██████████| 8/8 [00:00<00:00, 34.40it/s]\x1b[A") == "alive" and tracker.step == 2
    for s in range(3, 11):
        tracker.feed(f" {s * 10}%|█         | {s}/10 [00:0{s}<00:09,  1.00it/s]")
    assert tracker.step == 10
    assert tracker.feed("  0%|          | 0/8 [00:00<?, ?it/s]") is None  # the same bar as before
    assert tracker.feed(" 50%|█████     | 4/8 [00:00<00:00, 34.65it/s]") == "alive" and tracker.step == 10


def test_a_sign_of_life_keeps_a_long_evaluation_from_being_a_hang(tmp_path: Path) -> None:
    """An evaluation longer than the heartbeat timeout is not a hang while its bar moves; a hang inside it
    still is. (What the interval around it teaches, a stall when it is long: tests/diagnosis/test_hang_detector.py.)"""
    auto = AutoTimeout(5, 1, 600, 1)
    detector = HangDetector(tmp_path, startup_timeout=600, save_timeout=600, explicit_timeout=None, auto=auto)
    rec = ProgressRecorder(progress_pattern("hf", ""), tmp_path, pid=os.getpid())
    for s in (1, 2):
        rec.feed(f" {s * 10}%|█         | {s}/10 [00:0{s}<00:09,  1.00it/s]")
        detector.check()
    assert auto.basis > 0  # learned from the interval 1 -> 2
    beat = read_record(rec.path).beat_ns
    for n in range(1, 9):  # a long evaluation: its bar moves
        rec.feed(f" {n * 12}%|█         | {n}/8 [00:0{n}<00:09,  1.00it/s]\x1b[A")
    record = read_record(rec.path)
    assert record.beat_ns == beat and record.step == 2 and record.section_ns > beat
    timeout = detector.timeout()
    assert detector.check(now_ns=record.section_ns + int(timeout * 10**9) - 10**6) is None
    assert detector.check(now_ns=record.section_ns + int(timeout * 10**9) + 10**9) is not None


def test_before_the_first_step_a_sign_of_life_restarts_the_startup_clock(tmp_path: Path) -> None:
    """Datasets' bars before training: no step yet, the record says alive (the startup rule's clock)."""
    detector = HangDetector(tmp_path, startup_timeout=10, save_timeout=600, explicit_timeout=5,
                            auto=AutoTimeout(5, 1, 600, 5))
    rec = ProgressRecorder(progress_pattern("hf", ""), tmp_path, pid=os.getpid())
    rec.feed("Map:  50%|█████     | 48/96 [00:00<00:00, 2590.11 examples/s]")
    record = read_record(rec.path)
    assert record.beat_ns == 0 and record.section_ns > 0 and detector.last_step() is None
    assert detector.check(now_ns=record.section_ns + 9 * 10**9) is None
    assert detector.check(now_ns=record.section_ns + 11 * 10**9).reason == "startup_timeout"


@pytest.mark.parametrize("name, first, last", [("lightning_fit.out", 0, 12),
                                               ("lightning_resume_mid_epoch.out", 8, 20),
                                               ("lightning_resume_epoch_end.out", 16, 20)])
def test_lightning_steps_count_batches_across_epochs(name: str, first: int, last: int, tmp_path: Path) -> None:
    """Lightning's bar counts batches within an epoch; the step is counted across epochs, so it is
    Lightning's global step: 12 steps fresh (the second epoch's total clipped to 4 by max_steps), then
    resumed from step 4 (mid-epoch) and from step 8 (an epoch's end) to 20. The epoch restored from the
    checkpoint is drawn as 'Training: n/?' (its number not printed): signs of life, then the first
    'Epoch E' bar gives the step. Validation and sanity-check bars never are steps."""
    data = (DATA / name).read_bytes()
    assert b"Validation DataLoader 0:" in data and f"finished at step {last}".encode() in data
    events = _events("lightning", data, tmp_path)
    steps = _steps(events)
    assert steps[0] == first and steps[-1] == last and steps == list(range(first, last + 1)), events
    if first:
        assert b"Training: |" in data and events[0] == "a"


def test_nanogpt_iterations_are_its_steps(tmp_path: Path) -> None:
    """nanoGPT's train.py: every 'iter N: loss' line beats, its evaluation line 'step N: train loss' does not."""
    data = (DATA / "nanogpt_train.out").read_bytes()
    assert b"step 10: train loss" in data
    assert _events("nanogpt", data, tmp_path) == [str(s) for s in range(15)]


@pytest.mark.parametrize("name, capture", [("hf", "hf_trainer.out"), ("nanogpt", "nanogpt_train.out"),
                                           ("lightning", "lightning_resume_mid_epoch.out")])
def test_the_examples_are_lines_the_trainers_printed(name: str, capture: str) -> None:
    segments = re.split(r"[\r\n]", (DATA / capture).read_bytes().decode())
    assert PRESETS[name].example in segments


