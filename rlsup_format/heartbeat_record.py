"""The heartbeat record: one 128-byte file per rank that the rank writes and rlsup reads.

Both sides use this module; the rank-side writer (:mod:`trainer_hooks.heartbeat`) and the supervisor's
reader agree on the layout because it is written here once.

Record layout (little endian, 10 x int64 in a 128-byte file, see :data:`RECORD`):
  0 seq        seqlock counter: odd while the rank is writing
  1 magic      :data:`MAGIC`
  2 pid        writer's pid
  3 step       last step passed to :func:`heartbeat`
  4 beat_ns    monotonic time of the last heartbeat (0: none yet)
  5 section    0 none, 1 save, 2 load, 3 user, 5 exit (the interpreter is exiting)
  6 section_ns monotonic time the current section began
  7 stop       written by rlsup: non-zero asks the rank to save and exit (:func:`should_stop`)
  8 saves      save sections completed (rlsup counts saves even when one ends between two polls)
  9 save_ns    duration of the last completed save section
 10 prev_step  the step of the heartbeat before the last (-1: none), and
 11 prev_beat_ns  its time: two arrivals per poll, so rlsup sees every rank at the same step
 12 works      ``work`` sections completed (the rank's own forward/backward, timed apart from the rest)
 13 work_ns    duration of the last completed work section
Fields 10-13 (:data:`EXTRA`, at :data:`EXTRA_OFFSET`) are zero in files of older writers.
"""

from __future__ import annotations

import signal
import struct
from dataclasses import dataclass
from pathlib import Path

MAGIC = 0x524C535550484231  # "RLSUPHB1"
RECORD = struct.Struct("<10q")
RECORD_SIZE = 128
#: Byte offset of the stop flag (field 7).
STOP_OFFSET = 56
EXTRA = struct.Struct("<4q")
EXTRA_OFFSET = RECORD.size
SECTIONS = {"none": 0, "save": 1, "load": 2, "user": 3, "work": 4, "exit": 5}
SECTION_NAMES = {v: k for k, v in SECTIONS.items()}
STACKS_SIGNAL = signal.SIGUSR2
I64 = struct.Struct("<q")


def rank_file_name(rank: int) -> str:
    return f"rank_{rank:05d}.hb"


def stacks_file_name(rank: int) -> str:
    return f"rank_{rank:05d}.stacks"


def fr_request_name(rank: int) -> str:
    """The FIFO a rank's Flight Recorder thread reads requests from (trainer_hooks.flight_recorder)."""
    return f"rank_{rank:05d}.frreq"


def fr_dump_name(rank: int) -> str:
    """The file a rank writes its Flight Recorder dump (JSON) into, on request."""
    return f"rank_{rank:05d}.fr.json"


@dataclass(frozen=True)
class HeartbeatRecord:
    """One consistent read of a rank's heartbeat file (supervisor side)."""

    rank: int
    pid: int
    step: int
    beat_ns: int
    section: str
    section_ns: int
    stop: bool
    saves: int = 0
    save_ns: int = 0
    prev_step: int = -1
    prev_beat_ns: int = 0
    works: int = 0
    work_ns: int = 0


def read_record(path: Path) -> HeartbeatRecord | None:
    """Supervisor side: a consistent snapshot of one rank file (seqlock), None while not yet written."""
    rank = int(path.stem.split("_")[1])
    try:
        with open(path, "rb") as f:
            for _ in range(1000):
                f.seek(0)
                data = f.read(RECORD_SIZE)
                if len(data) < RECORD_SIZE:
                    return None
                seq, magic, pid, step, beat_ns, sec, sec_ns, stop, saves, save_ns = RECORD.unpack_from(data)
                prev_step, prev_beat_ns, works, work_ns = EXTRA.unpack_from(data, EXTRA_OFFSET)
                f.seek(0)
                if seq % 2 == 1 or I64.unpack(f.read(8))[0] != seq:
                    continue  # the rank is mid-write: read again
                if magic != MAGIC:
                    return None
                return HeartbeatRecord(rank, pid, step, beat_ns, SECTION_NAMES.get(sec, "user"), sec_ns, bool(stop),
                                       saves, save_ns, prev_step if prev_beat_ns else -1, prev_beat_ns, works, work_ns)
    except (FileNotFoundError, ValueError, struct.error):
        return None
    return None


def request_stop(path: Path) -> None:
    """Supervisor side: set the stop flag in a rank's file so its should_stop() turns true."""
    with open(path, "r+b") as f:
        f.seek(STOP_OFFSET)
        f.write(I64.pack(1))
