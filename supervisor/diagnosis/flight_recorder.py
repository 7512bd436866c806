"""Name the rank behind a hung collective from PyTorch's Flight Recorder (FR).

In a collective hang every rank's Python stack says ``all_reduce``, so grouping stacks names nobody.
FR keeps, in every rank, the last collectives it issued (process group, sequence number, op, whether
it completed). rlsup turns it on for supervised jobs (:func:`job_env`: a buffer of
:data:`DEFAULT_BUFFER` entries unless the user set one), and on a hang, before the kill, asks each
rank's FR thread (``trainer_hooks.flight_recorder``) for a dump through its FIFO, waits a few
seconds for the files, and runs torch's own analyser over them
(``torch.distributed.flight_recorder``'s ``build_db``, the library behind ``fr_trace``) in a child
process while the stacks are taken (the supervisor never imports torch). Its first
collective that fails the check (a rank in another op, or not in it at all) gives the process group
and sequence number; the ranks' own entries at that number give the verdict: those in the majority
op wait, the others are the suspects.

The dumps come from the job's processes, so they are read as JSON (never unpickled), size-capped,
and any shape torch's analyser rejects becomes a verdict that says so, never an exception in the
hang path.
"""

from __future__ import annotations

import argparse
import copy
import errno
import json
import logging
import os
import stat
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from rlsup_format.fileio import UnsafeFileError, open_nofollow
from rlsup_format.heartbeat_record import fr_dump_name, fr_request_name
from supervisor.diagnosis.fr_config import clean_pg_config

log = logging.getLogger(__name__)

BUFFER_ENV = "TORCH_FR_BUFFER_SIZE"
NCCL_BUFFER_ENV = "TORCH_NCCL_TRACE_BUFFER_SIZE"
#: Entries kept per rank: a ring of a few hundred bytes each (about 1 MB per rank when full), enough for
#: the last few hundred steps of a job with a handful of collectives per step.
DEFAULT_BUFFER = 2000
#: The most rlsup reads of one rank's dump (2000 entries are about 1.2 MB of JSON).
MAX_DUMP_BYTES = 64 << 20
ANALYSIS_FILE = "flight_recorder.txt"
#: The hang node's own analysis, awaited after its kill (:func:`finish_analysis`).
HANG_ANALYSE_S = 30.0
#: Why a wait for the analyser (or, on several nodes, for the other nodes' dumps) was cut short.
STOPPING = "rlsup asked to stop"
ANALYSER_POLL_S = 0.05  # how often the analyser's child is looked at (its pipes drained meanwhile)
#: The repository root, put on the analyser child's path explicitly (it runs isolated: ``python -I``).
ROOT = Path(__file__).resolve().parents[2]


def job_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables that turn FR on for a job: none where the user set either buffer size (0 turns it off)."""
    if BUFFER_ENV in environ or NCCL_BUFFER_ENV in environ:
        return {}
    return {BUFFER_ENV: str(DEFAULT_BUFFER)}


@dataclass
class FlightVerdict:
    """What FR says about one hang: the text that leads the incident, and who it names."""

    text: str
    suspects: list[int] = field(default_factory=list)
    pg: str = ""
    seq: int | None = None
    op: str = ""
    analyser: list[str] = field(default_factory=list)  # torch's analyser's own report lines
    dumps: dict[int, str] = field(default_factory=dict)  # rank -> the error a rank answered instead of a dump


# ------------------------------------------------------------------------------------------ collect


def request_dumps(hb_dir: Path, ranks: Iterable[int]) -> list[int]:
    """Ask each rank's FR thread for a dump; the ranks asked (those with a live listener)."""
    asked = []
    for rank in ranks:
        path = hb_dir / fr_request_name(rank)
        try:
            (hb_dir / fr_dump_name(rank)).unlink(missing_ok=True)  # a dump from before is not this hang's
            if not stat.S_ISFIFO(os.lstat(path).st_mode):
                continue
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
        except OSError as e:  # ENOENT: no listener was started; ENXIO: nobody holds the reading end
            if e.errno not in (errno.ENOENT, errno.ENXIO):
                log.info("flight recorder: cannot ask rank %d: %s", rank, e)
            continue
        try:
            os.write(fd, b"d")
            asked.append(rank)
        except OSError as e:  # EAGAIN: the pipe is full of earlier requests, which it will answer
            if e.errno == errno.EAGAIN:
                asked.append(rank)
        finally:
            os.close(fd)
    return asked


