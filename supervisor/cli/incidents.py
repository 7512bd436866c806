"""``rlsup incidents``: what happened in a run, from ``incidents.jsonl`` alone (offline triage).

Works after the fact, on a copied state directory, with no live rlsup: each incident with its
verdict (who to blame), the steps it cost, the downtime until the next attempt, and the nodes
named as suspects across the run (a node named again and again is the one to drain).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rlsup_format.state_files import INCIDENTS, STRAGGLERS
from supervisor.run.incidents import read_incidents
from supervisor.lifecycle import Action
from supervisor.diagnosis.stragglers import read_reports


@dataclass
class RunSummary:
    """Totals over a run's incidents."""

    incidents: int = 0
    restarts: int = 0
    downtime_s: float = 0.0
    steps_lost: int = 0
    unknown_lost: int = 0  # incidents whose steps lost rlsup cannot know
    reasons: dict[str, int] = field(default_factory=dict)
    suspect_nodes: dict[str, int] = field(default_factory=dict)
    first: float | None = None
    last: float | None = None


#: What an incident's ``action`` says of the run when no attempt followed it.
ENDED = {**{a.value: "gave up" for a in (Action.GIVE_UP, Action.FATAL, Action.NO_PROGRESS, Action.EXCLUDE_NODE)},
         Action.STOP.value: "stopped"}


def steps_lost(incident: dict[str, Any]) -> int | None:
    """Steps redone after this failure: the last step a rank reported minus the step resumed from; None
    when either is unknown (no step reported, or a checkpoint rlsup cannot read the step of), and when no
    attempt followed (rlsup gave up or stopped: nothing was resumed, nothing redone)."""
    last, resumed = incident.get("last_step"), incident.get("resumed_step")
    if last is None or incident.get("resume_known") is False or incident.get("downtime_s") is None:
        return None
    return max(0, last - (resumed if resumed is not None else 0))


def summarize(incidents: list[dict[str, Any]]) -> RunSummary:
    s = RunSummary(incidents=len(incidents))
    reasons: collections.Counter[str] = collections.Counter()
    suspects: collections.Counter[str] = collections.Counter()
    for inc in incidents:
        reasons[str(inc.get("reason"))] += 1
        suspects.update(inc.get("suspect_nodes") or [])
        s.restarts += inc.get("action") == "restart"
        s.downtime_s += inc.get("downtime_s") or 0.0
        lost = steps_lost(inc)
        s.steps_lost += lost or 0
        s.unknown_lost += lost is None and inc.get("resume_known") is False
        t = inc.get("time")
        if isinstance(t, (int, float)):
            s.first = t if s.first is None else min(s.first, t)
            s.last = t if s.last is None else max(s.last, t)
    s.reasons, s.suspect_nodes = dict(reasons.most_common()), dict(suspects.most_common())
    return s


def _lost(s: RunSummary) -> str:
    """The steps-lost total; incidents where rlsup cannot know it are counted apart, never as 0."""
    if s.unknown_lost and s.unknown_lost == s.incidents:
        return "steps lost unknown"
    return f"{s.steps_lost} steps lost" + (f" (unknown for {s.unknown_lost} more incident(s))" if s.unknown_lost else "")


def incident_line(inc: dict[str, Any]) -> str:
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(inc.get("time", 0)))
    parts = [f"{when} attempt {inc.get('attempt')}: {inc.get('reason')} -> {inc.get('action')}"]
    lost = steps_lost(inc)
    if lost is not None:
        resumed = inc.get("resumed_step")
        parts.append(f"{lost} steps lost (step {inc['last_step']} -> resumed "
                     f"{'from scratch' if resumed is None else resumed})")
    elif inc.get("resume_known") is False and inc.get("downtime_s") is not None:
        last = "?" if inc.get("last_step") is None else inc["last_step"]
        parts.append(f"steps lost unknown (step {last} -> resumed from "
                     f"{inc.get('resumed_from') or 'a checkpoint rlsup cannot read'}, step unknown)")
    elif inc.get("downtime_s") is None and inc.get("action") in ENDED:
        at = " (no step reported)" if inc.get("last_step") is None else f" at step {inc['last_step']}"
        parts.append(ENDED[inc["action"]] + at)
    if inc.get("world"):
        parts.append(str(inc["world"]))
    for torn in inc.get("left_torn") or []:
        parts.append(f"{torn.get('file')} left torn ({torn.get('torn')}): {torn.get('no_version')}")
    if inc.get("downtime_s") is not None:
        parts.append(f"downtime {inc['downtime_s']:.1f}s")
    line = "; ".join(parts)
    detail = "\n      ".join(filter(None, [inc.get("fr_verdict"), inc.get("verdict") or inc.get("detail")]))
    return line + (f"\n      {detail}" if detail else "")


def straggler_line(r: dict[str, Any]) -> str:
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r.get("time", 0)))
    if r.get("cleared"):
        return f"{when} attempt {r.get('attempt')}: rank {r.get('rank')} on node {r.get('node')} no longer straggles"
    return (f"{when} attempt {r.get('attempt')}: straggler: rank {r.get('rank')} (pid {r.get('pid')}) on node "
            f"{r.get('node')} works {r.get('ratio')}x its peers' median ({r.get('method')}, step {r.get('step')})")


def report(state_dir: Path, incidents: list[dict[str, Any]]) -> str:
    s = summarize(incidents)
    span = f" over {_duration(s.last - s.first)}" if s.first is not None and s.last is not None else ""
    lines = [f"{state_dir / INCIDENTS}: {s.incidents} incident(s){span}, {s.restarts} restart(s), "
             f"downtime {s.downtime_s:.1f}s, {_lost(s)}"]
    if s.reasons:
        lines.append("reasons: " + ", ".join(f"{r} {n}" for r, n in s.reasons.items()))
    if s.suspect_nodes:
        lines.append("suspect nodes: " + ", ".join(f"{node} ({n}x)" for node, n in s.suspect_nodes.items()))
    lines += ["  " + incident_line(inc) for inc in incidents]
    stragglers = read_reports(state_dir)
    if stragglers:
        lines.append(f"stragglers ({STRAGGLERS}): {sum(not r.get('cleared') for r in stragglers)} flagged")
        lines += ["  " + straggler_line(r) for r in stragglers]
    return "\n".join(lines)


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{sec:02d}s"


def cmd_incidents(args: argparse.Namespace) -> int:
    state_dir = Path(args.state_dir)
    if state_dir.name == INCIDENTS:
        state_dir = state_dir.parent
    if not (state_dir / INCIDENTS).is_file() and not (state_dir / STRAGGLERS).is_file():
        print(f"rlsup incidents: no {INCIDENTS} (nor {STRAGGLERS}) in {state_dir}", file=sys.stderr)
        return 1
    incidents = read_incidents(state_dir)
    if args.json:
        print(json.dumps({"summary": asdict(summarize(incidents)), "incidents": incidents,
                          "stragglers": read_reports(state_dir)}, indent=1))
    else:
        print(report(state_dir, incidents))
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser("incidents", help="Summarize a run's incidents (offline, from incidents.jsonl alone).")
    p.add_argument("state_dir", nargs="?", default=".rlsup",
                   help="rlsup's state directory (or its incidents.jsonl); default .rlsup")
    p.add_argument("--json", action="store_true", help="Machine-readable summary and incidents.")
    p.set_defaults(func=cmd_incidents)
