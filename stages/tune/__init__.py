"""Hyper-parameter search on Ray Tune (ASHA / PBT / FIFO); the best trial's model is published."""
from stages.tune.stage import published, run, searched_models

__all__ = ["run", "published", "searched_models"]
