"""Stand-ins for SLURM's ``srun`` and ``scontrol`` and for ``rlsup`` itself, so that the real batch script
(deploy/slurm/rlsup.sbatch) runs under real bash in a test without a cluster: what the script asks SLURM for
and the command it builds on each node are recorded, and each node's "rlsup" ends as the test says.

SLURM is not what such a test tests (tests/deploy/test_deploy_slurm*_e2e.py run the script under a real one); the
script is. Environment of the fakes:
  FAKE_SLURM_LOG   directory for the records: srun.jsonl (one line per srun), scontrol.log, <node>.json
  FAKE_LOST        nodes whose task never starts (the node is gone: no pid, no exit code written)
  FAKE_ENDS        "node=how,...": how a node's rlsup ends: an exit code, ``kill`` (SIGKILL to itself)
                   or ``usr1`` (waits for SIGUSR1, then exits 75); default 0
  FAKE_NODEADDR    NodeAddr of every node (default 10.0.0.<index + 1>)
  FAKE_JOB_NODES   the job's NodeList now (``scontrol show job``; default SLURM_JOB_NODELIST)
Node lists are comma-separated names (no bracket ranges).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

SRUN = '''\
import json, os, signal, subprocess, sys
argv = sys.argv[1:]
cut = argv.index("bash")
opts, cmd = argv[:cut], argv[cut:]
log = os.environ["FAKE_SLURM_LOG"]
with open(os.path.join(log, "srun.jsonl"), "a") as f:
    f.write(json.dumps({"options": opts, "command": cmd}) + "\\n")
value = lambda name: next((o.split("=", 1)[1] for o in opts if o.startswith(name + "=")), None)
nodes = (value("--nodelist") or os.environ["SLURM_JOB_NODELIST"]).split(",")
if value("--nodes") is not None and int(value("--nodes")) != len(nodes):
    sys.exit(f"srun: error: --nodes={value('--nodes')} but {len(nodes)} node(s) in {nodes}")
lost = set(filter(None, os.environ.get("FAKE_LOST", "").split(",")))
procs = []
for i, node in enumerate(nodes):
    if node not in lost:
        env = dict(os.environ, SLURM_NODEID=str(i), SLURM_PROCID=str(i), SLURMD_NODENAME=node)
        procs.append(subprocess.Popen(cmd, env=env))
codes = [p.wait() for p in procs]
sys.exit(max([128 - c if c < 0 else c for c in codes], default=0))
'''

SCONTROL = '''\
import os, sys
args = sys.argv[1:]
with open(os.path.join(os.environ["FAKE_SLURM_LOG"], "scontrol.log"), "a") as f:
    f.write(" ".join(args) + "\\n")
if args[:2] == ["show", "hostnames"]:
    print("\\n".join(args[2].split(",")))
elif args[:2] == ["show", "node"]:
    index = os.environ["SLURM_JOB_NODELIST"].split(",").index(args[2])
    addr = os.environ.get("FAKE_NODEADDR") or f"10.0.0.{index + 1}"
    print(f"NodeName={args[2]} Arch=x86_64 CoresPerSocket=1\\n   NodeAddr={addr} NodeHostName={args[2]} Version=22.05")
elif args[:2] == ["show", "job"]:
    nodes = os.environ.get("FAKE_JOB_NODES") or os.environ["SLURM_JOB_NODELIST"]
    print(f"JobId={args[2]} JobName=rlsup-train\\n   ReqNodeList=(null) ExcNodeList=(null)\\n"
          f"   NodeList={nodes}\\n   BatchHost={nodes.split(',')[0]}")
'''

RLSUP = '''\
import json, os, signal, sys, time
node = os.environ["SLURMD_NODENAME"]
log = os.environ["FAKE_SLURM_LOG"]
keys = ("RLSUP_PEERS", "RLSUP_SPARES", "RLSUP_MIN_NODES", "RLSUP_REPLICA_DIR", "MASTER_ADDR", "MASTER_PORT",
        "SLURM_NODEID")
with open(os.path.join(log, node + ".json"), "w") as f:
    json.dump({"argv": sys.argv[1:], "env": {k: os.environ.get(k) for k in keys}, "pid": os.getpid()}, f)
ends = dict(e.split("=") for e in filter(None, os.environ.get("FAKE_ENDS", "").split(",")))
how = ends.get(node, "0")
if how == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
if how == "usr1":
    asked = []
    signal.signal(signal.SIGUSR1, lambda *_: asked.append(1))
    open(os.path.join(log, node + ".ready"), "w").close()
    deadline = time.monotonic() + 30
    while not asked and time.monotonic() < deadline:
        time.sleep(0.02)
    sys.exit(75 if asked else 99)
sys.exit(int(how))
'''


@dataclass(frozen=True)
class FakeSlurm:
    """The fakes installed in ``bin`` and their records in ``log``."""

    bin: Path
    log: Path

    @property
    def rlsup(self) -> str:
        return str(self.bin / "rlsup")

    def sruns(self) -> list[dict]:
        path = self.log / "srun.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def node(self, name: str) -> dict:
        """What node ``name``'s rlsup was started with: ``argv``, ``env`` (a few keys), ``pid``."""
        return json.loads((self.log / f"{name}.json").read_text())

    def scontrol_calls(self) -> list[str]:
        path = self.log / "scontrol.log"
        return path.read_text().splitlines() if path.exists() else []


def install(root: Path) -> FakeSlurm:
    """Write ``srun``, ``scontrol`` and ``rlsup`` (Python scripts of this interpreter) into ``root/bin``."""
    fake = FakeSlurm(root / "bin", root / "log")
    fake.bin.mkdir(parents=True)
    fake.log.mkdir()
    for name, source in (("srun", SRUN), ("scontrol", SCONTROL), ("rlsup", RLSUP)):
        path = fake.bin / name
        path.write_text(f"#!{sys.executable} -IS\n{source}")  # no site: a quick start
        path.chmod(0o755)
    return fake
