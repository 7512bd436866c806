"""The Flight Recorder records nodes share through the coordination store (:mod:`supervisor.cluster.fr_exchange`).

:class:`NodeDumps` carries one node's ranks' dumps (in the shape torch's analyser takes,
:func:`supervisor.diagnosis.flight_recorder.normalise`) to node 0; :class:`SharedVerdict` carries node 0's verdict
back to every node. A full FR ring is about 1 MB of JSON per rank and etcd refuses values over about
1.5 MB, so a node sends only the newest entries of each rank (:data:`KEEP_ENTRIES`, fewer where the
record would still be too big), compressed, in one value of at most :data:`MAX_RECORD_BYTES`.

What another node wrote is validated before use: a record that is oversized, does not inflate within
:data:`MAX_INFLATED_BYTES`, or lacks a field rlsup's own reading of the entries needs is refused with a
:class:`~supervisor.tiers.holdings.RecordError` naming the node and the key. The fields only torch's
analyser reads are its business: it runs in a child whose failure is a verdict that says so.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import zlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Mapping

from supervisor.tiers.holdings import RecordError
from supervisor.diagnosis.fr_config import clean_pg

FORMAT = 1
#: The most one node's record may take in the store (etcd's default request limit is about 1.5 MB; the
#: signature wraps it in a little more).
MAX_RECORD_BYTES = 1_000_000
#: The most a record may inflate to (a record that inflates past it is refused, not read further).
MAX_INFLATED_BYTES = 32 << 20
#: Entries sent per rank and process group at first: a hang's collective and the few hundred before it
#: (halved until the record fits).
KEEP_ENTRIES = 256
MIN_ENTRIES = 4
MAX_RANKS = 1 << 16  # ranks in one node's record
MAX_RANK = 1 << 24
MAX_ENTRIES = 1 << 16  # entries of one rank as read
MAX_TEXT = 8000  # a verdict's text
MAX_NAME = 256  # a node name, an op, a process group's text
#: A node's name as records carry it: a host name's letters (it is shown in verdicts and logs).
NODE_NAME = re.compile(r"[A-Za-z0-9._-]{1,255}")


def _refuse(node: int | None, key: str, where: str, problem: str) -> RecordError:
    return RecordError(node, f"flight recorder record {key}", where, problem)


@dataclass
class NodeDumps:
    """One node's ranks' FR dumps: ``dumps`` rank -> normalised dump, ``errors`` rank -> why it gave none."""

    node: int
    node_name: str
    dumps: dict[int, dict[str, Any]] = field(default_factory=dict)
    errors: dict[int, str] = field(default_factory=dict)
    kept: int | None = None  # entries kept per rank (None: every entry fitted)

    def to_json(self, max_bytes: int = MAX_RECORD_BYTES) -> str:
        """The record, each rank's ring cut to its newest entries until it fits ``max_bytes``; past
        :data:`MIN_ENTRIES` the dumps are left out and each rank's error says why."""
        longest = max((n for d in self.dumps.values() for n in Counter(map(_group, d["entries"])).values()), default=0)
        keep = KEEP_ENTRIES if longest > KEEP_ENTRIES else None
        while True:
            dumps = {str(r): {**d, "entries": newest(d["entries"], keep)} for r, d in self.dumps.items()}
            text = self._encode(dumps, self.errors, keep)
            if len(text) <= max_bytes or not self.dumps:
                self.kept = keep
                return text
            keep = min(keep or KEEP_ENTRIES, longest) // 2
            if keep < MIN_ENTRIES:
                errors = {**self.errors, **{r: f"dump left out: over {max_bytes} bytes" for r in self.dumps}}
                return self._encode({}, errors, 0)

    def _encode(self, dumps: Mapping[str, Any], errors: Mapping[int, str], keep: int | None) -> str:
        packed = base64.b64encode(zlib.compress(json.dumps(dumps).encode(), 6)).decode()
        return json.dumps({"format": FORMAT, "node": self.node, "node_name": self.node_name, "kept": keep,
                           "errors": {str(r): e[:MAX_NAME] for r, e in errors.items()}, "dumps": packed})

    @classmethod
    def from_json(cls, text: str, node: int, key: str, max_bytes: int = MAX_RECORD_BYTES) -> "NodeDumps":
        """Node ``node``'s record read from ``key``; :class:`RecordError` (naming both) if it is not one."""
        if len(text) > max_bytes:
            raise _refuse(node, key, "", f"{len(text)} bytes, over the {max_bytes} allowed")
        try:
            d = json.loads(text)
        except (ValueError, RecursionError) as e:  # RecursionError: nested too deep for the parser
            raise _refuse(node, key, "", f"not JSON ({type(e).__name__}: {e})") from e
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise _refuse(node, key, "format", f"not format {FORMAT}")
        if d.get("node") != node:
            raise _refuse(node, key, "node", f"says node {d.get('node')!r}")
        name, kept = d.get("node_name"), d.get("kept")
        if not _is_node_name(name):
            raise _refuse(node, key, "node_name", "not a node name (1-255 of A-Z a-z 0-9 . _ -)")
        if kept is not None and not _is_int(kept, 0, MAX_ENTRIES):
            raise _refuse(node, key, "kept", "not a count")
        errors = _errors(d.get("errors"), node, key)
        dumps = _dumps(_inflate(d.get("dumps"), node, key), node, key)
        return cls(node, name, dumps, errors, kept)


