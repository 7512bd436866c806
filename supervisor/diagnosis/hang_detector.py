"""Decide from the ranks' heartbeat files whether an attempt is hung, and learn the step timeout.

Rules (all on CLOCK_MONOTONIC, so wall-clock jumps never look like hangs; docs/hangs.md says why):
- no rank heartbeats within ``startup_timeout`` of launch: hung at startup;
- a rank inside a ``save``/``load`` section, or exiting after its last step (``exit``, marked by
  trainer_hooks at interpreter exit), longer than ``save_timeout``: hung there;
- a rank in its **first step** (after launch, or after a restore: communicator set-up, compilation, the
  first batch) is held to ``startup_timeout`` too, and that step never teaches the step timeout. Ranks
  report a step when it is done (``heartbeat(step)`` after it), so the first step ends at the first report
  past the step the attempt started from (the resumed step; where rlsup does not know it, the highest step
  an earlier attempt reported): a progress bar drawn at 0/N and then at the resumed step, or a heartbeat
  right after the restore, is a position, not a step. At the latest it ends at the
  :data:`FIRST_STEP_REPORTS`-th report (a start that the trainer's steps never pass is no start);
- otherwise a rank silent for longer than the heartbeat timeout: hung.
The heartbeat timeout is explicit, or learned ("auto", :class:`AutoTimeout`): a safety factor times the
longest ordinary step interval, with a floor, and a generous initial value until enough intervals were
seen. Intervals count across the attempts of a run and across rlsup restarts (``heartbeat_timeout.json``
in the state directory). A stall the job survived is not learned unless it recurs: see :class:`AutoTimeout`.
"""

from __future__ import annotations

import json
import logging
import math
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from rlsup_format.fileio import pid_alive
from rlsup_format.heartbeat_record import HeartbeatRecord, read_record
from supervisor.diagnosis.step_reports import JOB_RANK, job_level_only, speaking_records

# Sections whose silence is measured against save_timeout: a save, a restore, and the interpreter's
# exit after the last step (trainer_hooks marks it at exit).
HELD_TO_SAVE_TIMEOUT = ("save", "load", "exit")

#: An interval longer than this many times the ordinary step (the longest learned one; while learning,
#: the lower median of the intervals seen) is a stall the job survived: counted, never learned.
STALL_RATIO = 2.0
#: This many stalls in a row on one rank are no stall but the step time changing (a slower node after a
#: requeue, longer sequences): they are learned.
STALLS_IN_A_ROW = 3
#: A stall on a rank that survived a stall of about the same length before (the longer at most this many
#: times the shorter), ordinary steps between, is a recurring phase (a periodic evaluation): both are learned.
RECUR_RATIO = 1.5
#: A rank process's first step ends at the latest at its report number this (2 positions drawn before it).
FIRST_STEP_REPORTS = 3
LEARNED_VERSION = 2
#: Launcher arguments that change from one allocation to the next (head node, port, rendezvous id, this
#: node's rank): not part of the learned file's key, so a requeue onto other nodes keeps what was learned.
PLACEMENT_ARGS = ("--master-addr", "--master-port", "--rdzv-endpoint", "--rdzv-id", "--rdzv-conf", "--node-rank",
                  "--local-addr")
_SAVE_EVERY_S = 30.0  # counts alone (nothing else changed) are written at most this often

if TYPE_CHECKING:
    from supervisor.config import SupervisorConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HangSettings:
    """The hang detector's part of the config (keys of the same names; ``heartbeat_timeout`` None: auto)."""

    startup_timeout: float = 600.0
    save_timeout: float = 1800.0
    heartbeat_timeout: float | None = None
    heartbeat_timeout_initial: float = 600.0
    auto_timeout_factor: float = 5.0
    auto_timeout_floor: float = 30.0
    auto_timeout_min_intervals: int = 5

    @classmethod
    def from_config(cls, cfg: "SupervisorConfig") -> "HangSettings":
        return cls(cfg.startup_timeout, cfg.save_timeout, cfg.heartbeat_timeout, cfg.heartbeat_timeout_initial,
                   cfg.auto_timeout_factor, cfg.auto_timeout_floor, cfg.auto_timeout_min_intervals)


