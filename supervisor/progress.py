"""Progress read from a trainer's own output: a heartbeat for trainers that cannot be edited.

verl, AReaL and Megatron-Bridge never call ``trainer_hooks``, but every one of them prints its step
on every logged iteration. With ``progress`` (a preset) or ``progress_regex``, each output line
that matches counts as a heartbeat of the whole job, the step taken from the first group. The
heartbeat is written as a job-level record (rank :data:`JOB_RANK`, the job's root pid) into the
attempt's heartbeat directory, in the same format the ranks use, so everything that reads heartbeats
works unchanged: the learned timeout, hang detection with stacks (py-spy: nothing is needed in the
trainer), the no-progress guard, ``rlsup_last_step``, incidents and ``rlsup status``. Where ranks
heartbeat through ``trainer_hooks`` too, theirs take precedence (:func:`speaking_records`).

Lines are matched as the output arrives, split at ``\\n`` and at ``\\r`` (a tqdm bar redraws itself
with ``\\r`` and ends its line only when done).
"""

from __future__ import annotations

import os
import re
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

from rlsup_format.heartbeat_record import MAGIC, RECORD, RECORD_SIZE, SECTIONS, HeartbeatRecord, rank_file_name

JOB_RANK = -1  # the job-level record's rank: not a rank of the job, the job as a whole


@dataclass(frozen=True)
class Preset:
    """A trainer's own progress line, as its source prints it."""

    regex: str
    source: str  # repository, file and function it comes from
    example: str  # a line as the trainer prints it (tests feed it)
    #: A line meaning the run is done, for trainers whose launcher exits non-zero even then: an exit
    #: after it ends the job as succeeded (not restarted). "": the exit code alone decides.
    done: str = ""


PRESETS: dict[str, Preset] = {
    "verl": Preset(
        r"step:(\d+) - ",  # anywhere in the line: ranks sharing a pipe interleave their writes
        "volcengine/verl 0.9.1, verl/utils/logger/aggregate_logger.py: concat_dict_to_str / LocalLogger.log "
        "(Tracking's console backend); under Ray the driver prefixes actor lines with '(TaskRunner pid=N)'",
        "(TaskRunner pid=4242) step:12 - actor/entropy:0.61 - actor/pg_loss:-0.003 - timing_s/step:41.2"),
    "areal": Preset(
        r"Train step (\d+)/\d+ done\.",
        "inclusionAI/AReaL @7ab3d64, areal/utils/stats_logger.py: StatsLogger.commit (logger 'StatsLogger'; "
        "the step printed is global_step + 1)",
        "20251124-08:41:03.123 StatsLogger INFO: Epoch 1/3 Step 12/200 Train step 12/600 done.",
        # the last step (N of N): AReaL's launchers then raise JobException(COMPLETED) and exit 1
        # (areal/infra/launcher/local.py, v1.0.4: a completed job cannot be told from a failed one)
        done=r"Train step (\d+)/\1 done\."),
    "megatron-bridge": Preset(
        r"\biteration\s+(\d+)/\s*\d+ \|",
        "NVIDIA-NeMo/Megatron-Bridge, src/megatron/bridge/training/utils/train_utils.py: training_log "
        "(printed every logger.log_interval iterations by the last rank)",
        " [2026-11-24 08:41:03] iteration       12/     100 | consumed samples:          768 | "
        "elapsed time per iteration (ms): 412.3 | learning rate: 1.000000E-04 |"),
    "hf": Preset(
        r"\|\s*(\d+)/\d+ \[",
        "huggingface/transformers 5.23, src/transformers/trainer_callback.py: ProgressCallback "
        "(a tqdm bar over max_steps, updated on every step)",
        " 12%|█▏        | 12/100 [00:03<00:22,  3.95it/s]"),
}


