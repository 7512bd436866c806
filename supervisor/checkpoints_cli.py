"""``rlsup checkpoints list|latest|verify``: the layout catalogue on the command line.

``latest`` prints the chosen path on the last line of stdout so scripts can take ``| tail -n1``;
everything diagnostic goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from supervisor import layouts

LAYOUT_CHOICES = ("auto", *layouts.LAYOUT_NAMES)


def _human(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def _line(r: layouts.CheckpointRecord) -> str:
    state = "valid" if r.valid else f"INVALID: {r.reason}"
    return f"{r.step:>10}  {r.layout:<12} {_human(r.size_bytes):>10}  {r.path}  {state}"


def cmd_list(args: argparse.Namespace) -> int:
    root = Path(args.dir)
    try:
        records = layouts.scan(root, args.layout)
    except ValueError as exc:
        print(f"rlsup checkpoints: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([r.to_json() for r in records], indent=2))
        return 0
    from supervisor.quarantine import quarantined

    moved = quarantined(root)
    if not records and not moved:
        print(f"no checkpoints recognised in {root} (layout: {layouts.detect_layout(root)})", file=sys.stderr)
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


def cmd_verify(args: argparse.Namespace) -> int:
    record = layouts.verify_path(args.path)
    for note in record.notes:
        print(f"note: {note}", file=sys.stderr)
    if record.valid:
        print(f"valid: step {record.step} ({record.layout}) {record.path}")
        return 0
    print(f"invalid: {record.reason}")
    return 1


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="checkpoints_cmd", metavar="{list,latest,verify}")
    sub.required = True
    p = sub.add_parser("list", help="every step with its layout, validity and size")
    p.add_argument("dir")
    p.add_argument("--layout", default="auto", choices=LAYOUT_CHOICES)
    p.add_argument("--json", action="store_true", help="machine-readable records")
    p.set_defaults(func=cmd_list)
    p = sub.add_parser("latest", help="print the newest valid step's path (last stdout line); exit 1 if none")
    p.add_argument("dir")
    p.add_argument("--layout", default="auto", choices=LAYOUT_CHOICES)
    p.add_argument("--repair-tracker", action="store_true", help="point a lying tracker at the newest valid step")
    p.set_defaults(func=cmd_latest)
    p = sub.add_parser("verify", help="exit 0 only when PATH is a valid checkpoint step")
    p.add_argument("path")
    p.set_defaults(func=cmd_verify)


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``checkpoints`` to the main ``rlsup`` parser."""
    parser = subparsers.add_parser("checkpoints", help="list, pick and verify checkpoints of verl/Megatron/AReaL/DCP/rlsup")
    _add_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlsup")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