def newest(entries: list[Any], keep: int | None) -> list[Any]:
    """The newest ``keep`` entries of each process group, in ring order (all where ``keep`` is None): a
    quiet group's last collectives stay beside a busy group's, and the hang is in the newest of either."""
    if keep is None:
        return list(entries)
    seen: Counter[str] = Counter()
    out = []
    for entry in reversed(entries):
        group = _group(entry)
        seen[group] += 1
        if seen[group] <= keep:
            out.append(entry)
    return out[::-1]


def _group(entry: Any) -> str:
    """An entry's process group name (a rank's own dump: read as JSON, never trusted to be well formed)."""
    pg = entry.get("process_group") if isinstance(entry, dict) else None
    return str(pg[0]) if isinstance(pg, list) and pg else ""


def _is_node_name(value: Any) -> bool:
    return isinstance(value, str) and NODE_NAME.fullmatch(value) is not None


def _is_int(value: Any, low: int, high: int) -> bool:
    return type(value) is int and low <= value <= high  # a JSON integer (bool is not one here)


def _rank_key(key: Any, node: int, rkey: str, where: str) -> int:
    if not isinstance(key, str) or not key.isdigit() or len(key) > 8 or int(key) > MAX_RANK:
        raise _refuse(node, rkey, where, f"{key!r} is not a rank")
    return int(key)


def _errors(raw: Any, node: int, key: str) -> dict[int, str]:
    if not isinstance(raw, dict) or len(raw) > MAX_RANKS:
        raise _refuse(node, key, "errors", "not a map of ranks")
    out = {}
    for r, e in raw.items():
        if not isinstance(e, str) or len(e) > MAX_NAME:
            raise _refuse(node, key, f"errors.{r}", "not a short text")
        out[_rank_key(r, node, key, "errors")] = e
    return out


def _inflate(packed: Any, node: int, key: str) -> Any:
    if not isinstance(packed, str):
        raise _refuse(node, key, "dumps", "not a packed text")
    try:
        inflater = zlib.decompressobj()
        body = inflater.decompress(base64.b64decode(packed, validate=True), MAX_INFLATED_BYTES)
        if inflater.unconsumed_tail:
            raise _refuse(node, key, "dumps", f"inflates past {MAX_INFLATED_BYTES} bytes")
        return json.loads(body)
    except RecursionError as e:  # nested too deep for the parser: not JSON rlsup reads
        raise _refuse(node, key, "dumps", "does not unpack (not JSON: nested too deep)") from e
    except (binascii.Error, zlib.error, ValueError) as e:
        raise _refuse(node, key, "dumps", f"does not unpack ({e})") from e


def _dumps(raw: Any, node: int, key: str) -> dict[int, dict[str, Any]]:
    if not isinstance(raw, dict) or len(raw) > MAX_RANKS:
        raise _refuse(node, key, "dumps", "not a map of ranks")
    out = {}
    for r, dump in raw.items():
        rank = _rank_key(r, node, key, "dumps")
        where = f"dumps.{rank}"
        if not isinstance(dump, dict) or dump.get("rank") != rank:
            raise _refuse(node, key, where, "not this rank's dump")
        if not isinstance(dump.get("version"), str) or not isinstance(dump.get("pg_config"), dict):
            raise _refuse(node, key, where, "no version or pg_config")
        for pg, cfg in list(dump["pg_config"].items()):
            try:  # torch's analyser evals ``ranks``: only a config rebuilt from checked values goes on
                dump["pg_config"][pg] = clean_pg(pg, cfg)
            except ValueError as e:
                raise _refuse(node, key, f"{where}.pg_config.{str(pg)[:MAX_NAME]}",
                              f"not a process group's config ({e})") from e
        entries = dump.get("entries")
        if not isinstance(entries, list) or len(entries) > MAX_ENTRIES:
            raise _refuse(node, key, f"{where}.entries", f"not a list of at most {MAX_ENTRIES} entries")
        for i, entry in enumerate(entries):
            _check_entry(entry, node, key, f"{where}.entries[{i}]")
        out[rank] = dump
    return out


