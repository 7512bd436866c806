"""Each backend round-trips model, optimizer, scheduler, plain values and RNG through CheckpointManager."""

from __future__ import annotations

import sys

import pytest
import torch

from trainer_hooks.backends import available_backends, get_backend
from trainer_hooks.checkpoint import CheckpointManager
from rlsup_format.manifest import latest_valid


def job(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.BatchNorm1d(5), torch.nn.Linear(5, 2))
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(optim, T_max=10)
    return {"model": model, "optim": optim, "sched": sched, "meta": {"name": "run", "ids": [1, 2]}}


def step(state):
    loss = state["model"](torch.randn(4, 3)).sum()
    state["optim"].zero_grad()
    loss.backward()
    state["optim"].step()
    state["sched"].step()


def assert_same(a, b):
    for (ka, va), (kb, vb) in zip(a["model"].state_dict().items(), b["model"].state_dict().items()):
        assert ka == kb and torch.equal(va, vb), ka
    sa, sb = a["optim"].state_dict(), b["optim"].state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    for i in sa["state"]:
        for k in sa["state"][i]:
            assert torch.equal(sa["state"][i][k], sb["state"][i][k])
    assert a["sched"].state_dict() == b["sched"].state_dict()
    assert a["meta"] == b["meta"]


def round_trip(tmp_path, backend):
    src = job(0)
    step(src)
    step(src)
    src["meta"] = {"name": "trained", "ids": [3]}
    mgr = CheckpointManager(tmp_path, backend=backend)
    mgr.save(2, src)
    expected_draw = torch.rand(4)
    result = latest_valid(tmp_path)
    assert result is not None and result.step == 2
    dst = job(1)  # different init, optimizer state still empty (lazily created)
    assert CheckpointManager(tmp_path, backend=backend).restore(dst) == 2
    assert_same(src, dst)
    assert torch.equal(torch.rand(4), expected_draw)
    torch.manual_seed(5)
    step(src)
    torch.manual_seed(5)
    step(dst)  # training continues identically (restored optimizer moments and schedule)
    assert_same(src, dst)
    return result.path


def test_registry():
    assert available_backends() == ["dcp", "megatron", "torch"]
    assert get_backend("torch").name == "torch"
    with pytest.raises(ValueError):
        get_backend("pickle")


def test_torch_backend_round_trip(tmp_path):
    path = round_trip(tmp_path, "torch")
    assert sorted(p.name for p in path.iterdir()) == ["manifest.rank_00000.json", "rank_00000.pt"]


def test_dcp_backend_round_trip(tmp_path):
    path = round_trip(tmp_path, "dcp")
    names = sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file())
    assert "dcp/.metadata" in names and "rank_00000.extra.pt" in names
    assert any(n.startswith("dcp/__0_") and n.endswith(".distcp") for n in names)


def test_restore_uses_the_backend_recorded_in_the_manifest(tmp_path):
    src = job(0)
    step(src)
    CheckpointManager(tmp_path, backend="dcp").save(1, src)
    dst = job(1)
    CheckpointManager(tmp_path, backend="torch").restore(dst)
    assert_same(src, dst)


def test_megatron_missing_gives_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "megatron", None)
    monkeypatch.setitem(sys.modules, "megatron.core", None)
    with pytest.raises(ImportError, match=r"pip install rlsup\[megatron\]"):
        get_backend("megatron")
