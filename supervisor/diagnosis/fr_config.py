"""A process group's ``pg_config`` from a Flight Recorder dump, made safe for torch's analyser.

Why: torch's ``build_groups_memberships`` runs ``ast.literal_eval(ranks)`` and then ``eval()`` on the result
when it is a string, so a dump (written by the job's processes) whose ``ranks`` is a quoted expression would
run code in the analyser. rlsup hands the analyser only ``ranks`` it parsed itself as a JSON list of ints
and wrote back as ``json.dumps`` of the sorted set, and short printable ``desc``/``name``.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

#: The largest global rank accepted in a process group's ``ranks``.
MAX_RANK = 1 << 20
#: The longest ``desc`` or ``name`` of a process group (and its key).
MAX_PG_TEXT = 256


def pg_ranks(value: Any) -> str:
    """``value`` (a JSON list of ranks as text) as ``json.dumps`` of its sorted set; ValueError otherwise."""
    if not isinstance(value, str) or len(value) > 16 * (MAX_RANK + 1):
        raise ValueError("ranks is not a text")
    try:
        ranks = json.loads(value)
    except (ValueError, RecursionError) as e:
        raise ValueError(f"ranks is not a JSON list ({type(e).__name__})") from e
    if not isinstance(ranks, list) or not all(type(r) is int and 0 <= r <= MAX_RANK for r in ranks):
        raise ValueError(f"ranks is not a list of ranks in [0, {MAX_RANK}]")
    return json.dumps(sorted(set(ranks)))


def _short_text(value: Any, what: str) -> str:
    if not isinstance(value, str) or len(value) > MAX_PG_TEXT or not value.isprintable():
        raise ValueError(f"{what} is not a short printable text")
    return value


def clean_pg(name: Any, cfg: Any) -> dict[str, str]:
    """One group's config (``{name, desc, ranks}``) rebuilt from checked values; ValueError saying which."""
    _short_text(name, "the group's key")
    if not isinstance(cfg, Mapping):
        raise ValueError("not an object")
    return {"name": _short_text(cfg.get("name", ""), "name"), "desc": _short_text(cfg.get("desc", ""), "desc"),
            "ranks": pg_ranks(cfg.get("ranks"))}


def clean_pg_config(raw: Any) -> tuple[dict[str, dict[str, str]], list[str]]:
    """Every group of ``raw`` that passes :func:`clean_pg` (rebuilt), and ``"<key>: why"`` for each dropped."""
    out: dict[str, dict[str, str]] = {}
    dropped: list[str] = []
    for name, cfg in (raw.items() if isinstance(raw, Mapping) else ()):
        try:
            out[name] = clean_pg(name, cfg)
        except ValueError as e:
            dropped.append(f"pg_config.{str(name)[:MAX_PG_TEXT]!r}: {e}")
    return out, dropped
