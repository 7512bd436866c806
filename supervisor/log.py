"""rlsup's one logging channel: every component's lines to stderr, one line shape, one level.

Components log through ``logging.getLogger(__name__)`` (``supervisor.*``) or a ``rlsup.*`` name
(replication, transport); :func:`configure` puts one handler on both roots, so a line such as
"step N copied to the persistent tier" reaches the operator exactly like the run loop's own lines.
The CLI calls it once (``--log-level``, default INFO), and again with ``log_format`` once the config is
loaded. Used as a library, rlsup configures nothing: the embedding program's logging decides.

The line shape (``log_format: text``, the default)::

    2026-11-25T15:53:31.123Z n2 a3 [rlsup] attempt 3 failed (exit_code: 1); restarting in 1.0s
    2026-11-25T15:53:31.125Z n2 a3 [rlsup] warning: replication to node 1 failed: refused
    2026-11-25T15:53:31.126Z n- a- [rlsup] debug (supervisor.tiers.selection): considering step 5

Why this shape: under SLURM every node's stderr lands in one output file and SLURM adds nothing to a
line, so each line says when and where itself. The time is UTC ISO-8601 with milliseconds and a ``Z``:
fixed width, so a plain text sort (``grep -F '[rlsup]' slurm-123.out | LC_ALL=C sort -s -k1,1``) is a
sort by time across nodes in any time zone; milliseconds, because a restart and the nodes' agreement
before an attempt take well under a second. It is the time the line was written, and never goes
backwards within one process (a clock stepped back repeats the last stamp), so sorting by time keeps
each node's own lines in that node's order; across nodes it is as good as their clock sync (NTP).
journald stamps lines itself and shows its own time first; the line keeps its own too, so
``journalctl -o cat`` reads like a SLURM file and one parser (:func:`parse`) serves both. Then ``n<rank>``: the node
rank (``node_rank``, SLURM_NODEID), ``n0`` on a single node (node 0 of 1, as a one-node SLURM job
numbers it), ``n-`` before it is known. Then ``a<attempt>``: rlsup's attempt number, the one its lines
say ("attempt 3 failed") and the job gets as ``RLSUP_RESTART_COUNT``, ``a-`` before the first attempt
starts. Every field is one word, always present, so the shape is one regular expression (:data:`LINE`).
The ``[rlsup]`` tag and what follows are what rlsup always printed, so a grep for ``[rlsup] attempt``
still finds its lines. A message of several lines (a traceback) repeats the stamp on each line, indented
after the tag.

``log_format: json``: one JSON object per line for log shippers (Loki, Vector, Fluent Bit), with
``time``, ``node``, ``attempt`` (null when unknown), ``level``, ``logger`` (the component) and
``message``, plus ``exc`` when an exception is attached.

Whole lines only: rlsup relays the job's output (on its stdout) by lines (:class:`supervisor.processes.job.
OutputTail`), and when its stdout and stderr are one file (SLURM's one output file, a terminal, ``2>&1``: the same
``st_dev``/``st_ino``), the relayed lines and rlsup's own go through one lock (:data:`CONSOLE`), so neither ever
lands inside a line of the other. A progress bar left open by a ``\r`` (tqdm redraws) is ended with a newline
before rlsup's line, so that line starts a line of its own, as ``tqdm.write`` does.

The job's own output (the trainer's stdout and stderr) is never reformatted, only ended where a line
must end (that newline, a last line's at the job's exit, the relay's cut of a line too long to hold).
The warm launcher's zygote, which runs in the job's interpreter and cannot import this module, writes
its few lines in the same shape (:func:`supervisor.launch.warm_pool.rlsup_line`; tests/shared/test_log_lines.py parses them).

The context (node, attempt) is process-wide on purpose, not a contextvar: rlsup's threads (replication,
tiers, the transport) all say which attempt they are in. Several simulated nodes in one process (the
benchmarks, tests) share one context, so the CLI sets the node, not the supervisor objects.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import sys
import threading
import time
import typing
from dataclasses import dataclass, replace
from typing import IO, Callable, Iterator, Literal

ROOTS = ("supervisor", "rlsup")
TAG = "[rlsup]"
PREFIX = TAG + " "
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
DEFAULT_LEVEL = "INFO"
LogFormat = Literal["text", "json"]
#: log_format's choices, from the type the formatter dispatches on.
FORMATS: tuple[str, ...] = typing.get_args(LogFormat)
DEFAULT_FORMAT: LogFormat = "text"

#: One rlsup line in the text format: time, node, attempt, tag, and the rest.
LINE = re.compile(r"^(?P<time>\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z) n(?P<node>\d+|-) a(?P<attempt>\d+|-) "
                  r"\[rlsup\] (?P<rest>.*)$")
_LEVEL = re.compile(r"^(?:(?P<level>warning|error|critical): |debug \((?P<logger>[\w.]+)\): )?(?P<message>.*)$", re.S)


@dataclass(frozen=True)
class LineContext:
    """Who is speaking: the node rank and the attempt (None: not known yet)."""

    node: int | None = None
    attempt: int | None = None


@dataclass(frozen=True)
class Line:
    """One parsed rlsup line (text format)."""

    time: str
    node: int | None
    attempt: int | None
    level: str  # debug, info, warning, error, critical
    message: str
    logger: str | None = None  # named on debug lines only


_context = LineContext()
_context_lock = threading.Lock()
_UNSET: typing.Any = object()


def set_context(*, node: int | None = _UNSET, attempt: int | None = _UNSET) -> None:
    """Set this process's node rank and/or current attempt for every line from now on (any thread)."""
    global _context
    for name, value in (("node", node), ("attempt", attempt)):
        if value is not _UNSET and value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                                          or value < 0):
            raise ValueError(f"log context {name} must be a non-negative integer or None, got {value!r}")
    with _context_lock:
        changes = {k: v for k, v in (("node", node), ("attempt", attempt)) if v is not _UNSET}
        _context = replace(_context, **changes)


