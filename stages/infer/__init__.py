"""Batch inference: a published model over a folder, an S3 prefix or ETL shards, into a predictions table.

`run` loads `stages.infer.stage` (and torch) on first use, not on the package's import: Ray Data's
decode tasks unpickle `stages.infer.decode.decode_batch`, and a worker that imported torch through
this file paid for it before its first image (as stages/train/__init__.py does for Train's controller).
"""
from __future__ import annotations

import importlib
from typing import Any

__all__ = ["run"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("stages.infer.stage"), name)
    raise AttributeError(f"module 'stages.infer' has no attribute '{name}'")
