"""Chaos and adversarial soak for rlsup: a seeded fault injector, scenarios and invariants.

CI subset: ``pytest tests/chaos`` (fixed seeds, a few minutes on 2 cores). Soak:
``python -m tests.chaos.soak --minutes 30`` or ``pytest tests/chaos --soak 30`` (random seeds, printed
for replay). See RELIABILITY.md.
"""
