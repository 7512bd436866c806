"""rlsup's lines in one file from two nodes, as SLURM writes them, read back and ordered by time.

Two node supervisors on 127.0.0.1 (each in its own directory) append their output to ONE file, as
``#SBATCH --output`` does; node 1's rank crashes on the first attempt, so both nodes restart once.
Read back, every rlsup line carries time, node and attempt; a sort by time keeps each node's own order;
and what the code orders across nodes comes out in that order: node 0 hosts the coordination store
before node 1 launches anything, and every node says its attempt failed before any node launches the
next one (a node joins the next round only after it logged the failure, and no node launches a round
before every node joined it). Also: ``log_format: json`` gives one JSON object per rlsup line.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from support.cluster import Cluster
from support.procs import run_rlsup

from supervisor import log as rlsup_log

TRAIN_ARGS = ["--steps", "12", "--checkpoint-every", "3", "--step-time", "0.1", "--keep-last", "100",
              "--crash-at-step", "7"]  # rank 1 (node 1) dies on attempt 0


class OneOutputFile(Cluster):
    """Both nodes' stdout and stderr appended to ``slurm-1.out`` beside their directories."""

    def __init__(self, root: Path) -> None:
        super().__init__(root, nodes=2, train_args=TRAIN_ARGS, log_name="../slurm-1.out")
        self.out_name = "final.pt"  # in each node's directory (not named after the shared output file)

    @property
    def output(self) -> Path:
        return self.root / "slurm-1.out"


def _launches(lines: list[rlsup_log.Line], node: int | None = None) -> list[rlsup_log.Line]:
    return [ln for ln in lines if re.match(r"attempt \d+: launching ", ln.message) and node in (None, ln.node)]


def test_two_nodes_one_file_ordered_by_time(tmp_path: Path) -> None:
    cluster = OneOutputFile(tmp_path)
    try:
        for node in range(2):
            cluster.start(node)
        codes = cluster.wait_all(timeout=300)
    finally:
        cluster.kill_all()
    text = cluster.output.read_text(errors="replace")
    assert codes == {0: 0, 1: 0}, text[-6000:]

    # Every rlsup line has the shape; the job's own lines (the trainer's) are left as they were.
    raw = [line for line in text.splitlines() if "[rlsup]" in line]
    lines = [rlsup_log.parse(line) for line in raw]
    assert raw and all(lines), [r for r, p in zip(raw, lines) if p is None]
    parsed: list[rlsup_log.Line] = [p for p in lines if p is not None]
    assert any(line.startswith("[train_tiny] ") for line in text.splitlines()), text[-3000:]
    assert {p.node for p in parsed} == {0, 1}, text[-3000:]

    # Sorted by time, each node's lines keep that node's own order (the file's, as it wrote them); the
    # README's `grep -F '[rlsup]' slurm-123.out | LC_ALL=C sort -s -k1,1` sorts the same way.
    by_time = sorted(parsed, key=lambda p: p.time)
    for node in (0, 1):
        assert [p for p in by_time if p.node == node] == [p for p in parsed if p.node == node], node
    sort = subprocess.run(["sort", "-s", "-k1,1"], input="\n".join(raw) + "\n", capture_output=True, text=True,
                          env={**os.environ, "LC_ALL": "C"}, check=True)
    assert [rlsup_log.parse(line) for line in sort.stdout.splitlines()] == by_time

    # The attempt field is the attempt the line speaks of; none before the first one.
    for p in parsed:
        said = re.match(r"attempt (\d+)(?::| failed)", p.message)
        if said:
            assert p.attempt == int(said.group(1)), p
        if re.match(r"node \d of 2, job ", p.message):
            assert p.attempt is None and p.message.startswith(f"node {p.node} of 2"), p
    assert {p.attempt for p in _launches(parsed)} == {0, 1}, [p.message for p in _launches(parsed)]

    # Across nodes, what the code orders: node 0 hosts the store before node 1 launches ...
    (store,) = [p for p in parsed if p.node == 0 and "coordination store" in p.message and "(hosted here)" in p.message]
    assert store.time <= _launches(parsed, node=1)[0].time, (store, _launches(parsed, node=1)[0])
    # ... and every node says its attempt failed before any node launches a later one.
    failed = [p for p in parsed if re.match(r"attempt \d+ failed ", p.message)]
    assert {p.node for p in failed} == {0, 1}, [p.message for p in failed]
    for f in failed:
        assert f.attempt is not None, f
        later = [p for p in _launches(parsed) if p.attempt is not None and p.attempt > f.attempt]
        assert later and all(f.time <= p.time for p in later), (f, later)


JOB = """import os, sys
print('job line', file=sys.stderr)
sys.exit(3 if os.environ['RLSUP_RESTART_COUNT'] == '0' else 0)  # fails once
"""


def test_log_format_json_gives_one_object_per_line(tmp_path: Path) -> None:
    """``log_format: json`` in the config file: every rlsup line parses; the job's output stays as it was."""
    (tmp_path / "job.py").write_text(JOB)
    (tmp_path / "rlsup.yaml").write_text("log_format: json\nbackoff_initial: 0\n")
    r = run_rlsup(["run", "--config", "rlsup.yaml", "--", sys.executable, "job.py"], tmp_path)
    assert r.returncode == 0, r.stderr
    objects = [json.loads(line) for line in r.stderr.splitlines()]  # rlsup's own stream: nothing else
    fields = {"time", "node", "attempt", "level", "logger", "message"}
    assert objects and all(set(o) == fields for o in objects), objects
    assert all(rlsup_log.LINE.match(f"{o['time']} n0 a0 [rlsup] x") and o["node"] == 0 for o in objects), objects
    launches = [o for o in objects if o["message"].startswith("attempt ") and ": launching " in o["message"]]
    assert [(o["attempt"], o["message"].split(":")[0]) for o in launches] == [(0, "attempt 0"), (1, "attempt 1")]
    assert any(o["level"] == "info" and o["logger"] == "supervisor.run.loop" and "failed" in o["message"]
               for o in objects), objects
    assert r.stdout.splitlines().count("job line") == 2, r.stdout  # the job's own lines, as written
