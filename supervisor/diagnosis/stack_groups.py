"""Group ranks by where their main thread is, and name the odd ones out as suspects.

At scale nobody reads a thousand stacks: in a hung collective almost every rank waits in the same
call (``all_reduce``), and the rank that caused it is elsewhere (loading data, stuck in I/O). So the
stacks are reduced to a signature (the main thread's frames as function and file, innermost first;
line numbers and addresses dropped, so two ranks a line apart in the same loop still agree), ranks
with the same signature form a group, and when one group holds most ranks, the ranks outside it
are the suspects (the ByteRobust heuristic). The text is read in both formats rlsup collects:
faulthandler's (``File "x.py", line 3 in f``) and py-spy's (``f (x.py:3)``).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
_FAULTHANDLER_FRAME = re.compile(r'^\s+File "(?P<file>[^"]*)", line (?P<line>\d+) in (?P<func>.+?)\s*$')
_PYSPY_FRAME = re.compile(r"^\s+(?P<func>\S.*?) \((?P<file>[^():]+):(?P<line>\d+)\)\s*$")
_THREAD = re.compile(r"^(Current thread|Thread) ")
_KEY = re.compile(r"rank (\d+)")
_LIBRARY = (os.sep + "site-packages" + os.sep, os.sep + "dist-packages" + os.sep, os.sep + "lib" + os.sep + "python")


@dataclass(frozen=True)
class Frame:
    func: str
    file: str
    line: int

    @property
    def in_user_code(self) -> bool:
        return not any(part in self.file for part in _LIBRARY) and not self.file.startswith("<")

    def where(self) -> str:
        return f"{os.path.basename(self.file)}:{self.line}"


@dataclass
class StackGroup:
    """Ranks whose main threads share a signature, with one member's frames to describe them."""

    ranks: list[int]
    frames: list[Frame]

    def describe(self) -> str:
        """``all_reduce`` (train.py:120): the innermost call, and the innermost line of the user's code."""
        if not self.frames:
            return "no Python stack"
        user = next((f for f in self.frames if f.in_user_code), self.frames[0])
        return f"`{self.frames[0].func}` ({user.where()})"


@dataclass
class StackVerdict:
    """The grouping of one incident's stacks: groups largest first, and the suspect ranks."""

    groups: list[StackGroup]
    suspects: list[int] = field(default_factory=list)
    node: str = ""

    def describe(self) -> str:
        if not self.groups:
            return ""
        parts = []
        for i, g in enumerate(self.groups):
            verb = ("wait in" if i == 0 and self.suspects else "are in") if len(g.ranks) > 1 else "is in"
            parts.append(f"{_ranks_text(g.ranks)} {verb} {g.describe()}")
        text = "; ".join(parts)
        if self.suspects:
            where = f" on node {self.node}" if self.node else ""
            text += f": suspect {_ranks_text(self.suspects)}{where}"
        return text


def parse_threads(text: str) -> list[list[Frame]]:
    """Every thread's frames, innermost first, from a faulthandler or py-spy dump."""
    threads: list[list[Frame]] = []
    current: list[Frame] | None = None
    for line in text.splitlines():
        if _THREAD.match(line):
            current = []
            threads.append(current)
            continue
        m = _FAULTHANDLER_FRAME.match(line) or _PYSPY_FRAME.match(line)
        if m and current is not None:
            current.append(Frame(m["func"], m["file"], int(m["line"])))
    return [t for t in threads if t]


def main_thread(text: str) -> list[Frame]:
    """The thread that runs the script (its outermost frame is ``<module>``), else the first one
    that is not a ``threading`` worker; empty when the text holds no frames."""
    threads = parse_threads(text)
    for frames in threads:
        if frames[-1].func == "<module>":
            return frames
    for frames in threads:
        if frames[-1].func != "_bootstrap":
            return frames
    return threads[0] if threads else []


def signature(frames: list[Frame]) -> tuple[tuple[str, str], ...]:
    return tuple((f.func, os.path.basename(f.file)) for f in frames)


def group_stacks(stacks: dict[str, str], node: str = "") -> StackVerdict:
    """Group ``{"rank R pid P": dump}`` by main-thread signature. Suspects: the ranks outside the one
    group that holds more than half of them (none when there is no such majority, or one group)."""
    by_sig: dict[tuple, StackGroup] = {}
    for key, text in stacks.items():
        m = _KEY.search(key)
        if m is None:
            continue
        frames = main_thread(text)
        group = by_sig.setdefault(signature(frames), StackGroup([], frames))
        group.ranks.append(int(m.group(1)))
    groups = sorted(by_sig.values(), key=lambda g: (-len(g.ranks), min(g.ranks)))
    for g in groups:
        g.ranks.sort()
    total = sum(len(g.ranks) for g in groups)
    suspects: list[int] = []
    if len(groups) > 1 and len(groups[0].ranks) * 2 > total:
        suspects = sorted(r for g in groups[1:] for r in g.ranks)
    return StackVerdict(groups, suspects, node)


@dataclass(frozen=True)
class StackFindings:
    """What an attempt's stacks say: the verdict (who to blame), the suspect ranks and nodes, and for a hang
    seen in the job's output the stuck trainer process they name (``named``; ``rank``/``pid`` None where
    they single out none: never the launcher whose output went silent) and the line that says so."""

    verdict: str
    suspect_ranks: list[int]
    suspect_nodes: list[str]
    named: bool = False
    rank: int | None = None
    pid: int | None = None
    stuck: str = ""


def read_stacks(stacks: dict[str, str], node: str, output_hang: bool = False) -> StackFindings:
    """The findings of ``stacks`` (taken on this node, ``node``). A hang seen in the job's output
    (``output_hang``: rank :data:`~supervisor.diagnosis.step_reports.JOB_RANK`, whose pid is the job's root: the
    torchrun agent, a CLI parent) is blamed on the stuck trainer process the stacks name
    (:func:`supervisor.diagnosis.stacks.culprit`); the verdict leads with it."""
    from supervisor.diagnosis.stacks import culprit

    grouped = group_stacks(stacks, node=node)
    verdict, suspects = grouped.describe(), grouped.suspects
    nodes = [node] if suspects else []
    if not output_hang:
        return StackFindings(verdict, suspects, nodes)
    found = culprit(stacks, suspects)
    if found is None:
        return StackFindings(verdict, suspects, nodes, named=True)
    where = f" on node {node}" if node else ""
    stuck = f"stuck: {found.describe()}{where}"
    if found.rank is not None and found.singled_out and not suspects:
        suspects, nodes = [found.rank], [node] if node else []
    return StackFindings(f"{stuck}; {verdict}" if verdict else stuck, suspects, nodes, True, found.rank, found.pid,
                         stuck)


def _ranks_text(ranks: list[int]) -> str:
    """``ranks 0-2, 4-7`` / ``rank 3``."""
    spans: list[str] = []
    start = prev = None
    for r in sorted(ranks):
        if prev is not None and r == prev + 1:
            prev = r
            continue
        if start is not None:
            spans.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = r
    if start is not None:
        spans.append(str(start) if start == prev else f"{start}-{prev}")
    return ("ranks " if len(ranks) > 1 else "rank ") + ", ".join(spans)