def context() -> LineContext:
    """The context lines are stamped with now."""
    return _context


class _Stamp:
    """UTC time in milliseconds that never goes backwards (a stepped-back clock repeats the last stamp)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.last_ms = 0
        self.lock = threading.Lock()

    def now(self) -> str:
        with self.lock:
            self.last_ms = max(self.last_ms, int(self.clock() * 1000))
            seconds, ms = divmod(self.last_ms, 1000)
        return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{ms:03d}Z"


class LineFormatter(logging.Formatter):
    """rlsup's line shape (module docstring); ``clock`` is for tests."""

    def __init__(self, fmt: LogFormat = DEFAULT_FORMAT, clock: Callable[[], float] = time.time) -> None:
        super().__init__("%(message)s")
        if fmt not in FORMATS:
            raise ValueError(f"unknown log format {fmt!r} (one of {', '.join(FORMATS)})")
        self.fmt: LogFormat = fmt
        self._stamp = _Stamp(clock)

    def format(self, record: logging.LogRecord) -> str:
        # Stamped here, under the handler's lock, not at record.created: two threads' lines then carry
        # times in the order they were written, which is what a sort by time must keep.
        when, ctx = self._stamp.now(), _context
        if self.fmt == "json":
            return self._json(record, when, ctx)
        text = super().format(record)  # the message, plus a traceback when one is attached
        head = f"{when} n{_word(ctx.node)} a{_word(ctx.attempt)} {TAG}"
        first, *more = text.split("\n")
        if record.levelno == logging.INFO:
            level = ""
        elif record.levelno < logging.INFO:
            level = f"{record.levelname.lower()} ({record.name}): "
        else:
            level = f"{record.levelname.lower()}: "
        return "\n".join([f"{head} {level}{first}", *(f"{head}   {line}" for line in more)])

    def _json(self, record: logging.LogRecord, when: str, ctx: LineContext) -> str:
        out: dict[str, typing.Any] = {"time": when, "node": ctx.node, "attempt": ctx.attempt,
                                      "level": record.levelname.lower(), "logger": record.name,
                                      "message": record.getMessage()}
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            out["exc"] = record.exc_text
        return json.dumps(out)  # ASCII, newlines escaped: always one line


def _word(value: int | None) -> str:
    return "-" if value is None else str(value)


def parse(line: str) -> Line | None:
    """An rlsup text line's fields, or None for any other line (the job's own output)."""
    m = LINE.match(line.rstrip("\n"))
    if m is None:
        return None
    rest = _LEVEL.match(m["rest"])
    assert rest is not None  # every part of the pattern is optional
    level = rest["level"] or ("debug" if rest["logger"] else "info")
    return Line(m["time"], None if m["node"] == "-" else int(m["node"]),
                None if m["attempt"] == "-" else int(m["attempt"]), level, rest["message"], rest["logger"])


def same_file(a: IO[str], b: IO[str]) -> bool:
    """Whether two streams write to one file (one object, or fds with the same device and inode)."""
    if a is b:
        return True
    try:
        sa, sb = os.fstat(a.fileno()), os.fstat(b.fileno())
    except (OSError, ValueError, AttributeError):  # io.UnsupportedOperation is both; a closed stream: ValueError
        return False
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


