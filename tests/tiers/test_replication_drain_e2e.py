"""The last replication pass at exit is cut short by a signal: a scheduler's SIGTERM during the drain must
not wait out its 60 s (the kill follows the scheduler's grace, and rlsup's own stop handlers are in place)."""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import pytest
import torch

from supervisor.membership import Membership
from supervisor.tiers.replication import ReplicationEngine, ReplicationSettings
from supervisor.transport.client import PeerClient
from trainer_hooks import CheckpointManager

SECRET = b"0123456789abcdef-drain-secret"
PROMPT_S = 20.0  # a deadline on the drain's end, far below its 60 s


def test_a_stop_during_the_drain_ends_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    silent = socket.create_server(("127.0.0.1", 0))  # a peer that accepts and never answers (its host hung)
    port = silent.getsockname()[1]
    held: list[socket.socket] = []
    threading.Thread(target=lambda: held.append(silent.accept()[0]), daemon=True).start()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RLSUP_NODE_RANK", "0")
    CheckpointManager(tmp_path / "ckpt").save(3, {"w": torch.zeros(1000)})  # a part the drain must copy
    peers = ("127.0.0.1:1", f"127.0.0.1:{port}")
    peer = PeerClient(peers[1], SECRET, retries=0)
    engine = ReplicationEngine(membership=Membership(peers, 0), checkpoint_dir=tmp_path / "ckpt",
                               replica_root=tmp_path / "replicas", clients={1: peer},
                               settings=ReplicationSettings(factor=1), state_path=tmp_path / "state" / "r.json",
                               job="job")
    asked = threading.Event()
    done = threading.Event()
    threading.Thread(target=lambda: (engine.drain(60.0, stopped=asked.is_set), done.set()), daemon=True).start()
    assert not done.wait(1.0), "the drain ended before the stop: the peer answered?"
    asked.set()
    assert done.wait(PROMPT_S), "the drain went on after the stop"
    for sock in (silent, *held):  # the peer's host back (refusing): the abandoned pass ends at once
        sock.close()
    engine.stop()
    peer.close()
