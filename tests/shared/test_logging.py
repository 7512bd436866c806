"""One logging channel: every component's lines reach rlsup's stderr with one prefix, at --log-level."""

from __future__ import annotations

import logging

import pytest

from supervisor import log as rlsup_log


@pytest.fixture
def channel():
    saved = {name: (logging.getLogger(name).level, list(logging.getLogger(name).handlers),
                    logging.getLogger(name).propagate) for name in (*rlsup_log.ROOTS, "py.warnings")}
    yield rlsup_log.configure
    logging.captureWarnings(False)
    for name, (level, handlers, propagate) in saved.items():
        logger = logging.getLogger(name)
        logger.setLevel(level)
        logger.handlers[:] = handlers
        logger.propagate = propagate


def test_every_component_logger_reaches_stderr_once(channel, capsys: pytest.CaptureFixture) -> None:
    channel("INFO")
    channel("INFO")  # configuring twice adds no second handler
    logging.getLogger("supervisor.tiers.persistent").info("step %d copied to the persistent tier %s", 3, "/p")
    logging.getLogger("rlsup.replication").warning("replication to node %s failed: %s", 1, "refused")
    logging.getLogger("supervisor.run.loop").debug("not shown at INFO")
    err = [line.split(" ", 3)[3] for line in capsys.readouterr().err.splitlines()]  # after time, node, attempt
    assert err == ["[rlsup] step 3 copied to the persistent tier /p",
                   "[rlsup] warning: replication to node 1 failed: refused"]
    channel("debug")
    logging.getLogger("supervisor.tiers.selection").debug("considering step %d", 5)
    assert capsys.readouterr().err.split(" ", 3)[3] == "[rlsup] debug (supervisor.tiers.selection): considering step 5\n"
    with pytest.raises(ValueError, match="unknown log level"):
        channel("LOUD")


def test_a_library_warning_is_an_rlsup_line(channel, capsys: pytest.CaptureFixture) -> None:
    """Seen in CI: watchdog's RuntimeWarning, written straight to stderr, cut a job's half-written line in the file
    SLURM shares between rlsup and the job. Warnings go through rlsup's handler, one whole line each, which waits for
    the job's newline as every rlsup line does (tests/shared/test_logging_e2e.py)."""
    import warnings

    channel("INFO")
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = logging._showwarning  # type: ignore[attr-defined] # as captureWarnings installed it
        warnings.warn("Callback with id 1 already exists", RuntimeWarning, stacklevel=1)
    lines = capsys.readouterr().err.splitlines()  # the warning and its source line: each an rlsup line, whole
    assert lines and all(rlsup_log.parse(line) is not None for line in lines), lines
    assert "RuntimeWarning: Callback with id 1 already exists" in lines[0]

