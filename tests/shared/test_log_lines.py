"""rlsup's line shape in-process: time, node and attempt before ``[rlsup]``; JSON lines as an option.

The two-node run that writes one combined file and orders it is tests/cluster/test_log_lines_multinode_e2e.py.
"""

from __future__ import annotations

import io
import json
import logging
import os
import sys
import threading
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import pytest

from supervisor import log as rlsup_log
from supervisor.config import ConfigError, load_config
from supervisor.log import LineContext, LineFormatter
from supervisor.processes.job import MAX_LINE, OutputTail, WholeLines

T0 = datetime(2026, 11, 25, 15, 53, 31, 125000, tzinfo=timezone.utc).timestamp()  # .125: exact in binary


class Clock:
    """A settable clock (seconds)."""

    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def record(message: str, level: int = logging.INFO, name: str = "supervisor.run.loop", *args: object,
           exc_info: object = None) -> logging.LogRecord:
    return logging.LogRecord(name, level, __file__, 1, message, args, exc_info)  # type: ignore[arg-type]


@pytest.fixture
def ctx():
    """Sets the process-wide context and puts the previous one back."""
    saved = rlsup_log.context()
    yield rlsup_log.set_context
    rlsup_log.set_context(node=saved.node, attempt=saved.attempt)


def test_text_line_carries_time_node_attempt_then_the_tag(ctx) -> None:
    fmt = LineFormatter("text", Clock())
    ctx(node=2, attempt=3)
    assert fmt.format(record("attempt 3 failed: exit 1")) == \
        "2026-11-25T15:53:31.125Z n2 a3 [rlsup] attempt 3 failed: exit 1"
    assert fmt.format(record("replication to node %s failed", logging.WARNING, "rlsup.replication", 1)) == \
        "2026-11-25T15:53:31.125Z n2 a3 [rlsup] warning: replication to node 1 failed"
    assert fmt.format(record("considering step 5", logging.DEBUG, "supervisor.tiers.selection")) == \
        "2026-11-25T15:53:31.125Z n2 a3 [rlsup] debug (supervisor.tiers.selection): considering step 5"
    assert fmt.format(record("gave up", logging.ERROR)).endswith(" n2 a3 [rlsup] error: gave up")


def test_unknown_node_and_attempt_are_a_dash(ctx) -> None:
    """Before the CLI knows the node (a config error) and before the first attempt starts."""
    ctx(node=None, attempt=None)
    assert LineFormatter("text", Clock()).format(record("hello")) == "2026-11-25T15:53:31.125Z n- a- [rlsup] hello"
    ctx(node=0)
    assert " n0 a- [rlsup] hello" in LineFormatter("text", Clock()).format(record("hello"))


def test_time_is_utc_with_milliseconds_and_never_goes_back() -> None:
    """A clock stepped back repeats the last stamp: a sort by time keeps one process's lines in order."""
    clock = Clock()
    fmt = LineFormatter("text", clock)
    stamps = []
    for now in (T0 + 0.875, T0 + 0.9375, T0 - 5, T0 + 61.5):
        clock.now = now
        stamps.append(rlsup_log.parse(fmt.format(record("x"))).time)  # type: ignore[union-attr]
    assert stamps == ["2026-11-25T15:53:32.000Z", "2026-11-25T15:53:32.062Z", "2026-11-25T15:53:32.062Z",
                      "2026-11-25T15:54:32.625Z"]
    assert stamps == sorted(stamps)  # fixed width: text order is time order


def test_parse_reads_back_every_field_and_refuses_the_jobs_lines(ctx) -> None:
    fmt = LineFormatter("text", Clock())
    ctx(node=1, attempt=0)
    debug = rlsup_log.parse(fmt.format(record("considering step 5", logging.DEBUG, "supervisor.tiers.selection")))
    assert debug == rlsup_log.Line("2026-11-25T15:53:31.125Z", 1, 0, "debug", "considering step 5",
                                   "supervisor.tiers.selection")
    warning = rlsup_log.parse(fmt.format(record("disk full", logging.WARNING)) + "\n")
    assert warning is not None and (warning.level, warning.message, warning.logger) == ("warning", "disk full", None)
    info = rlsup_log.parse(fmt.format(record("attempt 0: launching x")))
    assert info is not None and (info.level, info.message, info.node, info.attempt) == \
        ("info", "attempt 0: launching x", 1, 0)
    for job_line in ("[train_tiny] rank 1: step 3", "[rlsup] warning without a stamp", "",
                     "2026-11-25T15:53:31Z n0 a0 [rlsup] seconds only"):
        assert rlsup_log.parse(job_line) is None


