"""One ``rlsup run`` of an unmodified trainer, watched from outside: its attempts, its training processes, its
output and records (the third-party trainer tests: nanoGPT, TRL, run_clm, PyKEEN, the README's lines)."""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import psutil

from support.env import clean_env
from support.incidents import incidents
from support.procs import rlsup_cmd
from support.waits import wait_for

# Fast restarts for a test; everything else is the README's line.
FAST = ["--backoff-initial", "0.05", "--backoff-max", "0.2", "--kill-grace", "2", "--max-restarts", "12",
        "--poll-interval", "0.1"]


@dataclass
class Supervised:
    """One ``rlsup run`` in ``cwd`` (output to a file: a pipe nobody reads would block rlsup)."""

    cwd: Path
    proc: subprocess.Popen
    out_path: Path
    kills: list[dict] = field(default_factory=list)

    @classmethod
    def start(cls, cwd: Path, rlsup_args: list[str], launch: list[str], env: dict[str, str]) -> "Supervised":
        out_path = cwd / "rlsup.out"
        with open(out_path, "w") as out:
            proc = subprocess.Popen(rlsup_cmd("run", *rlsup_args, "--", *launch), cwd=cwd, env=env, stdout=out,
                                    stderr=subprocess.STDOUT, text=True)
        return cls(cwd, proc, out_path)

    @property
    def state_dir(self) -> Path:
        return self.cwd / ".rlsup"

    def output(self) -> str:
        return self.out_path.read_text(errors="replace") if self.out_path.exists() else ""

    def attempt(self) -> int:
        """The newest attempt rlsup started (-1 before the first)."""
        dirs = list((self.state_dir / "attempts").glob("attempt_*"))
        return max((int(d.name.split("_")[1]) for d in dirs), default=-1)

    def attempt_log(self, n: int) -> str:
        p = self.state_dir / "attempts" / f"attempt_{n:04d}" / "output.log"
        return p.read_text(errors="replace") if p.exists() else ""

    def ended(self) -> bool:
        return self.proc.poll() is not None

    def trainers(self, match: Callable[["psutil.Process"], bool]) -> list["psutil.Process"]:
        try:
            procs = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        found = []
        for p in procs:
            try:
                if p.status() != psutil.STATUS_ZOMBIE and match(p):
                    found.append(p)
            except psutil.Error:
                continue
        return found

    def wait_trainer(self, n: int, match: Callable[["psutil.Process"], bool], what: str,
                     timeout: float = 240) -> "psutil.Process | None":
        """Attempt ``n``'s training process (None if rlsup ended first). Polled every 0.1 s: each poll walks
        the process tree and may read warm ranks' /proc maps (~1 ms each), which at 0.02 s took 10-15% of a
        core from the ranks importing their libraries; callers then wait seconds for a save or step anyway."""
        got = wait_for(lambda: self.ended() or (self.attempt() == n and self.trainers(match)), timeout,
                       f"{what} of attempt {n}", interval=0.1)
        return None if got is True else got[0]

    def finish(self, timeout: float = 400) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()

    def status_json(self) -> dict:
        r = subprocess.run(rlsup_cmd("status", "--state-dir", str(self.state_dir), "--json"), cwd=self.cwd,
                           env=clean_env(), capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr
        return json.loads(r.stdout)

    def incidents_json(self) -> dict:
        r = subprocess.run(rlsup_cmd("incidents", str(self.state_dir), "--json"), cwd=self.cwd, env=clean_env(),
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr
        return json.loads(r.stdout)

    def report(self) -> str:
        return (f"rlsup rc={self.proc.returncode}\nkills: {self.kills}\nincidents: "
                f"{[{k: i.get(k) for k in ('attempt', 'reason', 'signal', 'action', 'last_step', 'resumed_step', 'resumed_from')} for i in incidents(self.state_dir)]}"
                f"\n--- rlsup output (tail) ---\n{self.output()[-5000:]}")
