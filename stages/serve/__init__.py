"""Online inference on Ray Serve: a FastAPI ingress (REST and the Open Inference Protocol) -> model replicas.

The exports load `stages.serve.app` (and through it the model replica's torch) on first use, not
on the package's import: an ingress replica unpickles `stages.serve.http.Ingress`, and had
imported torch through this file. Without it an ingress replica holds 213 MB, not 396 MB (RSS,
2-core box); the endpoint's start is unchanged (11.2-12.2 s: the model replica's start is longer).
"""
from __future__ import annotations

import importlib
from typing import Any

__all__ = ["start", "update", "drain", "shutdown", "watch_ray", "apply_ingress_env"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("stages.serve.app"), name)
    raise AttributeError(f"module 'stages.serve' has no attribute '{name}'")
