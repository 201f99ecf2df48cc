"""Hyper-parameter search on Ray Tune (ASHA / PBT / FIFO); the best trial's model is published."""
__all__ = ["run", "published", "searched_models"]


def __getattr__(name: str):
    """The stage imports torch and Ray: loaded at first use, so that stages.tune.checks runs before them."""
    if name in __all__:
        from stages.tune import stage

        return getattr(stage, name)
    raise AttributeError(f"module 'stages.tune' has no attribute '{name}'")
