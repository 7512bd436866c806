"""rlsup's line shape in-process: time, node and attempt before ``[rlsup]``; JSON lines as an option.

The two-node run that writes one combined file and orders it is tests/test_log_lines_multinode.py.
"""

from __future__ import annotations

import json
import logging
from datetime import datetime, timezone

import pytest

from supervisor import log as rlsup_log
from supervisor.config import ConfigError, load_config
from supervisor.log import LineContext, LineFormatter

T0 = datetime(2026, 11, 25, 15, 53, 31, 125000, tzinfo=timezone.utc).timestamp()  # .125: exact in binary


class Clock:
    """A settable clock (seconds)."""

    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def record(message: str, level: int = logging.INFO, name: str = "supervisor.runner", *args: object,
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
        logging.getLogger("supervisor.runner").info("attempt 1: launching job")
        assert json.loads(capsys.readouterr().err)["attempt"] == 1
        assert rlsup_log.configure("INFO") is handler  # the format stays; one handler
        logging.getLogger("rlsup.transport").info("still json")
        assert json.loads(capsys.readouterr().err)["logger"] == "rlsup.transport"
        rlsup_log.configure("INFO", "text")
        logging.getLogger("supervisor.runner").info("back to text")
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
    from supervisor.warm_pool import rlsup_line

    monkeypatch.setenv("RLSUP_NODE_RANK", "1")
    monkeypatch.setenv("RLSUP_RESTART_COUNT", "2")
    line = rlsup_log.parse(rlsup_line("2 local rank(s) started from warm ranks (pids 7, 8)"))
    assert line is not None and (line.node, line.attempt, line.level) == (1, 2, "info"), line
    assert line.message == "warm ranks: 2 local rank(s) started from warm ranks (pids 7, 8)"
    monkeypatch.delenv("RLSUP_NODE_RANK")  # a single node
    assert rlsup_log.parse(rlsup_line("x")).node == 0  # type: ignore[union-attr]
