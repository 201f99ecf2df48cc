"""GPU tests: marked `gpu` and skipped where torch sees no CUDA device (CI, the 2-core box).

Run them on a lent device: `python -m pytest tests/gpu -m gpu` (shared/PLATFORM.md says what to
carry). They need no MLflow, S3 or notebooks: the device has none of them.
"""
from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/gpu/" in str(item.fspath):
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(pytest.mark.skip(reason="no CUDA device"))