@dataclass
class HangVerdict:
    """Why an attempt is considered hung."""

    reason: str  # "startup_timeout" | "heartbeat_timeout" | "save_timeout"
    rank: int | None
    pid: int | None
    silent_s: float
    timeout_s: float
    step: int | None
    note: str = ""  # startup_timeout: NO_REPORT_YET or the first step; a hang of a rank that survived as long


NO_REPORT_YET = "no step reported yet"


TIMEOUT_SOURCES = ("initial", "learned", "explicit")  # TimeoutOrigin.source


@dataclass(frozen=True)
class TimeoutOrigin:
    """How the heartbeat timeout in force was reached: ``rlsup status`` (state.json) and the metrics."""

    source: str  # "initial" | "learned" | "explicit"
    intervals: int  # step intervals it was learned from (initial: seen so far, of the min_intervals needed)
    stalls: int  # intervals held as survived stalls, not learned
    text: str  # the same in words


@dataclass
class AutoTimeout:
    """The learned heartbeat timeout, shared by the attempts of a run and kept in ``path`` across rlsup restarts.

    ``factor`` x ``basis`` (the longest ordinary step interval), at least ``floor``; ``initial`` until
    ``min_intervals`` intervals were seen. What a stall the job survived teaches: nothing, once. An interval
    over :data:`STALL_RATIO` x the ordinary step is counted as a stall and not learned (a partition, a blip of
    the file system), because learning it would make every later hang wait ``factor`` x the stall. While
    learning, "ordinary" is judged against the lower median of the intervals seen, so a stall among the
    first intervals is not learned either. A stall is kept (``survived``, by rank): when the same rank
    survives one of about the same length again (:data:`RECUR_RATIO`), ordinary steps between, it is a
    recurring phase (a periodic evaluation) and both are learned. :data:`STALLS_IN_A_ROW` stalls in a row on
    one rank are the step time changing, and are learned. The learned basis never goes down within a run.
    A phase longer than the timeout in force never survives to recur (docs/hangs.md: mark it)."""

    factor: float
    floor: float
    initial: float
    min_intervals: int
    intervals_seen: int = 0  # every step interval observed (learned, held as a stall, or still learning)
    basis: float = 0.0  # the longest ordinary interval (0: still learning)
    learned: int = 0  # intervals that taught the basis
    stalls: int = 0
    survived: dict[int, list[float]] = field(default_factory=dict)  # by rank: stalls survived, not learned
    learning: list[float] = field(default_factory=list)  # the intervals seen before min_intervals
    learning_ranks: list[int] = field(default_factory=list)  # whose each of ``learning`` is
    step_reached: int | None = None  # the highest step any attempt reported (an unknown start's stand-in)
    path: Path | None = None
    command: list[str] = field(default_factory=list)
    _in_a_row: dict[int, list[float]] = field(default_factory=dict, init=False, repr=False)  # stalls by rank
    _dirty: int = field(default=0, init=False, repr=False)  # 0 clean, 1 counts changed, 2 timeout or stalls changed
    _saved_at: float = field(default=0.0, init=False, repr=False)

    @classmethod
    def from_settings(cls, s: HangSettings, path: Path | None = None,
                      command: Sequence[str] = ()) -> "AutoTimeout":
        """``path``: the learned file (:data:`rlsup_format.state_files.LEARNED_TIMEOUT`); what a previous rlsup of
        the same ``command`` learned is loaded from it."""
        auto = cls(s.auto_timeout_factor, s.auto_timeout_floor, s.heartbeat_timeout_initial,
                   s.auto_timeout_min_intervals, path=path, command=learned_key(command))
        if path is not None:
            auto._load()
        return auto

    def observe(self, interval_s: float, source: int = 0) -> None:
        """One step interval of rank ``source`` (the first step and intervals holding a section excluded)."""
        if not interval_s > 0 or not math.isfinite(interval_s):
            return
        self.intervals_seen += 1
        if self.basis == 0:
            self.learning.append(interval_s)
            self.learning_ranks.append(source)
            if len(self.learning) >= self.min_intervals:
                self._finish_learning()
            self._dirty = 2
            return
        if interval_s <= STALL_RATIO * self.basis:
            self._learn([interval_s])
            held = self._in_a_row.pop(source, [])  # the stalls before it were stalls indeed
            if held:
                self.survived.setdefault(source, []).extend(held)
            return
        self._dirty = 2
        if self._recurred(interval_s, source):
            return
        self.stalls += 1
        run = self._in_a_row.setdefault(source, [])
        run.append(interval_s)
        if len(run) >= STALLS_IN_A_ROW:  # the step itself got longer: no stall
            self.stalls -= len(run)
            self._learn(run)
            run.clear()

    def _recurred(self, interval_s: float, source: int) -> bool:
        """Learn ``interval_s`` with the stalls ``source`` survived before of about its length, if any: the
        same long phase once more on one rank is a recurring phase (an evaluation), not a stall."""
        before = self.survived.get(source, [])
        again = [s for s in before if max(s, interval_s) <= RECUR_RATIO * min(s, interval_s)]
        if not again:
            return False
        self.stalls -= len(again)
        self.survived[source] = [s for s in before if s not in again]
        self._learn([*again, interval_s])
        return True

    def reached(self, step: int | None) -> None:
        """A step an attempt reported: the next attempts' start where rlsup does not know where they resume."""
        if step is not None and (self.step_reached is None or step > self.step_reached):
            self.step_reached = step
            self._dirty = max(self._dirty, 1)

    def _learn(self, intervals: list[float]) -> None:
        self.learned += len(intervals)
        self._dirty = max(self._dirty, 2 if max(intervals) > self.basis else 1)
        self.basis = max(self.basis, *intervals)

    def _finish_learning(self) -> None:
        typical = statistics.median_low(self.learning)
        ranks = self.learning_ranks if len(self.learning_ranks) == len(self.learning) else [0] * len(self.learning)
        ordinary = [i for i in self.learning if i <= STALL_RATIO * typical]
        self.basis, self.learned = max(ordinary), len(ordinary)
        held = [(rank, i) for rank, i in zip(ranks, self.learning) if i > STALL_RATIO * typical]
        self.learning, self.learning_ranks = [], []
        for rank, i in held:  # stalls, but where the same rank's recurs among them, a recurring phase
            if not self._recurred(i, rank):
                self.stalls += 1
                self.survived.setdefault(rank, []).append(i)

    def longest_held(self) -> float:
        """The longest interval held as a stall, those not yet confirmed by an ordinary one included."""
        return max([0.0, *(i for held in (*self.survived.values(), *self._in_a_row.values()) for i in held)])

    def current(self) -> float:
        if self.basis == 0:
            return self.initial
        return max(self.floor, self.factor * self.basis)

    def origin(self, explicit: float | None = None) -> TimeoutOrigin:
        """How the timeout in force (``explicit`` when set) was reached."""
        stalls = f"; {self.stalls} survived stall(s) up to {self.longest_held():.1f}s not learned" if self.stalls \
            else ""
        if explicit is not None:
            return TimeoutOrigin("explicit", self.learned, self.stalls, f"explicit heartbeat_timeout {explicit:g}s")
        if self.basis == 0:
            return TimeoutOrigin("initial", len(self.learning), self.stalls,
                                 f"initial: {len(self.learning)} of the {self.min_intervals} step intervals needed "
                                 f"to learn it seen{stalls}")
        how = f"{self.factor:g} x the longest step interval {self.basis:.2f}s"
        if self.floor > self.factor * self.basis:
            how = f"auto_timeout_floor {self.floor:g}s (above {how})"
        return TimeoutOrigin("learned", self.learned, self.stalls,
                             f"learned from {self.learned} step intervals: {how}{stalls}")

    # ------------------------------------------------------------ kept across rlsup restarts

    def persist(self, force: bool = False) -> None:
        """Write what was learned to ``path``: at once when the timeout or a stall changed, counts alone at
        most every :data:`_SAVE_EVERY_S` (and with ``force``, at an attempt's end). A failed write is logged;
        hang detection goes on."""
        if self.path is None or not self._dirty:
            return
        now = time.monotonic()
        if self._dirty < 2 and not force and now - self._saved_at < _SAVE_EVERY_S:
            return
        survived = {str(rank): held for rank, held in self.survived.items() if held}
        for rank, run in self._in_a_row.items():  # stalls not yet confirmed by an ordinary interval: kept too
            survived.setdefault(str(rank), []).extend(run)
        data = {"version": LEARNED_VERSION, "command": self.command, "basis": self.basis, "learning": self.learning,
                "learning_ranks": self.learning_ranks, "intervals_seen": self.intervals_seen, "learned": self.learned,
                "stalls": self.stalls, "survived": survived, "step_reached": self.step_reached}
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps(data, indent=1))
            os.replace(tmp, self.path)
        except OSError as e:
            log.warning(f"heartbeat timeout: what was learned not written to {self.path}: {e}")
        self._dirty, self._saved_at = 0, now

    def _load(self) -> None:
        assert self.path is not None
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return
        except OSError as e:
            log.warning(f"heartbeat timeout: {self.path} not read ({e}); learning the step timeout anew")
            return
        try:
            data = _parse_learned(text, self.command)
        except ValueError as e:
            log.warning(f"heartbeat timeout: ignoring {self.path}: {e}; learning the step timeout anew")
            return
        self.basis, self.learning, self.learning_ranks = data["basis"], data["learning"], data["learning_ranks"]
        self.intervals_seen, self.learned = data["intervals_seen"], data["learned"]
        self.stalls, self.survived, self.step_reached = data["stalls"], data["survived"], data["step_reached"]
        if self.basis == 0 and len(self.learning) >= self.min_intervals:
            self._finish_learning()  # min_intervals lowered since
        log.info(f"heartbeat timeout: continuing from {self.path}: {self.origin().text}")


