"""Wake a background loop when a manifest appears in a checkpoint directory (watchdog, inotify on Linux).

The replication engine and the persistent tier both act when a rank finishes its part of a step,
which is exactly when its manifest appears (written last). Waking on that event instead of polling
fast means a new step is pushed or persisted at once, while a quiet directory costs nothing; both
loops still rescan on a timer for what an event can miss (a directory on a filesystem without
inotify, events dropped under load).

Only the events that can wake are asked of the kernel (``event_filter``: creates, closes after a write,
moves, deletes).
watchdog's default mask also has every open, read-only close and write chunk: a save of 100 MB and
every listing and read of the directory (the tiers' own scans and verifications included) went
through its three Python threads, about a third of a core per watch on a busy checkpoint directory.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Callable

from watchdog.events import (DirCreatedEvent, DirDeletedEvent, DirMovedEvent, FileClosedEvent, FileCreatedEvent,
                             FileDeletedEvent, FileMovedEvent, FileSystemEvent, FileSystemEventHandler)
from watchdog.observers import Observer

from rlsup_format.names import MANIFEST_RE


#: What can wake: a manifest created, closed after writing (one written in place is whole only then) or
#: renamed into place (a directory moved or created in brings its files' events along), anything deleted.
#: No open, read-only close or write chunk: those are most of a busy directory's events.
WAKING_EVENTS = [FileCreatedEvent, FileClosedEvent, FileMovedEvent, FileDeletedEvent, DirCreatedEvent, DirMovedEvent,
                 DirDeletedEvent]


def manifest_or_deletion(path: str, kind: str) -> bool:
    """The tiers' rule: a manifest created, closed or renamed into place, or anything deleted."""
    return bool(MANIFEST_RE.match(os.path.basename(path))) or kind == "deleted"


class _ManifestHandler(FileSystemEventHandler):
    """Set ``wake`` when ``wakes_on(path, event_type)`` says so (the path is the destination of a move)."""

    def __init__(self, wake: threading.Event, wakes_on: Callable[[str, str], bool]) -> None:
        self.wake = wake
        self.wakes_on = wakes_on
        self.events = 0  # every event handed to it (what the filter lets through costs this much Python)

    def on_any_event(self, event: FileSystemEvent) -> None:
        self.events += 1
        path = getattr(event, "dest_path", "") or event.src_path
        if self.wakes_on(str(path), event.event_type):
            self.wake.set()


class ManifestWatch:
    """Watch ``directory`` (recursively) and set ``wake`` on manifest events (or those ``wakes_on`` names),
    between start and stop."""

    def __init__(self, directory: str | os.PathLike, wake: threading.Event,
                 wakes_on: Callable[[str, str], bool] = manifest_or_deletion, recursive: bool = True) -> None:
        self.directory = Path(directory)
        self.wake = wake
        self.handler = _ManifestHandler(wake, wakes_on)
        self.recursive = recursive
        self._observer: Observer | None = None

    def start(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        observer = Observer()
        observer.schedule(self.handler, str(self.directory), recursive=self.recursive, event_filter=WAKING_EVENTS)
        observer.start()  # held only once started: a start that failed (inotify limits) leaves nothing to stop
        self._observer = observer

    def stop(self) -> None:
        if self._observer is not None:
            self._observer.stop()
            self._observer.join(timeout=5)
            self._observer = None
