"""A Tune trial's outcome: one rule for trials.md, the console's trial lines and the MLflow tag.

It sits on the bottom floor because the MLflow logger (stages/common/tracking_tune.py) needs it and
must not import `stages`; trials.md (stages/tune/results.py) and the console line use it too.
"""
from __future__ import annotations

from typing import Any

__all__ = ["OUTCOMES", "outcome", "ended"]

OUTCOMES = ("completed", "stopped_early", "diverged", "failed")


def outcome(status: str, diverged: bool, epochs_run: int, epochs_planned: int) -> str:
    """A trial's outcome (OUTCOMES) from its Tune status, a non-finite loss, and its epochs."""
    if status == "ERROR":
        return "failed"
    if status != "TERMINATED":
        return status.lower()
    if diverged:
        return "diverged"
    return "stopped_early" if epochs_run < epochs_planned else "completed"


def ended(trial: Any, failed: bool, max_epochs: int) -> tuple[str, int, int]:
    """(outcome, epochs run, epochs planned) of a live Tune `Trial` at its end. The search may set a
    trial's own `epochs`; a training loop that met a NaN loss reports `stopped: nan_loss`."""
    last = trial.last_result or {}
    epochs = int(last.get("epoch", last.get("training_iteration", 0)) or 0)
    planned = int(trial.config.get("epochs", max_epochs))
    diverged = last.get("stopped") == "nan_loss"
    return outcome("ERROR" if failed else "TERMINATED", diverged, epochs, planned), epochs, planned
