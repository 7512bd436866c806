"""Run rlsup as if only its core dependencies were installed (``pip install .``), in this full test venv.

The core set is pyproject's ``[project] dependencies`` and what they require (their installed metadata, extras
left out), plus what ``python -m venv`` itself puts there (pip, setuptools). Every other distribution in the
venv (the test, trainers, megatron, nvrx, etcd, s3 extras, verl, ray ...) is made to look absent: a
``sitecustomize`` put first on ``PYTHONPATH`` (so rlsup, torchrun and every rank load it) replaces the import
system's path finder with one that does not find their top-level modules. ``import transformers`` then fails
as it would in a core install, and ``importlib.util.find_spec`` returns None, so optional probes (torch's
``try: import pynvml``) take their not-installed branch, as they would there. Each refused
lookup is written to a log with the module that asked, for the failure message.

What it cannot hide: ``importlib.metadata`` still lists the distributions, and a ``.pth`` file run before
``sitecustomize`` (none of a non-core distribution here) could import one early.
"""

from __future__ import annotations

import importlib.metadata as md
import functools
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from support.env import ROOT, clean_env

VENV_BOOTSTRAP = frozenset({"pip", "setuptools"})  # what `python -m venv` installs (3.11) before rlsup


@dataclass(frozen=True)
class CoreOnly:
    """The distributions of a core install, and the top-level modules the blocker refuses."""

    core: frozenset[str]  # canonical distribution names
    blocked: frozenset[str]  # top-level module names of every other installed distribution


def core_dependencies(pyproject: Path = ROOT / "pyproject.toml") -> list[str]:
    """pyproject's ``[project] dependencies``: the one list of what ``pip install .`` brings (on Python 3.10,
    which has no tomllib, the same list as the editable install recorded it)."""
    try:
        import tomllib
    except ImportError:
        return [r for r in md.requires("rlsup") or () if "extra" not in str(Requirement(r).marker or "")]
    with pyproject.open("rb") as f:
        return list(tomllib.load(f)["project"]["dependencies"])


def core_distributions(requirements: list[str]) -> frozenset[str]:
    """``requirements`` and, through the installed metadata, everything they require on this interpreter: a
    distribution's extras only where a requirement asks for them (``foo[bar]``)."""
    seen: set[tuple[str, str]] = set()  # (distribution, extra or "")
    todo = [(Requirement(r), "") for r in requirements]
    while todo:
        req, extra = todo.pop()
        name = canonicalize_name(req.name)
        if req.marker is not None and not req.marker.evaluate({"extra": extra}):
            continue
        wanted = {(name, e) for e in ("", *req.extras)} - seen
        seen |= wanted
        if not wanted:
            continue
        try:
            requires = md.requires(req.name) or []
        except md.PackageNotFoundError:
            raise AssertionError(f"core dependency {req.name} is not installed in {sys.prefix}: "
                                 "run bash scripts/setup.sh") from None
        todo.extend((Requirement(r), e) for r in requires for _, e in wanted)
    return frozenset(name for name, _ in seen)


@functools.lru_cache(maxsize=1)
def core_only() -> CoreOnly:
    """The core set from pyproject, and the top-level modules of every installed distribution outside it.

    A module name shared by a core and a non-core distribution (a namespace package) stays importable; names
    of the standard library and of this repository's own directories (some wheels ship a stray ``tests`` or
    ``scripts`` package) are never refused."""
    core = core_distributions(core_dependencies()) | VENV_BOOTSTRAP | {"rlsup"}
    blocked = {module for module, dists in md.packages_distributions().items()
               if not any(canonicalize_name(d) in core for d in dists)
               and module.isidentifier() and module not in sys.stdlib_module_names and not (ROOT / module).exists()}
    return CoreOnly(core=frozenset(core), blocked=frozenset(blocked))


SITECUSTOMIZE = '''"""Written by tests/support/core_only.py: non-core distributions look not installed."""
import importlib.machinery as _machinery
import os as _os
import sys as _sys

_BLOCKED = frozenset({blocked!r})
_LOG = {log!r}


def _asker():
    frame = _sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(("<frozen", _machinery.__file__.rsplit("/", 1)[0])):
        frame = frame.f_back
    return frame.f_globals.get("__name__", "?") if frame is not None else "?"


class _CoreOnlyPathFinder:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name.partition(".")[0] in _BLOCKED:
            with open(_LOG, "a") as log:
                log.write(f"{{name}} asked by {{_asker()}} (pid {{_os.getpid()}})\\n")
            return None
        return _machinery.PathFinder.find_spec(name, path, target)

    @staticmethod
    def invalidate_caches():
        _machinery.PathFinder.invalidate_caches()


_sys.meta_path[:] = [_CoreOnlyPathFinder if f is _machinery.PathFinder else f for f in _sys.meta_path]
'''


def core_only_env(workdir: Path, **extra: str) -> tuple[dict[str, str], Path]:
    """:func:`clean_env` with the blocker first on ``PYTHONPATH``; also the log of refused lookups."""
    site = workdir / "core-only-site"
    site.mkdir(parents=True, exist_ok=True)
    log = workdir / "core-only-refused.log"
    log.touch()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE.format(blocked=sorted(core_only().blocked), log=str(log)))
    env = clean_env(**extra)
    env["PYTHONPATH"] = str(site) + os.pathsep + env["PYTHONPATH"]
    return env, log


def refused(log: Path) -> list[str]:
    """The refused lookups so far, one line each: ``MODULE asked by IMPORTER (pid N)``."""
    return log.read_text().splitlines()
