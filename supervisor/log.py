"""rlsup's one logging channel: every component's lines to stderr, one format, one level.

Components log through ``logging.getLogger(__name__)`` (``supervisor.*``) or a ``rlsup.*`` name
(replication, transport); :func:`configure` puts one handler on both roots, so a line such as
"step N copied to the persistent tier" reaches the operator exactly like the run loop's own lines.
The CLI calls it once (``--log-level``, default INFO). Used as a library, rlsup configures nothing:
the embedding program's logging decides.
"""

from __future__ import annotations

import logging
import sys

ROOTS = ("supervisor", "rlsup")
PREFIX = "[rlsup] "
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
DEFAULT_LEVEL = "INFO"


class _Format(logging.Formatter):
    """``[rlsup] message`` at INFO (what rlsup always printed); ``[rlsup] warning: message`` above and
    ``[rlsup] debug (supervisor.tiers.selection): message`` below, naming the component."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        if record.levelno == logging.INFO:
            return PREFIX + text
        if record.levelno < logging.INFO:
            return f"{PREFIX}{record.levelname.lower()} ({record.name}): {text}"
        return f"{PREFIX}{record.levelname.lower()}: {text}"


class _Stderr(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time (the job's output goes to stdout, rlsup's here)."""

    def __init__(self) -> None:
        logging.Handler.__init__(self)

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr


_handler: logging.Handler | None = None


def configure(level: str | int = DEFAULT_LEVEL) -> logging.Handler:
    """Send the ``supervisor`` and ``rlsup`` loggers to stderr at ``level``; calling it again changes the
    level only (one handler, never two)."""
    global _handler
    if isinstance(level, str):
        if level.upper() not in LEVELS:
            raise ValueError(f"unknown log level {level!r} (one of {', '.join(LEVELS)})")
        level = getattr(logging, level.upper())
    if _handler is None:
        _handler = _Stderr()
        _handler.setFormatter(_Format("%(message)s"))
    for name in ROOTS:
        logger = logging.getLogger(name)
        if _handler not in logger.handlers:
            logger.addHandler(_handler)
        logger.setLevel(level)
        logger.propagate = False  # one copy of each line, whatever the embedding program's root does
    return _handler


def get(name: str) -> logging.Logger:
    """A component's logger under the configured roots (``supervisor.<module>`` when given ``__name__``)."""
    return logging.getLogger(name if name.split(".")[0] in ROOTS else f"rlsup.{name}")