def progress_pattern(preset: str, regex: str) -> re.Pattern[str] | None:
    """The pattern in force (``regex`` wins over ``preset``); ValueError naming what is wrong."""
    if not regex and not preset:
        return None
    if not regex:
        if preset not in PRESETS:
            raise ValueError(f"unknown preset {preset!r} (one of {', '.join(PRESETS)})")
        regex = PRESETS[preset].regex
    try:
        pattern = re.compile(regex)
    except re.error as e:
        raise ValueError(f"not a regular expression: {e}") from None
    if pattern.groups < 1:
        raise ValueError("needs a group around the step number, e.g. 'step (\\d+)'")
    return pattern


class ProgressRecorder:
    """Matches output segments and writes the job-level heartbeat record on each match."""

    def __init__(self, pattern: re.Pattern[str], hb_dir: Path, pid: int, done: re.Pattern[str] | None = None,
                 output: Any = None) -> None:
        self.pattern = pattern
        self.done = done
        self.output = output  # its ``finished`` is set to the line that says the run is done
        self.path = hb_dir / rank_file_name(JOB_RANK)
        self.pid = pid
        self.seq = 0
        self.prev: tuple[int, int] = (-1, 0)
        self.last: tuple[int, int] = (-1, 0)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        os.ftruncate(self.fd, RECORD_SIZE)

    def feed(self, segment: str) -> None:
        step = None
        for m in self.pattern.finditer(segment):
            try:
                step = int(m.group(1))
            except (TypeError, ValueError):
                continue
        if step is not None:
            self.beat(step)
        if self.done is not None and self.output is not None and self.done.search(segment):
            self.output.finished = segment.strip()[:500]

    def beat(self, step: int) -> None:
        self.prev, self.last = self.last, (step, time.monotonic_ns())
        self.seq += 2
        data = bytearray(RECORD_SIZE)
        RECORD.pack_into(data, 0, self.seq, MAGIC, self.pid, step, self.last[1], SECTIONS["none"], 0, 0, 0, 0)
        struct.pack_into("<4q", data, RECORD.size, self.prev[0], self.prev[1], 0, 0)
        os.pwrite(self.fd, bytes(data), 0)  # one write: the reader's seqlock check never sees half of it

    def close(self) -> None:
        try:
            os.close(self.fd)
        except OSError:
            pass


def job_level_only(records: Iterable[HeartbeatRecord]) -> bool:
    """Whether the job-level record is the only source of heartbeats (no rank has beaten itself)."""
    return not any(r.rank != JOB_RANK and r.beat_ns > 0 for r in records)


def speaking_records(records: Mapping[int, HeartbeatRecord]) -> dict[int, HeartbeatRecord]:
    """The records that speak for the job: the ranks' own once any rank beats, else all (the output's)."""
    if job_level_only(records.values()):
        return dict(records)
    return {r: rec for r, rec in records.items() if r != JOB_RANK}


def registered_ranks(records: Mapping[int, HeartbeatRecord]) -> dict[int, HeartbeatRecord]:
    """The ranks that registered (a record, beaten or not: trainer_hooks installed its handlers before
    creating it), else the output's record alone: who a preemption signal goes to."""
    return {r: rec for r, rec in records.items() if r != JOB_RANK} or dict(records)


def rank_label(rank: int) -> str:
    """A metric's ``local_rank`` value: the job-level record is ``job``, not a rank number."""
    return "job" if rank == JOB_RANK else str(rank)


def attach(preset: str, regex: str, job: Any, hb_dir: Path) -> ProgressRecorder | None:
    """Start matching ``job``'s output (a :class:`supervisor.process_tree.JobProcess`) when
    ``progress``/``progress_regex`` is set; else do nothing."""
    pattern = progress_pattern(preset, regex)
    if pattern is None:
        return None
    done = re.compile(PRESETS[preset].done) if not regex and PRESETS[preset].done else None
    recorder = ProgressRecorder(pattern, hb_dir, job.pid, done, job.output)
    job.output.on_segment = recorder.feed
    return recorder
