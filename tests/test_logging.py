"""One logging channel: every component's lines reach rlsup's stderr with one prefix, at --log-level."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
from support.procs import run_rlsup

from supervisor import log as rlsup_log

JOB = """
import torch
from trainer_hooks import CheckpointManager, heartbeat
ckpt = CheckpointManager()  # RLSUP_CHECKPOINT_DIR
heartbeat(1)
ckpt.save(1, {"w": torch.zeros(4)})
ckpt.wait()
"""


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
    logging.getLogger("supervisor.runner").debug("not shown at INFO")
    err = [line.split(" ", 3)[3] for line in capsys.readouterr().err.splitlines()]  # after time, node, attempt
    assert err == ["[rlsup] step 3 copied to the persistent tier /p",
                   "[rlsup] warning: replication to node 1 failed: refused"]
    channel("debug")
    logging.getLogger("supervisor.tiers.selection").debug("considering step %d", 5)
    assert capsys.readouterr().err.split(" ", 3)[3] == "[rlsup] debug (supervisor.tiers.selection): considering step 5\n"
    with pytest.raises(ValueError, match="unknown log level"):
        channel("LOUD")


def test_persistent_tier_line_reaches_rlsup_stderr(tmp_path: Path) -> None:
    """A real run with persistent_dir: the tier's own log line is on stderr, and --log-level hides it."""
    (tmp_path / "job.py").write_text(JOB)
    args = ["run", "--persistent-dir", str(tmp_path / "persistent"), "--", sys.executable, str(tmp_path / "job.py")]
    r = run_rlsup(args, tmp_path)
    assert r.returncode == 0, r.stderr
    lines = [line for line in r.stderr.splitlines() if "persistent tier" in line]
    assert lines and all(rlsup_log.LINE.match(line) for line in lines), r.stderr
    quiet = run_rlsup(["--log-level", "WARNING", *args[:1], "--state-dir", ".q", "--checkpoint-dir", "q",
                       *args[1:]], tmp_path)
    assert quiet.returncode == 0 and "persistent tier" not in quiet.stderr and "[rlsup] attempt" not in quiet.stderr, \
        quiet.stderr
