"""``rlsup checkpoints list|latest|verify``: the layout catalogue on the command line.

``latest`` prints the chosen path on the last line of stdout so scripts can take ``| tail -n1``;
everything diagnostic goes to stderr. Single-file checkpoints (``--layout single-file --file GLOB``, or
found by ``auto`` as ``rlsup run`` finds them) are read by the code ``rlsup run`` resumes with
(:mod:`supervisor.layouts.single_file`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from supervisor import layouts
from supervisor.layouts import single_file

LAYOUT_CHOICES = ("auto", *layouts.LAYOUT_NAMES, single_file.NAME)


def _human(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def _line(r: layouts.CheckpointRecord) -> str:
    state = "valid" if r.valid else f"INVALID: {r.reason}"
    step = "-" if r.step < 0 else str(r.step)  # a single file whose name holds no number
    return f"{step:>10}  {r.layout:<12} {_human(r.size_bytes):>10}  {r.path}  {state}"


def single_file_pattern(root: Path, layout: str, pattern: str | None) -> str | None:
    """The ``--file`` pattern ("" for the default files) when ``root`` is read as single-file checkpoints,
    as ``rlsup run`` reads it (``single-file``, or ``auto`` while no layout recognises it); None: a layout's
    steps. ValueError for ``--file`` beside another layout."""
    if layout == single_file.NAME or (layout == "auto" and layouts.detect_layout(root) == "unknown"):
        return pattern or ""
    if pattern:
        raise ValueError(f"--file names single-file checkpoints, but {root} is read as layout "
                         f"{layouts.detect_layout(root) if layout == 'auto' else layout} (pass --layout single-file)")
    return None


def _not_found(root: Path) -> str:
    return (f"no checkpoints recognised in {root} (tried the layouts {', '.join(layouts.LAYOUT_NAMES)} and single "
            f"files: top-level {', '.join('*' + s for s in single_file.SUFFIXES)}, or one per step directory; "
            "name other files with --file GLOB)")


def cmd_list(args: argparse.Namespace) -> int:
    root = Path(args.dir)
    try:
        pattern = single_file_pattern(root, args.layout, args.file)
        records = layouts.scan(root, args.layout) if pattern is None else single_file.scan(root, pattern)
    except ValueError as exc:
        print(f"rlsup checkpoints: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([r.to_json() for r in records], indent=2))
        return 0
    from supervisor.run.quarantine import quarantined

    moved = quarantined(root)
    if not records and not moved:
        print(_not_found(root), file=sys.stderr)
        return 0
    for r in records:
        print(_line(r))
    for path in moved:
        print(f"{'-':>10}  {'quarantined':<12} {_human(layouts.files.tree_size(path)):>10}  {path}  "
              "INVALID, moved aside by quarantine_invalid (mv it back only if you know it is good)")
    return 0


def cmd_latest(args: argparse.Namespace) -> int:
    root = Path(args.dir)
    try:
        pattern = single_file_pattern(root, args.layout, args.file)
    except ValueError as exc:
        print(f"rlsup checkpoints: {exc}", file=sys.stderr)
        return 2
    if pattern is not None:
        return _latest_single_file(root, pattern)
    try:
        record = layouts.latest_valid(root, args.layout)
    except ValueError as exc:
        print(f"rlsup checkpoints: {exc}", file=sys.stderr)
        return 2
    status = layouts.tracker_status(root)
    if status.tracker is not None and not status.ok:
        print(f"tracker: {status.describe()}", file=sys.stderr)
        if args.repair_tracker and record is not None:
            try:
                path = layouts.repair_tracker(root, record.step)
            except (ValueError, OSError) as exc:
                print(f"tracker not repaired: {exc}", file=sys.stderr)
                return 1
            print(f"tracker: rewrote {path} -> {record.step} (old kept as {path.name}.rlsup-prev)", file=sys.stderr)
    elif args.repair_tracker and status.tracker is None:
        print("tracker: none to repair", file=sys.stderr)
    if record is None:
        print(f"no valid checkpoint in {root}", file=sys.stderr)
        return 1
    print(str(record.path))
    return 0


def _latest_single_file(root: Path, pattern: str) -> int:
    """The newest complete single file (what ``rlsup run`` resumes from); newer torn ones named on stderr."""
    for torn in single_file.torn_newest(root, pattern):
        print(f"newer but torn: {torn.path} ({torn.reason})", file=sys.stderr)
    record = single_file.latest_valid(root, pattern)
    if record is None:
        found = single_file.checkpoint_files(root, pattern)
        print(f"no valid checkpoint in {root}" if found else _not_found(root), file=sys.stderr)
        return 1
    print(str(record.path))
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    record = layouts.verify_path(args.path)
    path = Path(args.path)
    if record.layout == "unknown" and path.is_file() and not path.is_symlink():  # a single-file checkpoint
        record = single_file.record_of(path.parent, path)
    for note in record.notes:
        print(f"note: {note}", file=sys.stderr)
    if record.valid:
        print(f"valid: step {record.step} ({record.layout}) {record.path}")
        return 0
    print(f"invalid: {record.reason}")
    return 1


FILE_HELP = ("single-file checkpoints: the file(s), a name or glob relative to DIR (rlsup run's --checkpoint-file; "
             "default: top-level *.pt/*.pth/*.ckpt/*.safetensors, else one per step directory)")


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="checkpoints_cmd", metavar="{list,latest,verify}")
    sub.required = True
    p = sub.add_parser("list", help="every step with its layout, validity and size")
    p.add_argument("dir")
    p.add_argument("--layout", default="auto", choices=LAYOUT_CHOICES)
    p.add_argument("--json", action="store_true", help="machine-readable records")
    p.add_argument("--file", default="", metavar="GLOB", help=FILE_HELP)
    p.set_defaults(func=cmd_list)
    p = sub.add_parser("latest", help="print the newest valid step's path (last stdout line); exit 1 if none")
    p.add_argument("dir")
    p.add_argument("--layout", default="auto", choices=LAYOUT_CHOICES)
    p.add_argument("--repair-tracker", action="store_true", help="point a lying tracker at the newest valid step")
    p.add_argument("--file", default="", metavar="GLOB", help=FILE_HELP)
    p.set_defaults(func=cmd_latest)
    p = sub.add_parser("verify", help="exit 0 only when PATH is a valid checkpoint step")
    p.add_argument("path")
    p.set_defaults(func=cmd_verify)


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``checkpoints`` to the main ``rlsup`` parser."""
    parser = subparsers.add_parser("checkpoints", help="list, pick and verify checkpoints (every layout rlsup run reads, single files included)")
    _add_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlsup")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
