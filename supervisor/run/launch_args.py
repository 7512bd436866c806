"""The resume point on the command line: placeholders in the launch command, filled per attempt.

A trainer that takes its resume point as a flag needed a shell wrapper
(``bash -c '... ${RLSUP_RESUME_DIR:+--resume_from_checkpoint "$RLSUP_RESUME_DIR"}'``), which hides
``torchrun`` from rlsup and so loses warm ranks and the warm launcher. Instead::

    {resume:TEXT}   a whole argument: on a resume, TEXT with {dir} and {step} filled, split at spaces
                    into arguments ('{resume:--resume_from_checkpoint {dir}}' gives two); on a fresh
                    start the argument disappears.
    {resume?A:B}    anywhere inside an argument: A on a resume, B on a fresh start
                    (--init_from={resume?resume:scratch}); A may use {dir} and {step}. The last ':'
                    outside braces separates them, so A may hold a URL (s3://...); B may not hold a ':'.

``{dir}`` is the checkpoint rlsup chose (``RLSUP_RESUME_DIR``: a step directory, or the file of a
single-file checkpoint), ``{step}`` its step (empty where the checkpoint names none). Only text
beginning with the literal ``{resume:`` or ``{resume?`` is a placeholder, and never right after a
``$``: Hydra's and OmegaConf's ``${...}`` interpolations, Python format fields and everything else
pass through untouched. Bash leaves these words alone too (brace expansion needs a comma or ``..``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from supervisor.tiers.resume import REMEDIES

_OPEN = ("{resume:", "{resume?")
#: Layouts whose trainer loads the checkpoint rlsup chose without a placeholder: rlsup's own (trainer_hooks
#: loads ``RLSUP_RESUME_DIR``, and starts fresh when it is empty).
STEERED_BY_ENV = ("rlsup",)
#: Layouts whose trainer reads a tracker that rlsup points at its choice (``repair_tracker``).
STEERED_BY_TRACKER = ("verl", "verl-legacy", "megatron", "deepspeed")


class LaunchArgError(ValueError):
    """A malformed placeholder; the message names the argument."""


@dataclass(frozen=True)
class ResumeFill:
    """What the placeholders are filled with for one attempt (None: a fresh start)."""

    path: str
    step: int | None


def has_placeholder(command: Sequence[str]) -> bool:
    """Whether the command takes rlsup's resume point through a placeholder."""
    return any(_find(arg, 0) >= 0 for arg in command)


def trainer_picks_its_checkpoint(command: Sequence[str], layout: str, repair_tracker: bool) -> bool:
    """Whether the trainer, not rlsup, picks the checkpoint it loads (a ``resume auto`` rlsup cannot steer): the
    command has no placeholder, and ``layout`` (the chosen checkpoint's, else the directory's) is neither
    rlsup's own, read through ``RLSUP_RESUME_DIR``, nor one whose tracker rlsup points at its choice."""
    if has_placeholder(command) or layout in STEERED_BY_ENV:
        return False
    return not (repair_tracker and layout in STEERED_BY_TRACKER)


def picks_its_own_note(torn: Sequence[tuple[Path, str]]) -> str:
    """What the launch line adds where the trainer picks its own checkpoint: that it does, and, with a torn
    checkpoint newer than every valid one (``torn``, newest first), that a trainer loading its newest loads
    that one, and the two remedies."""
    note = "; the trainer picks its own checkpoint (no {resume...} placeholder in the command: rlsup cannot " \
           "steer it unless it reads RLSUP_RESUME_DIR)"
    if not torn:
        return note
    path, why = torn[0]
    more = f" (and {len(torn) - 1} more torn after the newest valid one)" if len(torn) > 1 else ""
    return (f"{note}. WARNING: if it loads its newest, it will load {path}, which is torn ({why}){more}, not "
            f"rlsup's choice; {REMEDIES}")


def check(command: Sequence[str]) -> None:
    """Raise :class:`LaunchArgError` for the first malformed placeholder (before anything launches)."""
    expand(command, None)
    expand(command, ResumeFill("/x", 1))


def expand(command: Sequence[str], resume: ResumeFill | None) -> list[str]:
    """``command`` with its placeholders filled for ``resume`` (None: a fresh start)."""
    out: list[str] = []
    for index, arg in enumerate(command):
        if arg.startswith("{resume:") and _close(arg, 0, index) == len(arg) - 1:
            if resume is not None:  # split first, so a path with spaces stays one argument
                out.extend(_fill(word, resume) for word in arg[len("{resume:"):-1].split())
            continue
        out.append(_inline(arg, resume, index))
    return out


def _inline(arg: str, resume: ResumeFill | None, index: int) -> str:
    text, pos = [], 0
    while (start := _find(arg, pos)) >= 0:
        end = _close(arg, start, index)
        if arg.startswith("{resume:", start):
            raise LaunchArgError(f"word {index + 1} ({arg!r}): '{{resume:...}}' must be a whole argument "
                                 "(quote it when its text has spaces); inside an argument use '{resume?A:B}'")
        body = arg[start + len("{resume?"):end]
        split = _top_level_colon(body)
        if split < 0:
            raise LaunchArgError(f"word {index + 1} ({arg!r}): '{{resume?A:B}}' needs a ':' between the text "
                                 "for a resume and the text for a fresh start")
        chosen = body[:split] if resume is not None else body[split + 1:]
        text += [arg[pos:start], _fill(chosen, resume) if resume is not None else chosen]
        pos = end + 1
    return "".join(text) + arg[pos:]


def _find(arg: str, pos: int) -> int:
    """Index of the next placeholder at or after ``pos`` (never one right after a ``$``), or -1."""
    while True:
        hits = [i for i in (arg.find(o, pos) for o in _OPEN) if i >= 0]
        if not hits:
            return -1
        i = min(hits)
        if i == 0 or arg[i - 1] != "$":
            return i
        pos = i + 1


def _close(arg: str, start: int, index: int) -> int:
    """Index of the brace closing the one at ``start``."""
    depth = 0
    for i in range(start, len(arg)):
        depth += {"{": 1, "}": -1}.get(arg[i], 0)
        if depth == 0:
            return i
    raise LaunchArgError(f"word {index + 1} ({arg!r}): placeholder at character {start} has no closing '}}' "
                         "(a shell splits unquoted spaces: quote the placeholder, or write --flag={dir})")


def _top_level_colon(body: str) -> int:
    """The last ':' outside braces (A, the resume text, may hold a URL's colon; B, the fresh text, not)."""
    depth, found = 0, -1
    for i, ch in enumerate(body):
        depth += {"{": 1, "}": -1}.get(ch, 0)
        if ch == ":" and depth == 0:
            found = i
    return found


def _fill(text: str, resume: ResumeFill) -> str:
    return text.replace("{dir}", resume.path).replace("{step}", "" if resume.step is None else str(resume.step))