def test_a_traceback_repeats_the_stamp_on_every_line(ctx) -> None:
    ctx(node=0, attempt=4)
    try:
        raise RuntimeError("store lost")
    except RuntimeError:
        import sys

        rec = record("coordination failed", logging.ERROR, exc_info=sys.exc_info())
    lines = LineFormatter("text", Clock()).format(rec).splitlines()
    parsed = [rlsup_log.parse(line) for line in lines]
    assert len(lines) > 2 and all(p is not None and (p.node, p.attempt) == (0, 4) for p in parsed), lines
    first, last = parsed[0], parsed[-1]
    assert first is not None and last is not None
    assert first.message == "coordination failed" and last.message.strip() == "RuntimeError: store lost"


def test_json_lines_one_object_each_with_every_field(ctx) -> None:
    fmt = LineFormatter("json", Clock())
    ctx(node=3, attempt=None)
    line = fmt.format(record("two\nlines, \"quoted\"", logging.WARNING, "rlsup.replication"))
    assert "\n" not in line
    assert json.loads(line) == {"time": "2026-11-25T15:53:31.125Z", "node": 3, "attempt": None, "level": "warning",
                                "logger": "rlsup.replication", "message": "two\nlines, \"quoted\""}
    try:
        raise ValueError("bad part")
    except ValueError:
        import sys

        with_exc = json.loads(fmt.format(record("fetch failed", logging.ERROR, exc_info=sys.exc_info())))
    assert with_exc["message"] == "fetch failed" and with_exc["exc"].endswith("ValueError: bad part")


def test_configure_switches_format_on_the_one_handler(capsys: pytest.CaptureFixture, ctx) -> None:
    saved = {name: (logging.getLogger(name).level, list(logging.getLogger(name).handlers),
                    logging.getLogger(name).propagate) for name in rlsup_log.ROOTS}
    try:
        handler = rlsup_log.configure("INFO", "json")
        ctx(node=0, attempt=1)
        logging.getLogger("supervisor.run.loop").info("attempt 1: launching job")
        assert json.loads(capsys.readouterr().err)["attempt"] == 1
        assert rlsup_log.configure("INFO") is handler  # the format stays; one handler
        logging.getLogger("rlsup.transport").info("still json")
        assert json.loads(capsys.readouterr().err)["logger"] == "rlsup.transport"
        rlsup_log.configure("INFO", "text")
        logging.getLogger("supervisor.run.loop").info("back to text")
        assert rlsup_log.parse(capsys.readouterr().err) is not None
        with pytest.raises(ValueError, match="unknown log format 'xml'"):
            rlsup_log.configure("INFO", "xml")
    finally:
        rlsup_log.configure("INFO", "text")
        for name, (level, handlers, propagate) in saved.items():
            logger = logging.getLogger(name)
            logger.setLevel(level)
            logger.handlers[:] = handlers
            logger.propagate = propagate


def test_context_refuses_what_is_not_a_rank_or_attempt(ctx) -> None:
    for bad in ({"node": -1}, {"attempt": "3"}, {"node": True}):
        with pytest.raises(ValueError, match="must be a non-negative integer"):
            ctx(**bad)
    ctx(node=5)
    ctx(attempt=2)  # one field at a time: the other stays
    assert rlsup_log.context() == LineContext(5, 2)


def test_log_format_key_is_validated_from_the_formatters_names() -> None:
    assert load_config(environ={}).config.log_format == "text"
    assert load_config(environ={"RLSUP_LOG_FORMAT": "json"}).config.log_format == "json"
    with pytest.raises(ConfigError, match=r"env RLSUP_LOG_FORMAT: key 'log_format': unknown format 'xml' "
                                          r"\(one of text, json\)"):
        load_config(environ={"RLSUP_LOG_FORMAT": "xml"})
    assert rlsup_log.FORMATS == ("text", "json")


def test_the_warm_launchers_lines_have_the_same_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    """The zygote cannot import supervisor.log: its own copy of the shape must still parse."""
    from supervisor.launch.warm_pool import rlsup_line

    monkeypatch.setenv("RLSUP_NODE_RANK", "1")
    monkeypatch.setenv("RLSUP_RESTART_COUNT", "2")
    line = rlsup_log.parse(rlsup_line("2 local rank(s) started from warm ranks (pids 7, 8)"))
    assert line is not None and (line.node, line.attempt, line.level) == (1, 2, "info"), line
    assert line.message == "warm ranks: 2 local rank(s) started from warm ranks (pids 7, 8)"
    monkeypatch.delenv("RLSUP_NODE_RANK")  # a single node
    assert rlsup_log.parse(rlsup_line("x")).node == 0  # type: ignore[union-attr]


# ---- whole lines in and out (issue 41): the relay passes the job's output on by lines, and rlsup's own lines
# never land inside one, one writer for both where stdout and stderr are one file ----