def _check_entry(entry: Any, node: int, key: str, where: str) -> None:
    """The fields rlsup itself reads of an entry (supervisor.diagnosis.flight_recorder's describe and fallback)."""
    if not isinstance(entry, dict):
        raise _refuse(node, key, where, "not an object")
    pg = entry.get("process_group")
    if not isinstance(pg, list) or not pg or not all(isinstance(p, str) for p in pg):
        raise _refuse(node, key, f"{where}.process_group", "not [name, desc]")
    if not _is_int(entry.get("collective_seq_id"), 0, 1 << 62):
        raise _refuse(node, key, f"{where}.collective_seq_id", "not a sequence number")
    if not isinstance(entry.get("profiling_name", ""), str) or not isinstance(entry.get("state", ""), str):
        raise _refuse(node, key, f"{where}.profiling_name", "not a text")
    if not isinstance(entry.get("is_p2p", False), bool) or not isinstance(entry.get("retired", False), bool):
        raise _refuse(node, key, f"{where}.is_p2p", "not a flag")


@dataclass
class SharedVerdict:
    """Node 0's verdict over every node's dumps, as each node's incident shows it."""

    text: str
    suspects: list[int] = field(default_factory=list)
    suspect_nodes: list[str] = field(default_factory=list)
    seq: int | None = None
    op: str = ""

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, "text": self.text[:MAX_TEXT], "suspects": self.suspects[:MAX_RANKS],
                           "suspect_nodes": [n[:MAX_NAME] for n in self.suspect_nodes[:MAX_RANKS]],
                           "seq": self.seq, "op": self.op[:MAX_NAME]})

    @classmethod
    def from_json(cls, text: str, key: str, node: int = 0) -> "SharedVerdict":
        if len(text) > 2 * MAX_TEXT + MAX_RANKS * (MAX_NAME + 16):
            raise _refuse(node, key, "", f"{len(text)} bytes, too long for a verdict")
        try:
            d = json.loads(text)
        except (ValueError, RecursionError) as e:  # RecursionError: nested too deep for the parser
            raise _refuse(node, key, "", f"not JSON ({type(e).__name__}: {e})") from e
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise _refuse(node, key, "format", f"not format {FORMAT}")
        body, op, seq = d.get("text"), d.get("op"), d.get("seq")
        suspects, nodes = d.get("suspects"), d.get("suspect_nodes")
        if not isinstance(body, str) or not body or len(body) > MAX_TEXT:
            raise _refuse(node, key, "text", "not a verdict's text")
        if not isinstance(suspects, list) or not all(_is_int(r, 0, MAX_RANK) for r in suspects):
            raise _refuse(node, key, "suspects", "not a list of ranks")
        if not isinstance(nodes, list) or not all(_is_node_name(n) for n in nodes):
            raise _refuse(node, key, "suspect_nodes", "not a list of node names (1-255 of A-Z a-z 0-9 . _ -)")
        if seq is not None and not _is_int(seq, 0, 1 << 62):
            raise _refuse(node, key, "seq", "not a sequence number")
        if not isinstance(op, str) or len(op) > MAX_NAME:
            raise _refuse(node, key, "op", "not an op's name")
        return cls(body, suspects, nodes, seq, op)


def aligned(dumps: Mapping[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """The dumps with each process group's collectives from the first sequence number every rank still
    holds: rings cut to their newest entries start apart (a rank that skipped one is a number behind), and
    torch's analyser would take an entry only one rank still has for a collective the others missed."""
    start: dict[str, int] = {}
    for d in dumps.values():
        first: dict[str, int] = {}
        for e in d["entries"]:
            if not e.get("is_p2p"):
                pg = e["process_group"][0]
                first[pg] = min(first.get(pg, e["collective_seq_id"]), e["collective_seq_id"])
        for pg, seq in first.items():
            start[pg] = max(start.get(pg, seq), seq)
    return {r: {**d, "entries": [e for e in d["entries"] if e.get("is_p2p")
                                 or e["collective_seq_id"] >= start[e["process_group"][0]]]}
            for r, d in dumps.items()}
