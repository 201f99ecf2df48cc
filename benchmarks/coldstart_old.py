"""The baseline's extra map function for benchmarks/coldstart.py, in a module that imports what the
train task functions' old home (stages.feed.ray_data) imports, torch included: a task worker that
unpickles `passthrough` pays that import before its first block, as it did before 2026-11-27."""
from __future__ import annotations

import stages.feed.ray_data  # noqa: F401  (the import is the cost measured)

__all__ = ["passthrough"]


def passthrough(batch):
    return batch