def collect_dumps(hb_dir: Path, ranks: Iterable[int], wait_s: float = 5.0) -> dict[int, dict[str, Any]]:
    """Request and wait (at most ``wait_s``) for the dumps; ``{rank: dump}`` of those that came."""
    pending = set(request_dumps(hb_dir, ranks))
    dumps: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + wait_s
    while pending:
        for rank in sorted(pending):
            data = read_dump(hb_dir / fr_dump_name(rank))
            if data is not None:
                dumps[rank] = data
                pending.discard(rank)
        if not pending or time.monotonic() >= deadline:
            break
        time.sleep(0.02)  # the thread answers within milliseconds; a hang's restart waits on this
    for rank in sorted(pending):
        log.info("flight recorder: no dump from rank %d within %.0fs", rank, wait_s)
    return dumps


def read_dump(path: Path) -> dict[str, Any] | None:
    """One rank's dump (renamed into place whole), None while absent; an error where it is oversized, not
    JSON, or not a regular file (a FIFO put there must not block the hang path: ``open_nofollow`` opens
    without blocking and checks the type before reading)."""
    try:
        fd = open_nofollow(path.parent, path.name)
    except UnsafeFileError as e:  # a link stays unread (as if absent); anything else but a file is refused
        return None if e.errno == errno.ELOOP else {"error": f"{path} is not a regular file"}
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        body = f.read(MAX_DUMP_BYTES + 1)
    if len(body) > MAX_DUMP_BYTES:
        return {"error": f"dump over {MAX_DUMP_BYTES} bytes"}
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):  # RecursionError: nested too deep for the parser
        return {"error": "dump is not JSON"}
    return data if isinstance(data, dict) else {"error": "dump is not a JSON object"}


# ------------------------------------------------------------------------------------------ analyse


def normalise(dump: Mapping[str, Any]) -> dict[str, Any]:
    """A dump in the shape torch's loader hands its builder (``read_dump``), gloo's groups filled in
    from the rank's own view: gloo's ``pg_config`` names no group (one entry under ``""``). Only groups whose
    ``ranks`` parse as a JSON list of ranks are kept (:mod:`supervisor.diagnosis.fr_config`: torch's analyser evals them)."""
    pg_config, dropped = clean_pg_config({k: v for k, v in dict(dump.get("pg_config") or {}).items() if k})
    extra, more = clean_pg_config(dump.get("rlsup_pg_config"))
    for name, cfg in extra.items():
        pg_config.setdefault(name, cfg)
    if dropped or more:
        log.info("flight recorder: rank %s: dropped %s", dump.get("rlsup_rank"), "; ".join(dropped + more))
    rank = int(dump["rlsup_rank"])
    return {"host_name": f"host_rank{rank}", "rank": rank, "entries": list(dump.get("entries") or []),
            "version": str(dump.get("version", "")), "pg_config": pg_config}


def analyse(dumps: Mapping[int, Mapping[str, Any]], node_of: Mapping[int, str] | None = None,
            in_child: bool = False) -> FlightVerdict:
    """The verdict from every rank's dump (``{rank: dump}``); ``node_of`` names each rank's node.
    ``in_child``: torch's analyser runs in a child process (the supervisor never imports torch); else here."""
    run = Analysis.start(dumps, node_of or {}, in_child)
    run.in_process = not in_child
    return run.finish()


