"""The Flight Recorder records nodes share (supervisor.diagnosis.fr_records): recorded dumps of a real 4-rank hang survive
the trip and still name the rank; a ring too big for the store is cut to its newest entries; an oversized,
malformed or inflating record is refused naming the node and the key; and through a real embedded store, node 0's
verdict says which node's record it refused, and the other node reads that verdict."""

from __future__ import annotations

import base64
import json
import socket
import zlib
from pathlib import Path

import pytest

from rlsup_format.heartbeat_record import fr_dump_name
from supervisor.diagnosis.evidence import AttemptEvidence, HangSeen
from supervisor.diagnosis.outcome import classify
from supervisor.tiers.holdings import RecordError
from supervisor.cluster.embedded_store import embedded_coordinator
from supervisor.diagnosis.flight_recorder import Analysis, normalise, read_dump
from supervisor.cluster.fr_exchange import FrExchange
from supervisor.diagnosis.fr_records import MAX_INFLATED_BYTES, NodeDumps, SharedVerdict, aligned
from supervisor.job_identity import JobIdentity
from supervisor.lifecycle import EndReason
from supervisor.observer import Observer

DATA = Path(__file__).resolve().parents[1] / "data" / "flight_recorder" / "skipped_in_other_group"  # rank 2 skipped #4
KEY = "rlsup/job-a/fr/0/1"


def recorded(ranks: range) -> dict[int, dict]:
    out = {}
    for r in ranks:
        dump = read_dump(DATA / fr_dump_name(r))
        assert dump is not None
        out[r] = normalise(dump)
    return out


def test_two_nodes_records_meet_and_name_the_rank_and_its_node() -> None:
    records = [NodeDumps.from_json(NodeDumps(n, f"host{n}", recorded(range(2 * n, 2 * n + 2))).to_json(), n, KEY)
               for n in range(2)]
    assert records[1].dumps == recorded(range(2, 4)) and records[1].node_name == "host1"
    dumps = {r: d for rec in records for r, d in rec.dumps.items()}
    node_of = {r: rec.node_name for rec in records for r in rec.dumps}
    verdict = Analysis(aligned(dumps), {}, node_of, in_process=True).finish()  # node 0's analysis (there in a child)
    assert verdict.suspects == [2] and verdict.seq == 4 and verdict.op == "all_reduce", verdict.text
    assert verdict.text.endswith("suspect rank 2 on node host1"), verdict.text


def test_a_ring_too_big_is_cut_to_its_newest_entries_and_rings_are_aligned() -> None:
    dump = recorded(range(2, 3))[2]
    last = dump["entries"][-1]
    big = {**dump, "entries": [{**last, "collective_seq_id": i, "record_id": i} for i in range(3000)]}
    text = NodeDumps(1, "host1", {2: big}).to_json(max_bytes=20_000)
    assert len(text) <= 20_000
    back = NodeDumps.from_json(text, 1, KEY)
    kept = back.dumps[2]["entries"]
    assert back.kept == len(kept) and 0 < len(kept) < 3000 and kept[-1]["collective_seq_id"] == 2999
    # Per process group: a quiet group's last collectives are kept beside a busy group's.
    quiet = {**last, "process_group": ["9", "quiet"], "collective_seq_id": 7}
    mixed = {**big, "entries": [*big["entries"][:5], quiet, *big["entries"][5:]]}
    back = NodeDumps.from_json(NodeDumps(1, "host1", {2: mixed}).to_json(max_bytes=20_000), 1, KEY)
    assert back.dumps[2]["entries"][0] == quiet and len(back.dumps[2]["entries"]) == back.kept + 1
    # Nothing fits: the dumps are left out, and each rank says why.
    small = NodeDumps.from_json(NodeDumps(1, "host1", {2: big}).to_json(max_bytes=400), 1, KEY)
    assert small.dumps == {} and "left out" in small.errors[2]
    # Rings that start apart start together after alignment (per process group).
    other = {**big, "rank": 3, "entries": big["entries"][-10:]}
    out = aligned({2: {**big, "entries": big["entries"][-12:]}, 3: other})
    assert [e["collective_seq_id"] for e in out[2]["entries"]] == list(range(2990, 3000))


def _packed(obj: object) -> str:
    return base64.b64encode(zlib.compress(json.dumps(obj).encode())).decode()


def _record(**change: object) -> str:
    good = json.loads(NodeDumps(1, "host1", recorded(range(2, 3))).to_json())
    return json.dumps({**good, **change})


