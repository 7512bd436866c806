"""Every name rlsup gives an entry on disk, and the parser for each: one scheme, one place.

Final names::

    step_000000100/                 a step (9+ digits)
        manifest.rank_00000.json    rank 0's manifest, written last
        .rlsup-placement.node1.json where node 1's replication pushed the parts it owns

Reserved names all start with a dot and have one shape, ``.<kind>-[<label>-]<host>-<pid>-<token>``:

* ``kind`` (:class:`Kind`): what the entry is (a save in progress, a temp file, a step being
  deleted, a hold marker);
* ``label``: free text for people and for the owner's own rules (``rank_00001``, ``step_000000100``,
  ``persistent``); may contain ``-``;
* ``host`` and ``pid``: the writer (``host`` is the host name and PID namespace, :func:`host_tag`). A
  later process with the same ``host`` may remove the entry when that pid is gone; elsewhere only
  age tells (:mod:`rlsup_format.leftovers`);
* ``token``: random hex, so two writers never collide.

Names beginning with a dot are never steps, manifests or data files of a manifest's owner process.
"""

from __future__ import annotations

import enum
import os
import re
import secrets
from dataclasses import dataclass
from functools import lru_cache

STEP_DIR_RE = re.compile(r"^step_(\d{9,})$")
MANIFEST_RE = re.compile(r"^manifest\.rank_(\d{5,})\.json$")
PLACEMENT_RE = re.compile(r"^\.rlsup-placement\.node(\d+)\.json$")
PLACEMENT_GLOB = ".rlsup-placement.node*.json"  # every node's placement record in a step directory


def step_dir_name(step: int) -> str:
    return f"step_{step:09d}"


def manifest_name(rank: int) -> str:
    return f"manifest.rank_{rank:05d}.json"


def placement_name(node: int) -> str:
    """Node ``node``'s record of where it pushed its parts of a step (a file in the step directory)."""
    return f".rlsup-placement.node{node}.json"


def parse_step(name: str) -> int | None:
    m = STEP_DIR_RE.match(name)
    return int(m.group(1)) if m else None


def parse_manifest_rank(name: str) -> int | None:
    m = MANIFEST_RE.match(name)
    return int(m.group(1)) if m else None


class Kind(enum.Enum):
    """What a reserved entry is."""

    STAGING = "staging"    # a directory a rank saves into before its files get their final names
    TMP = "tmp"            # a file written (copied, fetched, a manifest) before it is renamed into place
    INCOMING = "incoming"  # a directory a copy lands in before it is renamed into place
    DELETING = "deleting"  # a step renamed out of the step namespace, being removed
    HOLD = "hold"          # a marker in a step directory: retention must keep the step


@dataclass(frozen=True)
class Reserved:
    """A parsed reserved name."""

    kind: Kind
    label: str
    host: str
    pid: int
    token: str

    def mine(self) -> bool:
        """Written by this very process."""
        return self.host == host_tag() and self.pid == os.getpid()


@lru_cache(maxsize=1)
def host_tag() -> str:
    """Where a pid means something: this machine's name and its PID namespace (containers that share a
    host name, e.g. with host networking, do not share pids), safe as one field of a reserved name
    (no '-', which separates fields)."""
    name = "".join(c if c.isalnum() else "_" for c in os.uname().nodename)[:40] or "host"
    try:
        return f"{name}_ns{os.stat('/proc/self/ns/pid').st_ino:x}"
    except OSError:  # no /proc: the host name alone
        return name


def reserved_name(kind: Kind, label: str = "") -> str:
    """A fresh reserved name of ``kind`` for this process (unique: a random token)."""
    if "/" in label or "\0" in label:
        raise ValueError(f"label {label!r} must not contain '/' or NUL")
    middle = f"{label}-" if label else ""
    return f".{kind.value}-{middle}{host_tag()}-{os.getpid()}-{secrets.token_hex(4)}"


_KINDS = {k.value: k for k in Kind}


def parse_reserved(name: str) -> Reserved | None:
    """The fields of a reserved name, or None for any other name."""
    if not name.startswith("."):
        return None
    fields = name[1:].split("-")
    if len(fields) < 4 or fields[0] not in _KINDS:
        return None
    host, pid, token = fields[-3:]
    if not pid.isdigit() or not token or not host:
        return None
    return Reserved(_KINDS[fields[0]], "-".join(fields[1:-3]), host, int(pid), token)


def hold_prefix() -> str:
    """Every hold marker starts with this; :func:`rlsup_format.manifest.is_held` looks for it."""
    return f".{Kind.HOLD.value}-"


def staging_label(rank: int) -> str:
    return f"rank_{rank:05d}"
