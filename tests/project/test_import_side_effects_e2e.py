"""Importing the on-disk format package or the transport changes nothing in the importing process.

``trainer_hooks`` arms die-with-parent (``PR_SET_PDEATHSIG``) at import when ``RLSUP_HEARTBEAT_DIR``
is set; a supervisor that reached it through the transport or rlsup_format would die with whatever
started it. Each probe runs in a fresh interpreter with ``RLSUP_HEARTBEAT_DIR`` set, imports the
modules, and reports the PDEATHSIG, every signal handler that changed, and which heavy modules got
loaded. The control probe imports ``trainer_hooks`` and must see PDEATHSIG armed, so a probe that
cannot see the side effect fails instead of passing quietly.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

TRANSPORT = ["supervisor.transport", "supervisor.transport.auth", "supervisor.transport.client",
             "supervisor.transport.server", "supervisor.transport.store"]

PROBE = r"""
import ctypes, importlib, json, pkgutil, signal, sys

def pdeathsig():
    libc = ctypes.CDLL(None, use_errno=True)
    sig = ctypes.c_int(-1)
    if libc.prctl(2, ctypes.byref(sig), 0, 0, 0) != 0:  # PR_GET_PDEATHSIG
        raise OSError(ctypes.get_errno(), "prctl(PR_GET_PDEATHSIG)")
    return sig.value

def handlers():
    return {int(s): signal.getsignal(s) for s in signal.valid_signals()}

names = json.loads(sys.argv[1])
before_sig, before = pdeathsig(), handlers()
imported = []
for name in names:
    mod = importlib.import_module(name)
    imported.append(name)
    if name == "rlsup_format":  # the package and every submodule it has, present and future
        for info in pkgutil.iter_modules(mod.__path__, "rlsup_format."):
            importlib.import_module(info.name)
            imported.append(info.name)
after = handlers()
print(json.dumps({
    "imported": imported,
    "pdeathsig_before": before_sig,
    "pdeathsig": pdeathsig(),
    "changed_handlers": sorted(str(s) for s in before if after.get(s) is not before[s]),
    "loaded": sorted(m for m in ("trainer_hooks", "torch") if m in sys.modules),
}))
"""


def probe(modules: list[str], heartbeat_dir: Path) -> dict:
    env = dict(os.environ, RLSUP_HEARTBEAT_DIR=str(heartbeat_dir), PYTHONPATH=str(REPO))
    p = subprocess.run([sys.executable, "-c", PROBE, json.dumps(modules)], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.fixture
def heartbeat_dir(tmp_path: Path) -> Path:
    d = tmp_path / "hb"
    d.mkdir()
    return d


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_GET_PDEATHSIG is Linux-only")
def test_format_and_transport_imports_have_no_side_effects(heartbeat_dir: Path) -> None:
    # Control first: the probe does see the side effect (importing trainer_hooks under rlsup arms it).
    control = probe(["trainer_hooks"], heartbeat_dir)
    assert control["pdeathsig_before"] == 0
    assert control["pdeathsig"] != 0, f"trainer_hooks did not arm PR_SET_PDEATHSIG (the probe is blind): {control}"
    assert "trainer_hooks" in control["loaded"]

    out = probe(["rlsup_format", *TRANSPORT], heartbeat_dir)
    assert out["pdeathsig_before"] == 0
    assert {"rlsup_format.names", "rlsup_format.fileio", "rlsup_format.digest"} <= set(out["imported"])
    assert out["pdeathsig"] == 0, f"an import armed PR_SET_PDEATHSIG: {out}"
    assert out["changed_handlers"] == [], f"an import changed signal handlers: {out}"
    assert out["loaded"] == [], f"an import pulled in trainer_hooks/torch: {out}"
