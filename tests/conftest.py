"""Session fixtures built from :mod:`tests.helpers` (tiny models from configs, fixed seeds)."""

from __future__ import annotations

import os

import pytest

from agentspec.models import LoadedModel
from tests.helpers import tiny_model

# litellm fetches its model cost map from GitHub on import unless told to use the bundled copy: no test
# reaches the network (langchain-litellm imports litellm before agentspec's provider could set this).
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")


@pytest.fixture(scope="session")
def target() -> LoadedModel:
    return tiny_model(seed=0)


@pytest.fixture(scope="session")
def wrong_drafter_model() -> LoadedModel:
    """Different random weights: a drafter that is almost always wrong."""
    return tiny_model(seed=1, layers=1)
