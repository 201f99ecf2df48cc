"""ETL: raw labelled images (a folder or an S3 prefix) -> checksummed parquet / WebDataset shards + manifest.

The exports load on first use (PEP 562): importing a leaf such as `stages.etl.images` (the decode
rules that infer, serve and the MLflow model share) does not import the stage, which brings Ray's
session planning and psutil; the registered MLflow model had failed to load in an environment made
from its own requirements (no psutil).
"""
import importlib

__all__ = ["run", "verify", "check_apart", "discover", "preflight", "check_output", "Listing"]

_HOME = {"verify": "integrity", **{name: "stage" for name in __all__ if name != "verify"}}


def __getattr__(name: str):
    if name not in _HOME:
        raise AttributeError(f"module 'stages.etl' has no attribute '{name}'")
    return getattr(importlib.import_module(f"stages.etl.{_HOME[name]}"), name)
