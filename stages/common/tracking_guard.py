"""Tracking never fails a stage: the first MLflow failure of a URI in a process is warned once, with
the fix, and later calls to that URI are skipped. Shared by `tracking` and `tracking_tune`."""
from __future__ import annotations

import functools
import logging
from typing import Any, Callable

__all__ = ["failed", "warn_once", "has_failed", "warn_failure", "guarded"]

log = logging.getLogger("stages.common.tracking")  # one logger for the whole tracking voice
failed: set[str] = set()  # tracking URIs that failed in this process: warned once, skipped after


def warn_once(uri: str, message: str) -> None:
    if uri not in failed:
        failed.add(uri)
        log.warning(message)


def has_failed(uri: str) -> bool:
    return uri in failed


def warn_failure(uri: str, error: BaseException, consequence: str = "the stage goes on untracked") -> None:
    """The one warning of this process for `uri`, with the fix; later failures are silent."""
    text = str(error).splitlines()[0][:200] if str(error) else ""
    warn_once(uri, f"tracking: MLflow at {uri} failed ({type(error).__name__}: {text}); {consequence}. "
                    f"Start the server or fix tracking.uri, or set tracking.enabled=false")


def guarded(default: Any = None) -> Callable:
    """Run an MLflow call; on any error warn once per URI (with the fix) and return `default`."""
    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def call(handle: dict[str, Any] | None, *args, **kwargs):
            if handle is None or handle["uri"] in failed:
                return default
            try:
                return fn(handle, *args, **kwargs)
            except Exception as e:  # tracking is best effort: training results matter more
                warn_failure(handle["uri"], e)
                return default
        return call
    return wrap