def _parse_learned(text: str, command: list[str]) -> dict[str, Any]:
    """The learned file's content, checked; ValueError naming what is wrong."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON ({e})") from None
    if not isinstance(data, dict) or data.get("version") != LEARNED_VERSION:
        raise ValueError(f"not a version {LEARNED_VERSION} learned-timeout record")

    def number(key: str) -> float:
        v = data.get(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise ValueError(f"{key!r} is {v!r}, not a number >= 0")
        return v

    out: dict[str, Any] = {"basis": number("basis")}
    for k in ("intervals_seen", "learned", "stalls"):
        out[k] = int(number(k))
    learning = data.get("learning")
    if not isinstance(learning, list) or not all(_is_interval(v) for v in learning):
        raise ValueError(f"'learning' is {learning!r}, not a list of intervals > 0")
    out["learning"] = [float(v) for v in learning]
    ranks = data.get("learning_ranks")
    if not isinstance(ranks, list) or len(ranks) != len(learning) or not all(_is_int(r) for r in ranks):
        raise ValueError(f"'learning_ranks' is {ranks!r}, not a rank for each of 'learning'")
    out["learning_ranks"] = list(ranks)
    survived = data.get("survived")
    if not isinstance(survived, dict) or not all(
            _is_int(_int_or_none(k)) and isinstance(v, list) and all(_is_interval(i) for i in v)
            for k, v in survived.items()):
        raise ValueError(f"'survived' is {survived!r}, not stall intervals > 0 by rank")
    out["survived"] = {int(k): [float(i) for i in v] for k, v in survived.items()}
    reached = data.get("step_reached")
    if reached is not None and not _is_int(reached):
        raise ValueError(f"'step_reached' is {reached!r}, not a step")
    out["step_reached"] = reached
    if data.get("command") != command:
        raise ValueError(f"learned for another command ({data.get('command')!r})")
    return out


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_interval(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def _int_or_none(text: str) -> int | None:
    try:
        return int(text)
    except ValueError:
        return None


def learned_key(command: Sequence[str]) -> list[str]:
    """The command as the learned file's key: without the launcher's :data:`PLACEMENT_ARGS` (either spelling,
    ``--arg value`` or ``--arg=value``), which a requeue onto other nodes changes. ``{resume...}``
    placeholders stay as written (rlsup keys on the command before it fills them)."""
    names = {*PLACEMENT_ARGS, *(a.replace("-", "_").replace("__", "--", 1) for a in PLACEMENT_ARGS)}
    out: list[str] = []
    skip = False
    for arg in command:
        if skip:
            skip = False
        elif arg in names:
            skip = True
        elif arg.split("=", 1)[0] not in names or "=" not in arg:
            out.append(arg)
    return out


def _section_within(rec: HeartbeatRecord, start_ns: int, end_ns: int) -> bool:
    """Whether ``rec`` shows a section begun or ended between ``start_ns`` and ``end_ns``, or one that lasted
    from before ``start_ns`` (one begun after ``end_ns``, the exit after the last step, is not inside)."""
    return start_ns < rec.section_ns <= end_ns or (rec.section != "none" and rec.section_ns <= start_ns)


@dataclass
class _FirstStep:
    """A rank process's first step in the attempt: the reports seen, and the one that ended it."""

    pid: int
    reports: int = 0  # its reports seen (two landing between polls: both, from the record's previous beat)
    seen_ns: int = 0  # the newest report seen
    ended_ns: int = 0  # the report that ended the first step (0: not yet)
    restored_ns: int = 0  # a restore (load section) ended then: the step after it is a first step again


