"""Test options: slow tests run only with --runslow; GPU tests only where CUDA is present.

Both are skipped *visibly* (pytest's -ra summary lists each with its reason).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings

# Hypothesis examples build real loaders (some with worker processes): no per-example deadline,
# and a fixed derandomized profile in CI so a red run is reproducible.
settings.register_profile("ci", deadline=None, derandomize=True, print_blob=True)
settings.register_profile("dev", deadline=None)
settings.load_profile("ci")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--runslow", action="store_true", default=False, help="run tests marked slow")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_slow = pytest.mark.skip(reason="slow: run with --runslow")
    skip_gpu = pytest.mark.skip(reason="gpu: no CUDA device on this machine")
    for item in items:
        if "slow" in item.keywords and not config.getoption("--runslow"):
            item.add_marker(skip_slow)
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
