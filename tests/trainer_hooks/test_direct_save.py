"""The memory tier's direct save (trainer_hooks.direct_save): the file built in a spare is byte for byte the
file ``torch.save`` writes, a plan that cannot place every tensor is refused, and a writer SIGKILLed while it
builds a step never leaves a step that verifies but does not load as what was saved."""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest
import torch

from rlsup_format.digest import hash_own_file
from rlsup_format.names import Kind, parse_reserved
from trainer_hooks.backends.base import safe_load
from trainer_hooks.direct_save import LayoutError, LayoutRecorder, build_file, new_spare, plan_layout, rebuild_payload
from trainer_hooks.snapshot import snapshot
from trainer_hooks.step_writer import build_payload


def trained_state(seed: int) -> dict:
    """A model and an optimizer after a step, plus the tensors a direct save must place with care: a view
    into a larger storage, a tensor listed twice, an empty one, integers, a non-tensor value."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    big = torch.randn(300, 200)
    extra = {"view": big[:, 7], "big": big, "same": big, "empty": torch.empty(0, 3), "ids": torch.arange(11),
             "half": torch.randn(5, dtype=torch.float16), "note": "step state", "count": 12345678901}
    return {"model": model, "optim": opt, "extra": extra}


@pytest.fixture
def no_crc32():
    """torch.save without the zip CRC32, as in the writer process (restored after)."""
    from torch.utils.serialization import config

    old = config.save.compute_crc32
    config.save.compute_crc32 = False
    yield
    config.save.compute_crc32 = old


def test_direct_file_is_byte_for_byte_torch_saves_file(tmp_path: Path, no_crc32: None) -> None:
    payload = build_payload(trained_state(1))
    skeleton, table, buf = snapshot(payload, [])
    try:
        view = memoryview(buf.map)
        rebuilt = rebuild_payload(skeleton, table, view)
        expected = io.BytesIO()
        torch.save(rebuilt, expected)
        layout = plan_layout(rebuilt, table, torch.frombuffer(buf.map, dtype=torch.uint8).data_ptr(), buf.size)
        spare = new_spare(tmp_path, 0, layout.size + 4096)
        assert parse_reserved(spare.path.name).kind is Kind.STAGING  # a killed writer's spare is a leftover
        entry = build_file(spare, layout, view, table)
        spare.close()
        os.truncate(spare.path, layout.size)
        assert spare.path.read_bytes() == expected.getvalue()
        assert entry == hash_own_file(spare.path)
        loaded = safe_load(spare.path)
        for key, value in rebuilt["extra"].items():
            same = torch.equal(loaded["extra"][key], value) if isinstance(value, torch.Tensor) else loaded["extra"][key] == value
            assert same, key
        assert all(torch.equal(loaded["model"][k], v) for k, v in payload["model"].items())
    finally:
        del view, rebuilt
        buf.close()


def test_a_plan_that_cannot_place_every_tensor_is_refused(no_crc32: None) -> None:
    payload = {"a": torch.arange(100, dtype=torch.float32), "b": torch.ones(10)}
    skeleton, table, buf = snapshot(payload, [])
    try:
        rebuilt = rebuild_payload(skeleton, table, memoryview(buf.map))
        base = torch.frombuffer(buf.map, dtype=torch.uint8).data_ptr()
        plan_layout(rebuilt, table, base, buf.size)  # the whole buffer: fine
        with pytest.raises(LayoutError):  # a tensor whose bytes lie outside the named buffer is not placed
            plan_layout(rebuilt, table, base, table[1][0])
        shifted = [(off + 64, *rest) for off, *rest in table]  # a table that does not describe the buffer
        with pytest.raises(LayoutError):
            plan_layout(rebuilt, shifted, base, buf.size)
        recorder = LayoutRecorder(base, buf.size)
        recorder.write(memoryview(buf.map)[table[0][0]:table[0][0] + 8])  # part of a tensor
        assert recorder.refs == [(0, table[0][0], 8)]
    finally:
        buf.close()