class Chunks:
    """A pipe read in the chunks given; ``between`` runs before each read after the first (rlsup logging while
    the job is between its two writes), and ``seen`` keeps what the relay had passed on by then."""

    def __init__(self, chunks: list[str], echo: "Writes", between: "Callable[[], None] | None" = None) -> None:
        self.chunks, self.echo, self.between = [c.encode() for c in chunks], echo, between
        self.seen: list[list[str]] = []
        self.reads = 0

    def read1(self, _size: int) -> bytes:
        if self.reads and self.between is not None:
            self.between()
        self.reads += 1
        self.seen.append(list(self.echo.writes))
        return self.chunks.pop(0) if self.chunks else b""


class Writes(io.StringIO):
    """A stream that remembers each write."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[str] = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        return super().write(text)


def relay(chunks: list[str], tmp_path: Path, echo: "Writes | None" = None,
          between: "Callable[[], None] | None" = None) -> tuple[OutputTail, Chunks]:
    echo = echo if echo is not None else Writes()
    tail = OutputTail(5, tmp_path / "out.log", echo=echo)
    stream = Chunks(chunks, echo, between)
    tail.start(stream)  # type: ignore[arg-type]
    tail.join(10)
    return tail, stream


def test_a_line_written_in_two_writes_is_passed_on_whole_once_it_ends(tmp_path: Path) -> None:
    """print under PYTHONUNBUFFERED=1: the text, then the newline. Nothing of it is passed on before its end,
    and a line that is complete is passed on at once (before the next read)."""
    echo = Writes()
    _, stream = relay(["saved 5", "\n", "step 6\nstep", " 7\n"], tmp_path, echo)
    assert echo.writes == ["saved 5\n", "step 6\n", "step 7\n"]
    assert stream.seen == [[], [], ["saved 5\n"], ["saved 5\n", "step 6\n"], echo.writes]
    assert (tmp_path / "out.log").read_text() == "saved 5\nstep 6\nstep 7\n"  # the job's log: as written


def test_a_partial_line_at_the_jobs_exit_is_ended(tmp_path: Path) -> None:
    echo = Writes()
    tail, _ = relay(["first\nlast words"], tmp_path, echo)
    assert echo.writes == ["first\n", "last words\n"] and tail.tail() == ["first", "last words"]
    assert (tmp_path / "out.log").read_text() == "first\nlast words"  # the job's own log keeps its bytes


def test_progress_bar_redraws_are_passed_on_at_each_carriage_return(tmp_path: Path) -> None:
    """tqdm writes ``\\r`` then the bar: each redraw goes out when the next one starts, the last with the
    bar's newline; what is passed on is byte for byte what the job wrote."""
    echo = Writes()
    bars = ["\r 10%|#         | 1/10", "\r 20%|##        | 2/10", "\r100%|##########| 10/10", "\n"]
    seen: list[str] = []
    tail = OutputTail(5, tmp_path / "out.log", echo=echo, on_segment=seen.append)
    tail.start(Chunks(bars, echo))  # type: ignore[arg-type]
    tail.join(10)
    assert echo.writes == ["\r", " 10%|#         | 1/10\r", " 20%|##        | 2/10\r", "100%|##########| 10/10\n"]
    assert "".join(echo.writes) == "".join(bars)
    assert tail.tail() == ["100%|##########| 10/10"]
    # progress parsing still sees each redraw as soon as it is read, before its end (supervisor.diagnosis.step_reports)
    assert seen[0] == " 10%|#         | 1/10" and "100%|##########| 10/10" in seen


def test_a_line_without_end_is_passed_on_in_pieces_and_memory_stays_bounded(tmp_path: Path) -> None:
    cutter = WholeLines()
    out = [cutter.feed("x" * 10_000) for _ in range(20)]  # 200,000 characters, no newline
    assert len(cutter.held) == 200_000 - 3 * MAX_LINE < MAX_LINE
    pieces = "".join(out).split("\n")
    assert pieces[-1] == "" and [len(p) for p in pieces[:-1]] == [MAX_LINE] * 3
    assert cutter.feed("y\n") == "x" * (200_000 - 3 * MAX_LINE) + "y\n" and cutter.held == ""
    echo = Writes()
    tail, _ = relay(["z" * 65536] * 3, tmp_path, echo)  # through the relay: the same pieces
    assert [len(w) for w in echo.writes] == [MAX_LINE + 1] * 3 and all(w.endswith("\n") for w in echo.writes)
    with pytest.raises(ValueError, match="line limit must be at least 1 character, got 0"):
        WholeLines(0)


