"""Session fixtures built from :mod:`tests.helpers` (tiny models from configs, fixed seeds)."""

from __future__ import annotations

import pytest

from agentspec.models import LoadedModel
from tests.helpers import tiny_model


@pytest.fixture(scope="session")
def target() -> LoadedModel:
    return tiny_model(seed=0)


@pytest.fixture(scope="session")
def wrong_drafter_model() -> LoadedModel:
    """Different random weights: a drafter that is almost always wrong."""
    return tiny_model(seed=1, layers=1)