@dataclass
class Analysis:
    """One verdict in the making: torch's analyser may run in a child while rlsup does other work (the
    stacks) before :meth:`finish` waits for it."""

    good: dict[int, dict[str, Any]]
    errors: dict[int, str]
    node_of: Mapping[int, str]
    child: subprocess.Popen | None = None
    #: torch's analyser in this process where no child runs (tests, the child itself); otherwise, without a
    #: child (its start failed), rlsup's own reading, never torch imported into the supervisor.
    in_process: bool = False
    not_started: str = ""  # why the child did not start

    @classmethod
    def start(cls, dumps: Mapping[int, Mapping[str, Any]], node_of: Mapping[int, str], in_child: bool) -> "Analysis":
        errors = {r: str(d["error"]) for r, d in dumps.items() if "error" in d}
        good = {r: normalise(d) for r, d in dumps.items() if "error" not in d and "rlsup_rank" in d}
        run = cls(good, errors, node_of)
        if good and in_child:
            try:
                run.child = start_child(good)
            except OSError as e:
                log.info("flight recorder: analyser not started: %s", e)
                run.not_started = f"{type(e).__name__}: {e}"
        return run

    def finish(self, timeout_s: float = 120.0) -> FlightVerdict:
        good = self.good
        if not good:
            why = "; ".join(f"rank {r}: {e}" for r, e in sorted(self.errors.items())) or "no rank answered"
            return FlightVerdict(f"flight recorder: no dumps ({why})", dumps=self.errors)
        lines: list[str] = []
        fallback = ""
        try:
            if self.child:
                pg, seq = child_answer(self.child, lines, timeout_s)
            elif self.in_process:
                pg, seq = first_failure(good, lines)
            else:  # the child never started: rlsup's own reading (importing torch here would cost for good)
                fallback = f"torch's analyser not started{': ' + self.not_started if self.not_started else ''}"
                lines.append(f"{fallback}; rlsup's own reading of the entries (last_divergence)")
                pg, seq = last_divergence(good)
        except Exception as e:  # noqa: BLE001 - torch's analyser on input it rejects: fall back, say why
            lines.append(f"torch's analyser failed: {type(e).__name__}: {e}")
            pg, seq = last_divergence(good)
        # Ranks of these groups without a dump (multi-node: each node reads its own ranks): what they do is
        # not known here, so a local minority is no culprit: the ranks are described, nobody is blamed.
        unseen = sorted(set().union(*(_members(good, n) for d in good.values() for n in d["pg_config"])) - set(good))
        verdict = describe(good, pg, seq, self.node_of, blame=not unseen)
        verdict.analyser, verdict.dumps = lines, self.errors
        if unseen:
            verdict.text += f" (from ranks {', '.join(map(str, sorted(good)))} only: no dump of {_ranks(unseen)})"
        if fallback:
            verdict.text += f" ({fallback}: rlsup's own reading)"
        return verdict


def first_failure(details: Mapping[int, Mapping[str, Any]], lines: list[str]) -> tuple[str | None, int | None]:
    """(process group name, sequence number) of the first collective torch's analyser finds failing,
    (None, None) where every collective matched; its report lines go to ``lines``."""
    from torch.distributed.flight_recorder.components.builder import build_db

    args = argparse.Namespace(verbose=False, just_print_entries=False, allow_incomplete_ranks=True, mismatch_cap=10,
                              selected_ranks=None, pg_filters=None, print_stack_trace=False)
    inputs = {f"rank_{r}": copy.deepcopy(dict(d)) for r, d in sorted(details.items())}  # the builder pops entries
    for d in inputs.values():  # torch evals ``ranks``: only configs rebuilt from checked values reach it
        d["pg_config"] = clean_pg_config(d.get("pg_config"))[0]
    version = next(iter(inputs.values()))["version"]
    fr_log = logging.getLogger("Flight Recorder")
    capture = _Lines()
    saved, fr_log.handlers = fr_log.handlers, [capture]
    try:
        db = build_db(inputs, args, version)
    finally:
        fr_log.handlers = saved
    lines.extend(capture.lines)
    for coll in db.collectives:
        if not coll.pass_check or coll.missing_ranks:  # another op on some rank, or a rank that never joined
            return str(coll.group_id), int(coll.collective_seq_id)
    return None, None


