"""One logging channel: every component's lines reach rlsup's stderr with one prefix, at --log-level."""

from __future__ import annotations

import logging

import pytest

from supervisor import log as rlsup_log


@pytest.fixture
def channel():
    saved = {name: (logging.getLogger(name).level, list(logging.getLogger(name).handlers),
                    logging.getLogger(name).propagate) for name in rlsup_log.ROOTS}
    yield rlsup_log.configure
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