class Console:
    """The one writer of rlsup's process for the job's relayed lines and, where they share a file, its own.

    Relayed text (whole lines, cut by the relay) is always written under :attr:`lock`: several relays (a warm
    launcher and its job, simulated nodes in one process) never mix inside a line. rlsup's own lines take the
    lock only when stdout and stderr are one file: with two files a stalled reader of the job's output must not
    hold rlsup's logging, and nothing can interleave anyway. Which streams are meant is read at each write
    (``sys.stdout``/``sys.stderr`` as they are then), so a redirection later (tests, a daemon) is followed."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self._open_redraw = False  # the shared file's last relayed text ended in "\r" (a bar being redrawn)
        self._newline_given = False  # rlsup ended that redraw's line: the job's own "\n" right after is not doubled

    def relay(self, text: str, stream: IO[str] | None = None) -> None:
        """Write the job's whole lines to ``stream`` (default: ``sys.stdout`` now), then flush."""
        if not text:
            return
        out = stream if stream is not None else sys.stdout
        with self.lock:
            shared = same_file(out, sys.stderr)
            if shared and self._newline_given and text.startswith("\n"):
                text = text[1:]
            self._newline_given = False
            if text:
                out.write(text)
                out.flush()
                if shared:
                    self._open_redraw = text.endswith("\r")

    @contextlib.contextmanager
    def own_line(self, stream: IO[str]) -> Iterator[None]:
        """Around one of rlsup's writes to ``stream``: under the lock, on a line of its own, when the job's
        output goes to the same file."""
        if not same_file(sys.stdout, stream):
            yield
            return
        with self.lock:
            if self._open_redraw:
                stream.write("\n")
                self._open_redraw, self._newline_given = False, True
            yield

    def after_fork(self) -> None:
        """In a forked child (supervisor.bounded_calls): a lock another thread held at the fork stays held
        there forever; the child gets a free one."""
        self.lock = threading.RLock()


#: The process's one writer (module docstring).
CONSOLE = Console()
os.register_at_fork(after_in_child=CONSOLE.after_fork)


class _Stderr(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time (the job's output goes to stdout, rlsup's here), through
    :data:`CONSOLE` when the two are one file."""

    def __init__(self) -> None:
        logging.Handler.__init__(self)

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    def emit(self, record: logging.LogRecord) -> None:
        stream = sys.stderr
        try:
            with CONSOLE.own_line(stream):
                super().emit(record)
        except (OSError, ValueError):  # a closed or broken stderr: logging never stops rlsup
            pass


_handler: logging.Handler | None = None


def configure(level: str | int = DEFAULT_LEVEL, fmt: str | None = None) -> logging.Handler:
    """Send the ``supervisor`` and ``rlsup`` loggers to stderr at ``level``, in ``fmt`` (None: as before,
    text at first); calling it again changes the level and format only (one handler, never two)."""
    global _handler
    if isinstance(level, str):
        if level.upper() not in LEVELS:
            raise ValueError(f"unknown log level {level!r} (one of {', '.join(LEVELS)})")
        level = getattr(logging, level.upper())
    if fmt is not None and fmt not in FORMATS:
        raise ValueError(f"unknown log format {fmt!r} (one of {', '.join(FORMATS)})")
    if _handler is None:
        _handler = _Stderr()
        _handler.setFormatter(LineFormatter(typing.cast(LogFormat, fmt or DEFAULT_FORMAT)))
    elif fmt is not None:
        formatter = _handler.formatter
        assert isinstance(formatter, LineFormatter)
        formatter.fmt = typing.cast(LogFormat, fmt)
    for name in ROOTS:
        logger = logging.getLogger(name)
        if _handler not in logger.handlers:
            logger.addHandler(_handler)
        logger.setLevel(level)
        logger.propagate = False  # one copy of each line, whatever the embedding program's root does
    # A library's warning (watchdog's, seen in CI) written straight to stderr cut a job's half-written line: warnings
    # go through the same handler, so they wait for the job's newline as every rlsup line does.
    logging.captureWarnings(True)
    warned = logging.getLogger("py.warnings")
    if _handler not in warned.handlers:
        warned.addHandler(_handler)
    warned.propagate = False
    return _handler


def get(name: str) -> logging.Logger:
    """A component's logger under the configured roots (``supervisor.<module>`` when given ``__name__``)."""
    return logging.getLogger(name if name.split(".")[0] in ROOTS else f"rlsup.{name}")
