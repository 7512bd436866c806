"""Attempt 0 leaves a daemonised grandchild behind and fails; attempt 1 succeeds only if it is gone."""
import os
import subprocess
import sys
import time
from pathlib import Path

pidfile = Path(sys.argv[1])
attempt = int(os.environ["RLSUP_RESTART_COUNT"])
if attempt == 0:
    # The grandchild starts its own session: only tree tracking, not the process group, can find it.
    child = subprocess.Popen([sys.executable, "-c",
                              "import os,time,subprocess,sys;"
                              "p=subprocess.Popen([sys.executable,'-c','import time; time.sleep(600)'],start_new_session=True);"
                              f"open({str(pidfile)!r},'w').write(str(p.pid)); time.sleep(600)"])
    while not pidfile.exists() or not pidfile.read_text():
        time.sleep(0.02)
    sys.exit(1)
pid = int(pidfile.read_text())
try:
    os.kill(pid, 0)
    with open(f"/proc/{pid}/stat") as f:
        alive = f.read().split(")")[-1].split()[0] != "Z"
except (ProcessLookupError, FileNotFoundError):
    alive = False
print(f"grandchild {pid} alive={alive}", flush=True)
sys.exit(9 if alive else 0)
