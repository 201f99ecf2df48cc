"""Code that runs in Ray Train's controller process, carried there by the trainer's callbacks.

The controller is an actor Train creates itself: raymill's only way in is what it unpickles. A
`ray.train.UserCallback` (Train's documented callback API, run on the controller) is unpickled
there as the controller starts, before its scaling policy can log anything.
"""
from __future__ import annotations

import ray.train

from stages.common import console

__all__ = ["QuietController"]


class QuietController(ray.train.UserCallback):
    """Installs `console.quiet_controller` in the process that unpickles it (the controller),
    then does nothing: its hooks are UserCallback's no-ops."""

    def __reduce__(self):
        return _unpickled, ()


def _unpickled() -> QuietController:
    console.quiet_controller()
    return QuietController()
