"""One Flight Recorder verdict for a hang across nodes, made where every node's dumps meet.

Each node can read only its own ranks' dumps, and a rank that skipped a collective looks like any other
from its own node. So in a job of several nodes (keys under the job's signed namespace,
:class:`~supervisor.cluster.signed_keys.SignedKeys`):

1. the node that sees the hang asks for every node's dumps (``fr/<a>/want``), publishes its own ranks'
   (``fr/<a>/<node>``, :class:`~supervisor.diagnosis.fr_records.NodeDumps`: newest entries only, compressed,
   bounded), takes its ranks' stacks and only then ends attempt ``a`` (:meth:`FrExchange.end`), and
   kills its job once every node's record is there (:meth:`FrExchange.await_peers`): the other nodes
   must dump their ranks while they still wait in the collective, not after the dead peer broke it,
   and this node's py-spy must not race the peers' kills;
2. a node told the attempt ended (:meth:`FrExchange.peer_ended`) finds ``want`` and publishes its ranks'
   dumps before its job is killed; a node whose job ended otherwise publishes an empty record, so
   nobody waits for it;
3. the attempt's lead (node 0, unless it was lost: :mod:`supervisor.cluster.round_lead`) waits for the record of
   every node that runs the attempt (at most :data:`GATHER_S`), runs torch's analyser over all of
   them (:mod:`supervisor.diagnosis.flight_recorder`, in a child, at most :data:`ANALYSE_S`) and publishes the
   verdict (``fr/<a>/verdict``); every other node waits for it (the two bounds and a margin) and puts
   it in its incident, so every node's incident names the suspect rank and its node;
4. the lead deletes the records once the verdict is out (they are up to 1 MB a node: node 0's memory, etcd's
   quota), and the small rest of an earlier attempt's exchange (``want``, ``verdict``, a late record)
   when the next exchange starts: by then every node has left the earlier one.

Every wait also ends as soon as rlsup is asked to stop (``stopped``): a preemption's grace is short.

A record that is refused (oversized, malformed: named with its node and key in the log and the verdict),
a node that never answers, or a store that is gone leaves a verdict over what came, or this node's own
(from its ranks only); the run loop is never held past the bounds.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable

from supervisor.tiers.holdings import RecordError
from supervisor.cluster.coordinator import ABORT_MAX_AGE_S
from supervisor.diagnosis.evidence import FlightEvidence
from supervisor.diagnosis.flight_recorder import (STOPPING, Analysis, FlightVerdict, collect_dumps, finish_analysis,
                                                  save_verdict, start_child)
from supervisor.diagnosis.fr_records import NodeDumps, SharedVerdict, aligned
from supervisor.observer import Observer

if TYPE_CHECKING:
    from supervisor.cluster.coordinator import RoundCoordinator
    from supervisor.cluster.signed_keys import Signed, SignedKeys

log = logging.getLogger(__name__)

GATHER_S = 15.0  # node 0's wait for every node's record
ANALYSE_S = 60.0  # torch's analyser in its child (importing torch is most of it)
MARGIN_S = 10.0  # the other nodes wait for the verdict this much longer than node 0 may take
POLL_S = 0.05
STALE_POLL_S = 0.5  # re-reading a stale record (rare) moves it: slower


class FrExchange:
    """This node's part in the exchange (see the module docstring); no method raises."""

    def __init__(self, coordinator: "RoundCoordinator", node: int, nodes: int, node_name: str, observer: Observer,
                 gather_s: float = GATHER_S, analyse_s: float = ANALYSE_S,
                 stopped: Callable[[], bool] = lambda: False) -> None:
        self.coordinator, self.node_name, self.observer = coordinator, node_name, observer
        self.node, self.nodes = node, nodes
        self.gather_s, self.analyse_s = gather_s, analyse_s
        self.stopped = stopped  # rlsup's stop request: every wait here gives up at once
        self._wanted: set[int] = set()
        self._published: set[int] = set()
        # One gather_s per hang: when this node awaited the records before its kill, the gather after it ends
        # where that wait did (a node cut off from the store is waited for once, not twice).
        self._gather_ends: dict[int, float] = {}

    @property
    def keys(self) -> "SignedKeys":  # the coordinator's (its store is replaced when node 0's comes back)
        return self.coordinator.keys

    # ------------------------------------------------------------ while the ranks still wait

    def hang(self, attempt: int, flight: Analysis | None) -> None:
        """This node saw the hang and took its ranks' dumps (``flight``): ask for everyone's and publish
        ours; :meth:`end` follows this node's stacks (the other nodes dump theirs when told)."""
        if flight is None:
            return
        try:
            self._forget_earlier(attempt)
            self.keys.create(f"fr/{attempt}/want", str(self.node))
            self._wanted.add(attempt)
            self._publish(attempt, flight.good, flight.errors)
        except Exception as e:  # noqa: BLE001 - the hang is handled without a shared verdict
            log.warning(f"flight recorder: dumps not shared: {type(e).__name__}: {e}")

    def end(self, attempt: int, why: str) -> None:
        """End the attempt for every node (``why``) after this node's stacks and before its kill: the other
        nodes then find ``want`` and dump their ranks while those still wait."""
        try:
            self.coordinator.end(attempt, f"node {self.node}: {why}".strip())
        except Exception as e:  # noqa: BLE001 - attempt_failed ends it again and says why
            log.warning(f"could not tell the other nodes that attempt {attempt} hung: {type(e).__name__}: {e}")

    def await_peers(self, attempt: int) -> None:
        """Where dumps were asked for: until every node's record is there (at most ``gather_s``, not once rlsup is
        asked to stop), so that this node's kill does not break the peers' ranks out of the collective first."""
        if attempt not in self._wanted:
            return
        names = [f"fr/{attempt}/{n}" for n in self.coordinator.nodes_of(attempt)]
        deadline = self._gather_ends.get(attempt, time.monotonic() + self.gather_s)
        self._gather_ends = {attempt: deadline}  # this hang's only: nothing accumulates over a long run
        try:
            while self.keys.poll(names, None)[0] is None and time.monotonic() < deadline and not self.stopped():
                time.sleep(POLL_S)
        except Exception as e:  # noqa: BLE001 - the kill goes ahead; settle says what came
            log.info(f"flight recorder: not waiting for the other nodes' dumps: {e}")

    def _forget_earlier(self, attempt: int) -> None:
        """The attempt's lead: the keys of earlier exchanges (small, but a store may outlive many hangs)."""
        if not self.coordinator.leads(attempt):
            return
        for old in sorted(a for a in self._wanted if a != attempt):
            names = ["want", "verdict", *map(str, range(self.nodes))]
            self.coordinator.store.delete([self.keys.key(f"fr/{old}/{n}") for n in names])
            self._wanted.discard(old)

    def peer_ended(self, attempt: int, hb_dir: Path, ranks: Iterable[int]) -> None:
        """Another node ended the attempt: where it asked for dumps, take and publish ours (the job
        still runs: it is killed after this)."""
        try:
            if not self._fresh(self.keys.get(f"fr/{attempt}/want")):
                return
            self._wanted.add(attempt)
            taken = Analysis.start(collect_dumps(hb_dir, ranks), {}, in_child=False)
            self._publish(attempt, taken.good, taken.errors)
        except Exception as e:  # noqa: BLE001 - as above
            log.warning(f"flight recorder: dumps not shared: {type(e).__name__}: {e}")

    def _fresh(self, value: "Signed | None") -> bool:
        """Written in this run: a store that outlives a run (etcd) may hold an earlier run's keys of the same
        attempt number (the coordinator's rule for an old abort)."""
        return value is not None and value.time >= self.coordinator.started - ABORT_MAX_AGE_S

    def _publish(self, attempt: int, dumps: dict[int, dict], errors: dict[int, str]) -> None:
        record = NodeDumps(self.node, self.node_name, dict(dumps), dict(errors))
        text = record.to_json()
        self.keys.set(f"fr/{attempt}/{self.node}", text)
        self._published.add(attempt)
        cut = f", the newest {record.kept} entries of each group" if record.kept else ""
        log.info(f"flight recorder: shared the dumps of ranks {sorted(dumps) or 'none'}{cut} ({len(text)} bytes)")

    # ------------------------------------------------------------ after the attempt ended

    def settle(self, attempt: int, attempt_dir: Path | None = None) -> FlightEvidence | None:
        """Where dumps were asked for in this attempt: its lead judges them all and publishes the verdict,
        the others wait for it; it is evidence for the attempt's outcome (and so the incident) on every node.
        None: no dumps were asked for, or no verdict came (this node's own stands)."""
        try:
            if attempt not in self._wanted and not self._fresh(self.keys.get(f"fr/{attempt}/want")):
                return None
        except Exception:  # noqa: BLE001 - no store, no exchange: the join that follows says why, once
            return None
        try:
            self._forget_earlier(attempt)
            self._wanted.add(attempt)
            if attempt not in self._published:
                self._publish(attempt, {}, {})  # this node's job ended before it could dump: nobody waits for it
            judges = self.coordinator.leads(attempt)
            verdict = self._judge(attempt, attempt_dir) if judges else self._await_verdict(attempt)
        except Exception as e:  # noqa: BLE001 - the incident keeps this node's own verdict
            log.warning(f"flight recorder: no verdict across nodes: {type(e).__name__}: {e}")
            return None
        if verdict is not None:
            return self._apply(attempt, verdict, attempt_dir)
        return FlightEvidence(missing=STOPPING) if self.stopped() else None

    def _judge(self, attempt: int, attempt_dir: Path | None) -> SharedVerdict:
        """Node 0: every node's record (what came within the bound), analysed; the verdict published."""
        records, problems = self._gather(attempt)
        good: dict[int, dict] = {}
        errors: dict[int, str] = {}
        node_of: dict[int, str] = {}
        for rec in records:
            good.update(rec.dumps)
            errors.update(rec.errors)
            node_of.update({r: rec.node_name for r in (*rec.dumps, *rec.errors)})
        run = Analysis(aligned(good), errors, node_of)
        if run.good:
            try:
                run.child = start_child(run.good)
            except OSError as e:
                log.info(f"flight recorder: analyser not started: {e}")
        fr = finish_analysis(run, self.analyse_s, self.stopped)
        if problems:
            fr.text += f" ({'; '.join(problems)})"
        save_verdict(fr, attempt_dir)
        verdict = SharedVerdict(fr.text, fr.suspects, sorted({node_of[r] for r in fr.suspects if r in node_of}),
                                fr.seq, fr.op)
        self.keys.set(f"fr/{attempt}/verdict", verdict.to_json())
        try:  # read for good: only the lead reads the records
            self.coordinator.store.delete([self.keys.key(f"fr/{attempt}/{n}") for n in self.coordinator.nodes_of(attempt)])
        except Exception as e:  # noqa: BLE001 - the next exchange deletes them again
            log.info(f"flight recorder: records not deleted: {e}")
        return verdict

    def _gather(self, attempt: int) -> tuple[list[NodeDumps], list[str]]:
        names = [f"fr/{attempt}/{n}" for n in self.coordinator.nodes_of(attempt)]
        deadline = self._gather_ends.pop(attempt, time.monotonic() + self.gather_s)
        while self.keys.poll(names, None)[0] is None and time.monotonic() < deadline and not self.stopped():
            time.sleep(POLL_S)  # one look whether every key exists: no record moves meanwhile
        got: dict[str, Signed] = {}
        while True:  # a record an earlier run left under the same attempt number is not this hang's
            pending = [n for n in names if n not in got]
            got.update((n, v) for n, v in zip(pending, self.keys.get_many(pending)) if self._fresh(v))
            if len(got) == len(names) or time.monotonic() >= deadline or self.stopped():
                break
            time.sleep(STALE_POLL_S)
        records, problems = [], []
        waited = f"({STOPPING})" if self.stopped() else f"within {self.gather_s:.0f}s"
        for node, name in zip(self.coordinator.nodes_of(attempt), names):
            value = got.get(name)
            if value is None:
                problems.append(f"node {node} shared no dumps {waited}")
                continue
            try:
                records.append(NodeDumps.from_json(value.payload, node, self.keys.key(name)))
            except RecordError as e:
                problems.append(f"refused {e}")
        for problem in problems:
            log.warning(f"flight recorder: {problem}")
        return records, problems

    def _await_verdict(self, attempt: int) -> SharedVerdict | None:
        name, lead = f"fr/{attempt}/verdict", self.coordinator.lead_of(attempt)
        wait_s = self.gather_s + self.analyse_s + MARGIN_S
        deadline = time.monotonic() + wait_s
        value = self.keys.get(name)
        while not self._fresh(value) and time.monotonic() < deadline and not self.stopped():
            time.sleep(POLL_S)
            value = self.keys.get(name)
        if value is None or not self._fresh(value):
            why = STOPPING if self.stopped() else f"within {wait_s:.0f}s"
            log.warning(f"flight recorder: no verdict from node {lead} ({why})")
            return None
        if value.node != lead:
            log.warning(f"flight recorder: refused {self.keys.key(name)}: written by node {value.node}, not node {lead} "
                        "(the attempt's lead)")
            return None
        try:
            return SharedVerdict.from_json(value.payload, self.keys.key(name))
        except RecordError as e:
            log.warning(f"flight recorder: refused {e}")
            return None

    def _apply(self, attempt: int, verdict: SharedVerdict, attempt_dir: Path | None) -> FlightEvidence:
        log.info(f"attempt {attempt}: {verdict.text}")
        if not self.coordinator.leads(attempt):
            save_verdict(FlightVerdict(verdict.text), attempt_dir)
        self.observer.flight_recorder(verdict.suspects)
        for node in verdict.suspect_nodes if verdict.suspects else ():
            self.observer.suspect(node, "flight_recorder")
        return FlightEvidence(verdict.text, tuple(verdict.suspects), tuple(verdict.suspect_nodes))
