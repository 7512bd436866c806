"""rlsup's on-disk format, shared by ``trainer_hooks`` (inside every rank) and ``supervisor``.

One place for every rule about checkpoint bytes on disk: names (steps, manifests, every temp and
marker name and its parser), the manifest and what makes a step valid, the xxh3-128 digest, the
durable-write helpers (fsync, no-follow open, atomic write), leftover cleanup and the retention
decision. Also the other names that both sides, or several of rlsup's layers, agree on: the
``RLSUP_*`` environment of every rank (``job_env``) and the files of rlsup's state directory
(``state_files``). It imports only the standard library and xxhash and does nothing at import (no
signal handler, no prctl), so any process may read checkpoints through it. Import the submodules.
"""
