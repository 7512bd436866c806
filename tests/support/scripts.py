"""The repository's scripts/ loaded as modules, so a fast test calls their ``main`` in its own process."""

from __future__ import annotations

import importlib.util
from types import ModuleType

from support.env import ROOT


def script(name: str) -> ModuleType:
    """``scripts/<name>.py`` imported under its own name (scripts/ is no package)."""
    spec = importlib.util.spec_from_file_location(f"scripts_{name}", ROOT / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None, name
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
