"""Training: PyTorch DDP on Ray Train (one worker: a Tune trial actor) over the ETL shards, with checkpoints, resume and a verdict on the feed.

The exports load `stages.train.stage` (and torch) on first use, not on the package's import: Ray
Train's controller unpickles this package's light modules (controller_hook, ddp_rendezvous) and had
imported torch through this file, ~1.7 s of every run's start on its critical path (2 cores).
"""
from __future__ import annotations

import importlib
from typing import Any

__all__ = ["run", "published", "check_image_size"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("stages.train.stage"), name)
    raise AttributeError(f"module 'stages.train' has no attribute '{name}'")
