"""Options for the chaos suite: ``--soak MINUTES`` runs the randomised soak (skipped otherwise), e.g.
``pytest tests/chaos --soak 30`` (pass the tests/chaos path so pytest loads this option). The ``chaos`` and
``soak`` markers are registered in pyproject.toml with the others."""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--soak", type=float, default=None, metavar="MINUTES",
                     help="run the chaos soak for MINUTES with random seeds (printed for replay)")
    parser.addoption("--soak-seed", type=int, default=None, help="master seed of the soak (default: random)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    minutes = config.getoption("--soak", default=None)
    for item in items:
        if "soak" in item.keywords and not minutes:
            item.add_marker(pytest.mark.skip(reason="soak: pass --soak MINUTES (e.g. pytest tests/chaos --soak 30)"))
