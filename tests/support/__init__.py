"""Shared test helpers, one copy each: plain modules, no test functions (pytest collects nothing here).

- :mod:`support.waits`: ``wait_for`` and its :class:`~support.waits.Deadline`: every wait is a poll with a deadline.
- :mod:`support.env`: the repository's paths and the environment a test gives rlsup and its jobs.
- :mod:`support.ports`: free TCP ports on 127.0.0.1.
- :mod:`support.procs`: the rlsup CLI in a subprocess, liveness, SIGSTOP/SIGCONT and SIGKILL helpers.
- :mod:`support.incidents`: reading a run's ``incidents.jsonl`` and ``state.json``.
- :mod:`support.files`: test files of a given size, file identity.
- :mod:`support.cluster`: the multi-node harness: N ``rlsup run`` node processes on 127.0.0.1.
- :mod:`support.trainers`: one ``rlsup run`` of an unmodified third-party trainer.
- :mod:`support.metrics`: scraping rlsup's metrics, a live Prometheus, the exported series inventory.
- :mod:`support.memory_kvstore`: the coordination store in memory, shared by simulated nodes in one process.
- :mod:`support.in_process_round`: several nodes' agreement round in one process, over real parts and tiers.

Imported as the top-level package ``support``: pytest puts ``tests/`` on ``sys.path`` when it loads
``tests/conftest.py`` (rootdir-relative, no ``__init__.py`` in ``tests/``); the chaos soak, run outside pytest
(``cd tests && python -m chaos.soak``, or ``python -m tests.chaos.soak``), puts it there in ``tests/chaos/__init__.py``.
"""