def test_the_cutter_holds_only_what_has_not_ended() -> None:
    cutter = WholeLines(limit=8)
    assert (cutter.feed("a\nb"), cutter.held) == ("a\n", "b")
    assert (cutter.feed("c\r"), cutter.held) == ("bc\r", "")
    assert (cutter.feed("\nd\r\ne"), cutter.held) == ("\nd\r\n", "e")
    assert (cutter.feed("123456789"), cutter.held) == ("e1234567\n", "89")
    assert (cutter.end(), cutter.held, cutter.end()) == ("89\n", "", "")


def shared_console(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shared: bool = True) -> Path:
    """sys.stdout and sys.stderr opened on one file (as SLURM gives them), or on two; rlsup's handler on stderr."""
    out = tmp_path / "slurm-1.out"
    stdout = open(out, "a", encoding="utf-8")
    stderr = open(out if shared else tmp_path / "err", "a", encoding="utf-8")
    monkeypatch.setattr(sys, "stdout", stdout)
    monkeypatch.setattr(sys, "stderr", stderr)
    return out


@pytest.fixture
def channel():
    saved = {name: (logging.getLogger(name).level, list(logging.getLogger(name).handlers),
                    logging.getLogger(name).propagate) for name in rlsup_log.ROOTS}
    rlsup_log.configure("INFO", "text")
    yield logging.getLogger("supervisor.tiers.memory_tier")
    for name, (level, handlers, propagate) in saved.items():
        logger = logging.getLogger(name)
        logger.setLevel(level)
        logger.handlers[:] = handlers
        logger.propagate = propagate


def test_rlsup_logging_between_the_jobs_two_writes_never_cuts_its_line(tmp_path: Path, monkeypatch, channel) -> None:
    """The issue's line: ``saved 31`` then rlsup's ``memory tier: ...`` then the newline, in one file."""
    out = shared_console(tmp_path, monkeypatch)
    tail = OutputTail(5, tmp_path / "out.log")  # echo: sys.stdout, the shared file
    tail.start(Chunks(["saved 31", "\n", "next\n"], Writes(),  # type: ignore[arg-type]
                      between=lambda: channel.info("memory tier: step 31 drained")))
    tail.join(10)
    sys.stdout.flush()
    sys.stderr.flush()
    lines = out.read_bytes().decode().split("\n")
    said = "[rlsup] memory tier: step 31 drained"  # before each read after the first
    assert [said if (p := rlsup_log.parse(line)) and p.message == said[8:] else line for line in lines] == \
        [said, "saved 31", said, "next", said, ""], lines


def test_rlsups_line_after_an_open_redraw_starts_a_line_of_its_own(tmp_path: Path, monkeypatch, channel) -> None:
    """A bar left at ``\\r``: rlsup ends its line first (as tqdm.write does), and the job's own newline right
    after is not doubled; with stdout and stderr in two files nothing is added to either."""
    out = shared_console(tmp_path, monkeypatch)
    rlsup_log.CONSOLE.relay("\r 50%|#####     | 5/10\r")
    channel.info("memory tier: step 5 drained")
    rlsup_log.CONSOLE.relay("\ndone\n")
    sys.stdout.flush()
    lines = out.read_bytes().decode().split("\n")
    assert lines[0] == "\r 50%|#####     | 5/10\r" and rlsup_log.parse(lines[1]) is not None
    assert lines[2:] == ["done", ""], lines
    (tmp_path / "apart").mkdir()
    apart = shared_console(tmp_path / "apart", monkeypatch, shared=False)
    rlsup_log.CONSOLE.relay("\r 60%|######    | 6/10\r")
    channel.info("memory tier: step 6 drained")
    rlsup_log.CONSOLE.relay("\n")
    sys.stdout.flush()
    sys.stderr.flush()
    assert apart.read_bytes().decode() == "\r 60%|######    | 6/10\r\n"
    assert rlsup_log.parse((tmp_path / "apart" / "err").read_text()) is not None


def test_same_file_compares_device_and_inode(tmp_path: Path) -> None:
    with open(tmp_path / "a", "w") as a, open(tmp_path / "a", "a") as a2, open(tmp_path / "b", "w") as b:
        assert rlsup_log.same_file(a, a2) and not rlsup_log.same_file(a, b)
    s = io.StringIO()
    assert rlsup_log.same_file(s, s) and not rlsup_log.same_file(s, io.StringIO())  # no fd: only the same object


def test_a_forked_child_does_not_inherit_the_writer_held() -> None:
    """A call forked while the relay writes (supervisor.bounded_calls) can still write its own lines."""
    held, release = threading.Event(), threading.Event()

    def relay_writing() -> None:
        with rlsup_log.CONSOLE.lock:
            held.set()
            release.wait(30)

    writer = threading.Thread(target=relay_writing)
    writer.start()
    try:
        assert held.wait(10)
        pid = os.fork()
        if pid == 0:
            os._exit(0 if rlsup_log.CONSOLE.lock.acquire(timeout=10) else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        release.set()
        writer.join(10)
