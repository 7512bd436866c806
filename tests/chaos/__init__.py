"""Chaos and adversarial soak for rlsup: a seeded fault injector, scenarios and invariants.

CI subset: ``pytest tests/chaos`` (fixed seeds, a few minutes on 2 cores). Soak: from ``tests/``,
``python -m chaos.soak --minutes 30`` (``python -m tests.chaos.soak`` from the repository where verl, which ships
a ``tests`` package of its own, is not installed), or ``pytest tests/chaos --soak 30`` (random seeds, printed for
replay). See RELIABILITY.md.
"""

import sys
from pathlib import Path

# The one place the chaos package fixes its imports for runs outside pytest (``python -m chaos.soak``):
# tests/ for the shared helpers (``support``, what pytest puts there itself) and the repository for rlsup.
for _path in (Path(__file__).resolve().parents[1], Path(__file__).resolve().parents[2]):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))
