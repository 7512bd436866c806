"""Cheap, read-only integrity checks of single files: zip archives (torch.save), safetensors, JSON.

Nothing here reads tensor payloads: a zip is checked through its central directory, a safetensors
file through its JSON header, both against the file's real length. That catches truncation (the
common failure of a killed save) in microseconds per file, but not bytes corrupted in place.
"""

from __future__ import annotations

import json
import os
import struct
import zipfile
from pathlib import Path
from typing import Any, Callable

from supervisor.layouts.record import Check

SAFETENSORS_MAX_HEADER = 100 * 1024 * 1024


def tree_size(path: Path) -> int:
    """Bytes of all regular files under ``path`` (symlinks not followed); 0 when it is gone."""
    try:
        if path.is_file():
            return path.stat().st_size
    except OSError:
        return 0
    total = 0
    stack = [str(path)]
    while stack:
        try:
            with os.scandir(stack.pop()) as it:
                for entry in it:
                    try:
                        if entry.is_dir(follow_symlinks=False):
                            stack.append(entry.path)
                        elif entry.is_file(follow_symlinks=False):
                            total += entry.stat(follow_symlinks=False).st_size
                    except OSError:
                        continue
        except OSError:
            continue
    return total


def is_dir(path: Path) -> bool:
    """``path.is_dir()`` that answers False instead of raising (a directory removed while listed)."""
    try:
        return path.is_dir()
    except OSError:
        return False


def step_dirs(root: Path, step_of: Callable[[Path], int | None],
              keep: Callable[[Path], bool] = lambda path: True) -> list[tuple[int, Path]]:
    """``(step, directory)`` of every child of ``root`` whose name ``step_of`` reads (and ``keep``
    accepts), ascending by step, then name; empty when ``root`` cannot be listed. One listing rule
    for every layout that names its steps in directory names."""
    try:
        children = list(root.iterdir())
    except OSError:
        return []
    out = [(step, child) for child in children
           if (step := step_of(child)) is not None and is_dir(child) and keep(child)]
    return sorted(out, key=lambda t: (t[0], t[1].name))


def read_json(path: Path) -> tuple[Any, str | None]:
    """(value, None) or (None, why): a torn or missing JSON file must never raise into selection."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None, f"{path.name} missing"
    except (OSError, UnicodeDecodeError) as exc:
        return None, f"{path.name} unreadable: {exc}"
    if not text.strip():
        return None, f"{path.name} is empty"
    try:
        return json.loads(text), None
    except json.JSONDecodeError as exc:
        return None, f"{path.name} is not valid JSON ({exc.msg} at char {exc.pos})"


def check_zip(path: Path) -> Check:
    """A torch.save file (zip format) is intact when its central directory reads and every member
    ends inside the file. Legacy (pre-1.6, non-zip) pickles cannot be checked without loading them."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return Check.bad(f"{path.name} missing")
    except OSError as exc:
        return Check.bad(f"{path.name} unreadable: {exc}")
    if size == 0:
        return Check.bad(f"{path.name} is empty")
    try:
        with open(path, "rb") as fh:
            magic = fh.read(4)
    except OSError as exc:
        return Check.bad(f"{path.name} unreadable: {exc}")
    if magic != b"PK\x03\x04":
        if magic[:2] == b"\x80\x02" or magic[:1] == b"\x80":
            return Check.good([f"{path.name} is a legacy (non-zip) torch pickle; truncation not checkable"])
        return Check.bad(f"{path.name} is not a zip archive (torn or foreign file)")
    try:
        with zipfile.ZipFile(path) as zf:
            infos = zf.infolist()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as exc:
        return Check.bad(f"{path.name} truncated or corrupt zip ({exc})")
    if not infos:
        return Check.bad(f"{path.name} is an empty zip")
    for info in infos:
        # local header (30 bytes + name + extra) precedes the data; the name is the lower bound
        end = info.header_offset + 30 + len(info.filename.encode()) + info.compress_size
        if end > size:
            return Check.bad(f"{path.name}: member {info.filename} runs past end of file (truncated)")
    if not any(i.filename.endswith("data.pkl") for i in infos):
        return Check.bad(f"{path.name} is a zip without data.pkl (not a torch.save archive)")
    return Check.good()


def check_safetensors(path: Path) -> Check:
    """Header-only check: the header's largest data offset must lie inside the file."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                return Check.bad(f"{path.name} truncated (no header)")
            (n,) = struct.unpack("<Q", head)
            if n <= 0 or n > SAFETENSORS_MAX_HEADER or 8 + n > size:
                return Check.bad(f"{path.name} truncated or corrupt (header length {n}, file {size} bytes)")
            header = json.loads(fh.read(n))
    except FileNotFoundError:
        return Check.bad(f"{path.name} missing")
    except (OSError, ValueError) as exc:
        return Check.bad(f"{path.name} unreadable header ({exc})")
    end = 0
    for key, meta in header.items():
        if key == "__metadata__" or not isinstance(meta, dict):
            continue
        offsets = meta.get("data_offsets") or [0, 0]
        end = max(end, int(offsets[1]))
    if 8 + n + end > size:
        return Check.bad(f"{path.name} truncated ({size} bytes, header needs {8 + n + end})")
    return Check.good()


def check_hf_dir(directory: Path, need_weights: bool) -> Check:
    """A HuggingFace export directory: every weight file the index names exists and is intact."""
    if not directory.is_dir():
        return Check.bad(f"{directory.name}/ missing")
    notes: list[str] = []
    weights: list[Path] = []
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = directory / index_name
        if index.exists():
            data, err = read_json(index)
            if err:
                return Check.bad(err)
            names = sorted(set((data or {}).get("weight_map", {}).values()))
            if not names:
                return Check.bad(f"{index_name} has an empty weight_map")
            weights.extend(directory / n for n in names)
    if not weights:
        weights = sorted(directory.glob("*.safetensors")) + sorted(directory.glob("pytorch_model*.bin"))
    if need_weights and not weights:
        return Check.bad(f"{directory.name}/ has no weight files")
    for w in weights:
        check = check_safetensors(w) if w.suffix == ".safetensors" else check_zip(w)
        if not check.ok:
            return Check.bad(f"{directory.name}/{check.reason}")
        notes.extend(check.notes)
    return Check.good(notes)