def start_child(details: Mapping[int, Mapping[str, Any]]) -> subprocess.Popen:
    """:func:`first_failure` in ``python -m supervisor.diagnosis.flight_recorder``: importing torch would cost the
    supervisor seconds and memory for good. The details go through a temporary file (no pipe to fill). The
    child runs isolated (``-I``: no cwd or user site on its path, no PYTHON* variables) from ``/``, with
    rlsup's own root put on its path explicitly."""
    code = f"import sys; sys.path.insert(0, {str(ROOT)!r}); from supervisor.diagnosis.flight_recorder import main; main()"
    with tempfile.TemporaryFile("w+") as f:
        json.dump(details, f)
        f.seek(0)
        return subprocess.Popen([sys.executable, "-I", "-c", code], stdin=f, cwd="/",
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def child_answer(child: subprocess.Popen, lines: list[str], timeout_s: float) -> tuple[str | None, int | None]:
    """The child's ``{pg, seq, lines, error}``; it is killed past ``timeout_s``."""
    try:
        out, err = child.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        child.kill()
        child.communicate()
        raise
    if child.returncode != 0:
        raise RuntimeError(f"exit {child.returncode}: {err.strip()[-500:]}")
    answer = json.loads(out)
    lines.extend(str(line) for line in answer["lines"])
    if answer.get("error"):
        raise RuntimeError(answer["error"])
    return answer["pg"], answer["seq"]


def main() -> None:
    """The child of :func:`start_child`: details on stdin, ``{pg, seq, lines, error}`` out."""
    details = {int(r): d for r, d in json.load(sys.stdin).items()}
    lines: list[str] = []
    try:
        pg, seq = first_failure(details, lines)
        answer: dict[str, Any] = {"pg": pg, "seq": seq, "lines": lines}
    except Exception as e:  # noqa: BLE001 - reported to the parent, which falls back
        answer = {"pg": None, "seq": None, "lines": lines, "error": f"{type(e).__name__}: {e}"}
    json.dump(answer, sys.stdout)


class _Lines(logging.Handler):
    """Keeps the analyser's report (it logs to stderr otherwise)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.extend(self.format(record).splitlines())


def last_divergence(details: Mapping[int, Mapping[str, Any]]) -> tuple[str | None, int | None]:
    """Without torch's analyser: the first (group, sequence number) where the ranks' ops differ or one
    rank has none, from the first number every rank still holds (their rings may start apart)."""
    by_pg: dict[str, dict[int, dict[int, str]]] = {}  # group -> rank -> sequence number -> op
    for rank, d in details.items():
        for e in d["entries"]:
            if not e.get("is_p2p"):
                by_pg.setdefault(str(e["process_group"][0]), {}).setdefault(rank, {})[int(e["collective_seq_id"])] = _op(e)
    for pg, ranks in sorted(by_pg.items()):
        start = max(min(seqs) for seqs in ranks.values())
        for seq in sorted(set().union(*ranks.values())):
            if seq >= start and len({ops.get(seq) for ops in ranks.values()}) > 1:
                return pg, seq
    return None, None


def describe(details: Mapping[int, Mapping[str, Any]], pg: str | None, seq: int | None,
             node_of: Mapping[int, str], blame: bool = True) -> FlightVerdict:
    """Group the ranks by what they do at collective ``seq`` of ``pg``: the largest group waits, the rest
    are suspects (none named unless ``blame``). Where nothing failed, say where the ranks are."""
    if pg is None or seq is None:
        return _all_agree(details, blame)
    members = _members(details, pg)
    where: dict[int, str] = {}
    for rank in members:
        entry = _entry(details.get(rank), pg, seq)
        where[rank] = "(no dump)" if rank not in details else _op(entry) if entry else ""
    counts = Counter(op for op in where.values() if op and op != "(no dump)")
    majority = counts.most_common(1)[0][0] if counts else ""
    waiting = sorted(r for r, op in where.items() if op == majority)
    suspects = sorted(r for r, op in where.items() if op != majority and op != "(no dump)")
    desc = _pg_text(details, pg, len(members))
    verb = "wait in" if len(waiting) > 1 else "waits in"
    parts = [f"{_ranks(waiting)} {verb} {majority} #{seq} ({desc})"] if waiting else []
    for rank in suspects:
        done = _last_completed(details[rank], pg)
        done_text = f"last completed #{done} and " if done is not None else ""
        op = where[rank]
        parts.append(f"rank {rank} {done_text}" + (f"is in {op} #{seq}" if op else f"never called #{seq}"
                                                    + _elsewhere(details[rank], pg)))
    text = "flight recorder: " + "; ".join(parts)
    if not blame:
        return FlightVerdict(text, [], desc, seq, majority)
    if suspects:
        nodes = sorted({node_of[r] for r in suspects if r in node_of})
        text += f": suspect {_ranks(suspects)}" + (f" on node {', '.join(nodes)}" if nodes else "")
    return FlightVerdict(text, suspects, desc, seq, majority)


def _all_agree(details: Mapping[int, Mapping[str, Any]], blame: bool = True) -> FlightVerdict:
    pending: dict[tuple[str, int, str], list[int]] = {}
    for rank, d in details.items():
        for e in d["entries"]:
            if not _done(e):
                pending.setdefault((str(e["process_group"][0]), int(e["collective_seq_id"]), _op(e)), []).append(rank)
                break
    if not pending:
        return FlightVerdict("flight recorder: every collective recorded completed on every rank (the hang is "
                             "outside collectives)")
    (pg, seq, op), ranks = max(pending.items(), key=lambda kv: len(kv[1]))
    verb = "are all in" if len(ranks) > 1 else "is in"
    text = f"flight recorder: {_ranks(sorted(ranks))} {verb} {op} #{seq} ({_pg_text(details, pg, None)})"
    if blame:
        text += ", which matches on every rank: no rank to blame (a slow or lost peer, or the network)"
    return FlightVerdict(text, pg=pg, seq=seq, op=op)


def _elsewhere(detail: Mapping[str, Any], pg: str) -> str:
    """Where a rank that skipped a collective of ``pg`` waits instead: its pending entry in another group."""
    for e in detail["entries"]:
        if not _done(e) and str(e["process_group"][0]) != pg:
            return f" (it waits in {_op(e)} #{e['collective_seq_id']} of {_pg_text({0: detail}, str(e['process_group'][0]), None)})"
    return ""


def _members(details: Mapping[int, Mapping[str, Any]], pg: str) -> list[int]:
    for d in details.values():
        cfg = d["pg_config"].get(pg)
        if cfg is not None:
            try:
                return sorted(int(r) for r in json.loads(str(cfg["ranks"])))
            except (ValueError, TypeError):
                break
    return sorted(details)


def _entry(detail: Mapping[str, Any] | None, pg: str, seq: int) -> dict[str, Any] | None:
    for e in (detail or {}).get("entries", []):
        if str(e["process_group"][0]) == pg and int(e["collective_seq_id"]) == seq and not e.get("is_p2p"):
            return e
    return None


def _last_completed(detail: Mapping[str, Any], pg: str) -> int | None:
    done = [int(e["collective_seq_id"]) for e in detail["entries"]
            if str(e["process_group"][0]) == pg and _done(e) and not e.get("is_p2p")]
    return max(done) if done else None


def _done(entry: Mapping[str, Any]) -> bool:
    """Completed: gloo marks it ``retired`` (its ``state`` stays "scheduled"); NCCL's watchdog sets ``state``
    to "completed" (seen on torch 2.11 + CUDA, where ``retired`` stayed false)."""
    return bool(entry.get("retired")) or entry.get("state") == "completed"


def _op(entry: Mapping[str, Any]) -> str:
    """``gloo:all_reduce`` -> ``all_reduce`` (the backend shows in the group text)."""
    return str(entry.get("profiling_name", "?")).split(":")[-1]


def _pg_text(details: Mapping[int, Mapping[str, Any]], pg: str, size: int | None) -> str:
    desc = next((str(d["pg_config"][pg].get("desc", "")) for d in details.values() if pg in d["pg_config"]), "")
    name = f"process group {pg}" + (f" {desc}" if desc and desc != pg else "")
    return name + (f", size {size}" if size else "")


def _ranks(ranks: list[int]) -> str:
    return ("ranks " if len(ranks) > 1 else "rank ") + ", ".join(map(str, ranks))


# ------------------------------------------------------------------------------------------ the hang path


def begin_hang_verdict(hb_dir: Path, ranks: Iterable[int], node: str, wait_s: float = 5.0) -> Analysis | None:
    """Ask every rank for its dump and start torch's analyser on them (in a child); None where no rank
    has a dump to give (FR off, no trainer_hooks, torch.distributed never initialised: why is logged)."""
    ranks = sorted(ranks)
    dumps = collect_dumps(hb_dir, ranks, wait_s)
    run = Analysis.start(dumps, {r: node for r in ranks}, in_child=True)
    if not run.good:
        if run.errors:
            log.info("flight recorder: no dump: %s", "; ".join(f"rank {r}: {e}" for r, e in sorted(run.errors.items())))
        return None
    return run


def finish_analysis(run: Analysis, cap_s: float, stopped: Callable[[], bool]) -> FlightVerdict:
    """:meth:`Analysis.finish`, its child awaited at most ``cap_s`` and no longer once rlsup is asked to stop
    (then killed: the verdict falls back to rlsup's own reading of the dumps and says why)."""
    child, cut = run.child, None
    deadline = time.monotonic() + cap_s
    while child is not None:
        try:  # communicate, not poll: the child's pipes are drained meanwhile (a full one would block it)
            child.communicate(timeout=ANALYSER_POLL_S)
            break  # its output is kept: finish's own communicate returns it
        except subprocess.TimeoutExpired:
            if stopped() or time.monotonic() >= deadline:
                cut = STOPPING if stopped() else f"analyser past {cap_s:.0f}s"
                child.kill()
                break
    fr = run.finish(cap_s)  # the child has exited (or was killed): no wait left in it
    if cut is not None:
        fr.text += f" (torch's analyser cut short: {cut})"
    return fr


def save_verdict(fr: FlightVerdict, attempt_dir: Path | None) -> None:
    """A verdict beside the attempt (``flight_recorder.txt``); the one across nodes replaces this node's own."""
    if attempt_dir is None:
        return
    try:
        (attempt_dir / ANALYSIS_FILE).write_text("\n".join([fr.text, "", *fr.analyser]) + "\n")
    except OSError as e:
        log.info(f"flight recorder: analysis not saved: {e}")


if __name__ == "__main__":
    main()