@pytest.mark.parametrize("text, problem", [
    ("x" * 2_000_000, "over the 1000000 allowed"),
    ("{not json", "not JSON"),
    (_record(node=3), "says node 3"),
    (_record(format=9), "not format 1"),
    (_record(dumps="@@not base64@@"), "does not unpack"),
    (_record(dumps=_packed({"2": {"rank": 5}})), "dumps.2: not this rank's dump"),
    (_record(dumps=_packed({"two": {}})), "'two' is not a rank"),
    (_record(errors={"2": 7}), "errors.2: not a short text"),
    ("[" * 100_000, "not JSON"),  # nested too deep: RecursionError, refused like any other non-JSON
    (_record(dumps=base64.b64encode(zlib.compress(b"[" * 100_000)).decode()), "dumps: does not unpack"),
    (_record(node_name="host1\x1b[2J"), "node_name: not a node name"),
    (_record(node_name="a/b"), "node_name: not a node name"),
])
def test_a_bad_record_is_refused_naming_node_and_key(text: str, problem: str) -> None:
    with pytest.raises(RecordError) as e:
        NodeDumps.from_json(text, 1, KEY)
    assert f"node 1's flight recorder record {KEY}" in str(e.value) and problem in str(e.value), str(e.value)


def test_a_bad_entry_and_a_record_that_inflates_too_far_are_refused() -> None:
    dump = recorded(range(2, 3))[2]
    bad = {**dump, "entries": [*dump["entries"][:-1], {**dump["entries"][-1], "collective_seq_id": "4"}]}
    with pytest.raises(RecordError, match=r"dumps\.2\.entries\[\d+\]\.collective_seq_id: not a sequence number"):
        NodeDumps.from_json(_record(dumps=_packed({"2": bad})), 1, KEY)
    bomb = base64.b64encode(zlib.compress(b" " * (MAX_INFLATED_BYTES + 10), 9)).decode()
    assert len(bomb) < 200_000
    with pytest.raises(RecordError, match="inflates past"):
        NodeDumps.from_json(_record(dumps=bomb), 1, KEY)


@pytest.mark.parametrize("cfg, problem", [
    ({"name": "0", "desc": "default_pg", "ranks": repr("__import__('os').system('true')")}, "not a list of ranks"),
    ({"name": "0", "desc": "default_pg", "ranks": "[0, 1 + 1]"}, "not a JSON list"),
    ({"name": "0", "desc": "default_pg", "ranks": "[0, 2097152]"}, "not a list of ranks in [0, 1048576]"),
    ({"name": "0", "desc": "x" * 300, "ranks": "[0]"}, "desc is not a short printable text"),
    ({"name": "0\n", "desc": "", "ranks": "[0]"}, "name is not a short printable text"),
])
def test_a_process_group_config_torch_would_eval_is_refused(cfg: dict, problem: str) -> None:
    """torch's analyser literal_evals ``ranks`` and then evals a string result: another node's record carries
    only ranks that parse as a JSON list of ranks, written back by rlsup itself."""
    dump = recorded(range(2, 3))[2]
    bad = {**dump, "pg_config": {**dump["pg_config"], "0": cfg}}
    with pytest.raises(RecordError, match=r"dumps\.2\.pg_config\.0: not a process group's config") as e:
        NodeDumps.from_json(_record(dumps=_packed({"2": bad})), 1, KEY)
    assert problem in str(e.value), str(e.value)
    odd = {**dump, "pg_config": {**dump["pg_config"], "0": {**dump["pg_config"]["0"], "ranks": "[3,2, 3]"}}}
    back = NodeDumps.from_json(_record(dumps=_packed({"2": odd})), 1, KEY)
    assert back.dumps[2]["pg_config"]["0"]["ranks"] == "[2, 3]"  # rlsup's own text goes on, not the rank's


def test_shared_verdict_round_trip_and_refusals() -> None:
    v = SharedVerdict("flight recorder: ... suspect rank 2 on node host1", [2], ["host1"], 4, "all_reduce")
    assert SharedVerdict.from_json(v.to_json(), "k") == v
    for change, field in [({"suspects": ["2"]}, "suspects"), ({"text": ""}, "text"), ({"seq": -1}, "seq"),
                          ({"suspect_nodes": [""]}, "suspect_nodes"), ({"suspect_nodes": ["a b"]}, "suspect_nodes"),
                          ({"suspect_nodes": ["x" * 256]}, "suspect_nodes")]:
        with pytest.raises(RecordError, match=f"node 0's flight recorder record k: {field}"):
            SharedVerdict.from_json(json.dumps({**json.loads(v.to_json()), **change}), "k")


def test_node_0_refuses_a_malformed_record_says_so_and_every_node_reads_its_verdict() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    job = JobIdentity("job-a", "test")
    coords = [embedded_coordinator("127.0.0.1", port, job, b"0123456789abcdef-shared", n, 2, 10) for n in range(2)]
    coords[1].keys.create("fr/0/want", "1")
    coords[1].keys.set("fr/0/1", "{not json")  # a node of another version, or a damaged store
    results = []
    for n in range(2):  # node 0 judges first; node 1 then reads the verdict it published
        shared = FrExchange(coords[n], n, 2, f"host{n}", Observer(), gather_s=5, analyse_s=5).settle(0)
        results.append(classify(AttemptEvidence(0, HangSeen(EndReason.HANG, ""), shared_flight=shared)))
    text = results[0].fr_verdict
    assert text.startswith("flight recorder: no dumps") and f"node 1's flight recorder record {KEY}" in text, text
    assert results[1].fr_verdict == text and results[1].suspect_ranks == []
