"""What a person sees in the terminal: raymill's own lines, one per event; Ray's chatter in Ray's logs.

Ray keeps writing everything to its session log files (/tmp/ray/session_latest/logs): Ray Data to
ray-data.log, Ray Train to ray-train-*.log. Only the terminal copy is quietened. `--verbose`
(env RAYMILL_VERBOSE=1, forwarded to Ray workers) brings all of it back.
"""
from __future__ import annotations

import logging
import os
import sys
from typing import Any

__all__ = ["setup", "verbose", "quiet_ray", "train_logging_config", "quiet_train_worker", "epoch",
           "VERBOSE_ENV"]

VERBOSE_ENV = "RAYMILL_VERBOSE"
_OURS = ("raymill", "workflow", "stages", "benchmarks")  # loggers that speak at INFO by default

log = logging.getLogger("raymill.train")


def setup(verbose: bool = False) -> None:
    """Logging for the CLI process: raymill at INFO, libraries (matplotlib, alembic, ...) at WARNING."""
    os.environ[VERBOSE_ENV] = "1" if verbose else "0"  # read by Ray workers (session forwards it)
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="[raymill] %(message)s",
                        stream=sys.stderr, force=True)
    for name in _OURS:
        logging.getLogger(name).setLevel(logging.DEBUG if verbose else logging.INFO)


def verbose() -> bool:
    return os.environ.get(VERBOSE_ENV) == "1"


def quiet_ray() -> None:
    """After `ray.init`: Ray Data's INFO banners and text progress go to ray-data.log only.

    Ray Data configures the `ray.data` logger with a file handler and a console handler when it
    is imported; the console one is raised to WARNING, so warnings and errors still show.
    Interactive progress bars (tqdm, on a terminal) are not log records and stay.
    """
    if verbose():
        return
    import ray.data  # noqa: F401  (importing it configures the `ray.data` logger)

    for handler in logging.getLogger("ray.data").handlers:
        if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
            handler.setLevel(logging.WARNING)


def train_logging_config():
    """`ray.train.LoggingConfig` for a trainer's RunConfig: Train's own INFO lines (resource
    requests, checkpoint paths, `TrainingReport(...)` reprs) stay in Train's log files."""
    import ray.train

    return ray.train.LoggingConfig(log_level="INFO" if verbose() else "WARNING")


def quiet_train_worker() -> None:
    """Call first in a Ray Train worker loop: the worker's root logger to WARNING, raymill's at INFO.

    Ray Train sets a worker's root logger to INFO with a console handler. Its per-report line
    ("Reporting training result N: TrainingReport(...)") is logged under a logger named after
    its file path, not `ray.train`, so `LoggingConfig(log_level=...)` does not hold it back
    (the execution context module of Ray Train V2, Ray 2.60).
    """
    if verbose():
        return
    logging.getLogger().setLevel(logging.WARNING)
    for name in _OURS:
        logging.getLogger(name).setLevel(logging.INFO)


def epoch(row: dict[str, Any], epochs: int) -> None:
    """The one console line of an epoch; call it on rank 0 only.

    A log record, not print(): Ray Train patches print() on workers to both print and log it,
    which showed every epoch line twice.
    """
    log.info(f"[raymill] train: epoch {row['epoch']}/{epochs} loss {row['train_loss']:.3f} "
             f"acc {row['train_acc']:.3f} val_acc {row['val_acc']:.3f} | {row['images_per_s']:.0f} images/s, "
             f"input wait {row['wait_s']:.1f}s, device busy {row['compute_s']:.1f}s of "
             f"{row.get('wall_s', 0):.1f}s ({row.get('device_utilisation', 0):.0%}), "
             f"stall {row['stall_fraction']:.1%}, tier {row.get('tier', '-')} | {row['verdict']}")