@dataclass
class HangDetector:
    """Watches one attempt's heartbeat directory. ``start_step``: the step the attempt starts from, as far as
    rlsup knows (the resumed step, 0 for a fresh start; else the highest step an earlier attempt reported;
    None: neither, so a rank's first report ends its first step, the output's first reading does not)."""

    directory: Path
    startup_timeout: float
    save_timeout: float
    explicit_timeout: float | None
    auto: AutoTimeout
    started_ns: int = field(default_factory=time.monotonic_ns)
    records: dict[int, HeartbeatRecord] = field(default_factory=dict)
    alive: Callable[[int], bool] = field(default=lambda pid: pid_alive(pid))
    start_step: int | None = 0
    first_steps: dict[int, _FirstStep] = field(default_factory=dict)

    @classmethod
    def from_settings(cls, directory: Path, s: HangSettings, auto: AutoTimeout,
                      alive: Callable[[int], bool] | None = None, start_step: int | None = 0) -> "HangDetector":
        """One attempt's detector; ``auto`` is shared by the attempts of a run (what it learned carries over).
        ``start_step`` None (rlsup does not know where the trainer resumes: a single file, ``resume: false``):
        the highest step an earlier attempt reported stands in for it."""
        start = start_step if start_step is not None else auto.step_reached
        det = cls(directory, s.startup_timeout, s.save_timeout, s.heartbeat_timeout, auto, start_step=start)
        det.alive = alive or det.alive
        return det

    def timeout(self) -> float:
        return self.explicit_timeout if self.explicit_timeout is not None else self.auto.current()

    def origin(self) -> TimeoutOrigin:
        """How :meth:`timeout` was reached."""
        return self.auto.origin(self.explicit_timeout)

    def scan(self) -> dict[int, HeartbeatRecord]:
        """Read every rank file; feed new step intervals to the auto timeout."""
        for path in self.directory.glob("rank_*.hb"):
            rec = read_record(path)
            if rec is None:
                continue
            old = self.records.get(rec.rank)
            if old is not None and old.pid != rec.pid:
                old = None  # another process for this rank: its own first step
            first = self._first_step(rec, old)
            if rec.rank == JOB_RANK and not job_level_only(self.records.values()):
                pass  # ranks heartbeat themselves: their intervals, not the output's, teach the timeout
            elif first is not None and (interval := self._new_interval(rec, old, first)) is not None:
                self.auto.observe(interval, rec.rank)
            self.records[rec.rank] = rec
        self.auto.reached(self.last_step())
        return self.records

    def _first_step(self, rec: HeartbeatRecord, old: HeartbeatRecord | None) -> _FirstStep | None:
        """Where ``rec``'s process stands with its first step (None: it has not reported a step yet)."""
        first = self.first_steps.get(rec.rank)
        if first is not None and first.pid != rec.pid:
            first = None
        if first is None and rec.beat_ns > 0:
            first = self.first_steps[rec.rank] = _FirstStep(rec.pid)
        if first is None:
            return None
        # Two reports may land between two polls: the earlier one is the record's previous beat.
        for beat_ns, step in ((rec.prev_beat_ns, rec.prev_step), (rec.beat_ns, rec.step)):
            if beat_ns > first.seen_ns:
                first.reports, first.seen_ns = first.reports + 1, beat_ns
                if not first.ended_ns and self._ends_first_step(rec.rank, step, first.reports):
                    first.ended_ns = beat_ns
        if old is not None and old.section == "load" and rec.section != "load":
            first.restored_ns = rec.section_ns
        return first

    def _ends_first_step(self, rank: int, step: int, reports: int) -> bool:
        """Whether a rank's report number ``reports`` (of ``step``) ends its first step: it is past the start
        (before it: a bar drawn at 0/N, then at the resumed step; a heartbeat right after the restore), or the
        :data:`FIRST_STEP_REPORTS`-th. Unknown start: a rank reports a step when it is done (trainer_hooks'
        convention), so its first report; the output's first reading may be a bar drawn before any step."""
        if self.start_step is not None:
            return step > self.start_step or reports >= FIRST_STEP_REPORTS
        return rank != JOB_RANK or reports >= 2

    def in_first_step(self, rec: HeartbeatRecord) -> bool:
        """Whether ``rec``'s rank is still in its first step (held to startup_timeout, never learned)."""
        if rec.beat_ns == 0:
            return True
        first = self.first_steps.get(rec.rank)
        if first is None or first.pid != rec.pid:
            return False
        return first.restored_ns > rec.beat_ns or not first.ended_ns

    @staticmethod
    def _new_interval(rec: HeartbeatRecord, old: HeartbeatRecord | None, first: _FirstStep) -> float | None:
        """The step interval ``rec`` newly shows, if it may teach the timeout: one step (the last two reports),
        no section of a rank inside it, and not the first step."""
        if old is not None and rec.beat_ns <= old.beat_ns:
            return None
        if rec.prev_beat_ns > 0:
            start = rec.prev_beat_ns
        elif old is not None and old.beat_ns > 0:  # a writer without the previous beat's fields
            start = old.beat_ns
        else:
            return None
        if not first.ended_ns or start < first.ended_ns:  # the first step, or a position before it
            return None
        # A save or restore inside is timed apart. (The output's signs of life are other bars moving, PyKEEN's
        # batch bar on every epoch: the interval counts, and a long one is a stall.)
        if rec.rank != JOB_RANK and any(_section_within(r, start, rec.beat_ns) for r in (rec, old) if r is not None):
            return None
        return (rec.beat_ns - start) / 1e9

    def check(self, now_ns: int | None = None) -> HangVerdict | None:
        now_ns = time.monotonic_ns() if now_ns is None else now_ns
        records = self.scan()
        records = speaking_records(records)  # trainer_hooks' heartbeats take precedence
        beating = [r for r in records.values() if r.beat_ns > 0]
        if not beating:
            return self._check_startup(now_ns, records)
        timeout = self.timeout()
        for rec in sorted(records.values(), key=lambda r: r.rank):
            if rec.section in HELD_TO_SAVE_TIMEOUT:
                silent = (now_ns - rec.section_ns) / 1e9
                if silent > self.save_timeout:
                    return HangVerdict("save_timeout", rec.rank, rec.pid, silent, self.save_timeout, rec.step)
                continue
            if rec.beat_ns == 0:
                # Registered (a section ran) but never beat: covered by the startup rule.
                silent = (now_ns - max(self.started_ns, rec.section_ns)) / 1e9
                if silent > self.startup_timeout:
                    return HangVerdict("startup_timeout", rec.rank, rec.pid, silent, self.startup_timeout, None,
                                       note=NO_REPORT_YET)
                continue
            last = max(rec.beat_ns, rec.section_ns)  # a section that just ended counts as a sign of life
            silent = (now_ns - last) / 1e9
            if self.in_first_step(rec):  # set-up, compilation, first batch: the startup limit, not the step's
                if silent > self.startup_timeout and self.alive(rec.pid):
                    first = self.first_steps.get(rec.rank)
                    after = "a restore" if first is not None and first.restored_ns > rec.beat_ns else "launch"
                    return HangVerdict("startup_timeout", rec.rank, rec.pid, silent, self.startup_timeout, rec.step,
                                       note=f"first step after {after} too long (last report: step {rec.step})")
                continue
            if silent > timeout and self.alive(rec.pid):  # an exited rank is not silent: the job is ending
                return HangVerdict("heartbeat_timeout", rec.rank, rec.pid, silent, timeout, rec.step,
                                   note=self._survived_note(rec.rank, timeout))
        return None

    def _survived_note(self, rank: int, timeout: float) -> str:
        """Where ``rank`` once survived a stall longer than ``timeout``: a recurring phase (an unmarked
        evaluation) is a hang each time it comes back, and the incident says how to tell rlsup."""
        longer = [s for s in self.auto.survived.get(rank, []) if s > timeout]
        if not longer or self.explicit_timeout is not None:
            return ""
        return (f"this rank survived a {max(longer):.1f}s stall before, not learned: if that is a recurring phase "
                "(an evaluation), mark it or set auto_timeout_floor above it (docs/hangs.md)")

    def _check_startup(self, now_ns: int, records: dict[int, HeartbeatRecord]) -> HangVerdict | None:
        """Before any rank heartbeated. A rank inside a save/load section (the first restore of a large
        checkpoint) is held to save_timeout, not startup_timeout; startup restarts when a section ends."""
        in_section = [r for r in records.values() if r.section in HELD_TO_SAVE_TIMEOUT]
        for rec in sorted(in_section, key=lambda r: r.rank):
            silent = (now_ns - rec.section_ns) / 1e9
            if silent > self.save_timeout:
                return HangVerdict("save_timeout", rec.rank, rec.pid, silent, self.save_timeout, None)
        if in_section:
            return None
        since = max([self.started_ns] + [r.section_ns for r in records.values()])
        silent = (now_ns - since) / 1e9
        if silent > self.startup_timeout:
            return HangVerdict("startup_timeout", None, None, silent, self.startup_timeout, None, note=NO_REPORT_YET)
        return None

    def last_step(self) -> int | None:
        steps = [r.step for r in speaking_records(self.records).values() if r.beat_ns > 0]
        return max(steps) if steps else None
