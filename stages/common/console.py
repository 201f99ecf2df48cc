"""What a person sees in the terminal: raymill's own lines, one per event; Ray's chatter in Ray's logs.

Ray keeps writing everything to its session log files (/tmp/ray/session_latest/logs): Ray Data to
ray-data.log, Ray Train to ray-train-*.log. Only the terminal copy is quietened. `--verbose`
(env RAYMILL_VERBOSE=1, forwarded to Ray workers) brings all of it back.
"""
from __future__ import annotations

import contextlib
import gc
import logging
import os
import sys
from pathlib import Path
from typing import Any

from stages.common import benign

__all__ = ["setup", "before_exit", "verbose", "quiet_ray", "quiet_tune", "tune_verbosity",
           "tune_result_loggers", "no_tensorboard", "quiet_serve", "epoch_lines_here", "some", "root_cause",
           "train_logging_config", "quiet_train_worker", "epoch",
           "VERBOSE_ENV", "quiet_controller", "quiet_torch_cpp", "worker_lines_first"]

VERBOSE_ENV = "RAYMILL_VERBOSE"
_OURS = ("raymill", "workflow", "stages", "benchmarks")  # loggers that speak at INFO by default

log = logging.getLogger("raymill.train")


def setup(verbose: bool = False) -> None:
    """Logging for the CLI process: raymill at INFO, libraries (matplotlib, alembic, ...) at WARNING."""
    os.environ[VERBOSE_ENV] = "1" if verbose else "0"  # read by Ray workers (session forwards it)
    if _is_the_cli():  # not when a program (a test, a notebook) calls workflow.__main__.main itself
        benign.install(verbose)  # fd 2 itself: Python, Ray's forwarded lines and C++ all pass the filter
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="[raymill] %(message)s",
                        handlers=[_Stderr()], force=True)
    for name in _OURS:
        logging.getLogger(name).setLevel(logging.DEBUG if verbose else logging.INFO)


class _Stderr(logging.StreamHandler):
    """sys.stderr as it is at each record, not as it was at setup: a program that calls `main`
    itself (pytest's capture) closes and swaps the stream it had, and the next record printed
    "--- Logging error --- ValueError: I/O operation on closed file" (CI, 2026-11-28)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def before_exit() -> None:
    """The CLI process, its command done: freeze what is alive out of the garbage collector's reach.

    The interpreter's exit runs a last full collection over every object left, and a run's heap
    (torch, MLflow, pandas, Ray) made that 1.2 s of the demo's 2-core wall, after the summary was
    printed. Frozen objects are not scanned; atexit handlers and finalizers still run. Not in a
    program that calls `main` itself (a test, a notebook): its later garbage must stay collectable."""
    if _is_the_cli():
        gc.freeze()


def _is_the_cli() -> bool:
    """This process is `raymill` or `python -m workflow`: its stderr is the CLI's own to filter."""
    script = Path(sys.argv[0]) if sys.argv and sys.argv[0] else Path()
    return script.name == "raymill" or (script.name == "__main__.py" and script.parent.name == "workflow")


def verbose() -> bool:
    return os.environ.get(VERBOSE_ENV) == "1"


def quiet_ray() -> None:
    """Before the driver's first Ray Data dataset: Ray Data's INFO banners and text progress go to
    ray-data.log only. Called where the driver uses Ray Data (ETL's Ray Data path, the ray_data
    ingest, batch inference on Ray), not at Ray's start: importing ray.data took 0.5-0.75 s of the
    2-core demo, which never uses Ray Data.

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


def tune_verbosity() -> int:
    """A Tuner's `RunConfig.verbose`: Tune's own console output only with --verbose. Without it,
    Tune's documented switches also silence its warning that fast trials snapshot the experiment
    often, and its new output engine, which draws a configuration box at every start whatever
    `verbose` says (Ray 2.60's TuneTerminalReporter); the old engine at verbose=0 draws nothing."""
    if verbose():
        return 1
    os.environ.setdefault("TUNE_WARN_EXCESSIVE_EXPERIMENT_CHECKPOINT_SYNC_THRESHOLD_S", "0")
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    return 0


# Tune's documented switch for its automatic result loggers (CSV, JSON and TensorBoard).
_AUTO_LOGGERS = "TUNE_DISABLE_AUTO_CALLBACK_LOGGERS"


def tune_result_loggers() -> list:
    """Tune's CSV and JSON result loggers, for a RunConfig's callbacks; `no_tensorboard()` around
    the fit then keeps Tune from adding its TensorBoard logger. That logger imports tensorboardX
    when a fit starts, before its first trial: a no-op one-trial fit took 5.9-6.3 s with it and
    4.5-4.6 s without (2 cores, alternating). Named here, the JSON logger that writes the result.json
    stages/train/solo.py resumes from stays even where a user turned the automatic loggers off."""
    from ray.tune.logger import CSVLoggerCallback, JsonLoggerCallback

    return [CSVLoggerCallback(), JsonLoggerCallback()]


@contextlib.contextmanager
def no_tensorboard():
    """One fit without Tune's automatic loggers (pass `tune_result_loggers()`); the process's own
    setting is back afterwards, so a user's later Tuner gets Tune's defaults. A user's value wins."""
    ours = _AUTO_LOGGERS not in os.environ
    if ours:
        os.environ[_AUTO_LOGGERS] = "1"
    try:
        yield
    finally:
        if ours:
            os.environ.pop(_AUTO_LOGGERS, None)


def quiet_tune() -> None:
    """After `ray.init` (imports nothing): Tune's TensorBoard logger warns on every search that a
    list (worker_nodes) is no scalar."""
    if not verbose():
        logging.getLogger("ray.tune.logger.tensorboardx").setLevel(logging.ERROR)
        # tune.py's lines at an interrupted search ("Experiment has been interrupted ... Resume
        # experiment with: Tuner.restore(...)", "Trials did not complete"): raymill's own line says
        # how to resume (rerun the command), and trials.md which trials were unfinished
        logging.getLogger("ray.tune.tune").setLevel(logging.CRITICAL)
        # Tune's result loggers, as PBT restarts a trial from a donor's checkpoint before the trial
        # wrote its own result.json: "Remote file not found: .../result.json" (nothing is lost)
        logging.getLogger("ray.tune.logger.logger").setLevel(logging.ERROR)


def quiet_serve() -> None:
    """Before Serve starts in the driver: its INFO lines ("Started Serve in namespace", "Application
    ... is ready") stay off the terminal, where raymill's own line names the endpoint. Serve's
    actors write theirs to logs/serve/ only (RAY_SERVE_LOG_TO_STDERR, set at Ray's start)."""
    if not verbose():
        logging.getLogger("ray.serve").setLevel(logging.WARNING)


# Ray Train 2.60's controller logs this warning, with a 20-line traceback, when its autoscaling
# coordinator does not answer within a fixed 5 s (no setting changes it); training goes on. Seen
# in 4 of 8 trainer starts on a 16-core GPU node.
_COORDINATOR = ("ray.train.", "Failed to send resource request")
_COORDINATOR_LINE = ("Ray Train's autoscaling coordinator did not answer within its fixed 5 s; the "
                     "resource request is retried and training goes on (harmless; --verbose shows why)")


def quiet_controller() -> None:
    """In Train's controller process: rewrite that one record (matched by logger-name prefix and
    message) into one line without its traceback. A record factory, because the logger is created
    by Ray after this runs and its handlers are Train's own. Installed once a process.

    It runs as the controller unpickles `stages.train.controller_hook.QuietController`, one of the
    trainer's callbacks. It was Ray's runtime_env `worker_process_setup_hook`, which ran in every
    worker process, but a job with that hook cannot use the workers Ray starts with the node:
    the first tasks (ETL's) waited for two fresh worker processes (0.85 s on 2 cores)."""
    if verbose() or getattr(logging.getLogRecordFactory(), "raymill_quiet", False):
        return
    make = logging.getLogRecordFactory()

    def factory(*args, **kwargs) -> logging.LogRecord:
        record = make(*args, **kwargs)
        if record.name.startswith(_COORDINATOR[0]) and str(record.msg).startswith(_COORDINATOR[1]):
            record.msg, record.args, record.exc_info = _COORDINATOR_LINE, (), None
        return record

    factory.raymill_quiet = True  # type: ignore[attr-defined]
    logging.setLogRecordFactory(factory)


def quiet_torch_cpp() -> dict[str, str]:
    """Env for Ray workers when this host's name does not resolve (said once, here).

    torch's c10d store then warns "The hostname of the client socket cannot be retrieved" in every
    GPU worker. The fix at the source is a resolvable hostname (/etc/hosts); without it, torch's
    documented TORCH_CPP_LOG_LEVEL=ERROR silences its C++ warnings in the workers.
    """
    import socket

    if verbose() or "TORCH_CPP_LOG_LEVEL" in os.environ:
        return {}
    try:
        socket.getaddrinfo(socket.gethostname(), None)
        return {}
    except OSError:
        logging.getLogger("raymill.session").warning(
            "this host's name (%s) does not resolve: torch's C++ warnings are silenced in Ray workers "
            "(TORCH_CPP_LOG_LEVEL=ERROR) instead of a c10d warning per worker; add it to /etc/hosts to "
            "fix it at the source", socket.gethostname())
        return {"TORCH_CPP_LOG_LEVEL": "ERROR"}


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
    for name in _OURS:  # with --verbose too (its epoch lines had gone, with only Ray's left)
        logging.getLogger(name).setLevel(logging.INFO)
    if verbose():
        return
    logging.getLogger().setLevel(logging.WARNING)
    # Ray's own loggers carry their handler and INFO level: "Checkpoint successfully created at"
    # came once per report of every Tune trial
    for name in ("ray.train", "ray.tune"):
        logging.getLogger(name).setLevel(logging.WARNING)


def epoch_lines_here() -> None:
    """In a Tune trial actor that trains a whole run (stages.train.solo): the epoch lines to its
    stderr, which Ray forwards to the driver's, as Ray Train's console handler does for its workers
    (stdout had mixed them with the command's result line). A trial actor has no handler, and its
    INFO records were dropped. Once a process; at INFO with --verbose too."""
    log.setLevel(logging.INFO)
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))  # the line carries its "[raymill]"
        log.addHandler(handler)
        log.propagate = False  # never twice, whatever handler the root logger gets


def some(names: list, limit: int = 10) -> str:
    """A list for a log line, its first `limit` and how many more: one warning had named 400 of
    2,000 classes in 3,737 characters."""
    shown = ", ".join(map(str, names[:limit]))
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def root_cause(e: BaseException) -> str:
    """The deepest exception of the chain that says something. A Ray task or actor error's text is
    the remote traceback: its last line is the remote error (Ray Data's SystemException under it
    is empty, and once was all an actor that failed to start left in the message)."""
    said = e
    while e.__cause__ is not None:
        e = e.__cause__
        said = e if str(e).strip() else said
    text = str(said).strip()
    if '\n  File "' in text:  # a remote traceback: its last line names the error
        text = text.splitlines()[-1]
    return f"{type(said).__name__}: {text}"


def score(value: float | None) -> str:
    """An accuracy for a console line: 'n/a' when nothing was scored (an empty split), never 0.000."""
    return "n/a" if value is None or value != value else f"{value:.3f}"


def epoch(row: dict[str, Any], epochs: int) -> None:
    """The one console line of an epoch; call it on rank 0 only.

    A log record, not print(): Ray Train patches print() on workers to both print and log it,
    which showed every epoch line twice.
    """
    log.info("[raymill] train: epoch %s/%s loss %.3f acc %.3f val_acc %.3f | %.0f images/s, input wait %.1fs, "
             "device busy %.1fs of %.1fs (%.0f%%), stall %.1f%%, tier %s | %s", row["epoch"], epochs,
             row["train_loss"], row["train_acc"], row["val_acc"], row["images_per_s"], row["wait_s"], row["compute_s"],
             row.get("wall_s", 0), 100 * row.get("device_utilisation", 0), 100 * row["stall_fraction"],
             row.get("tier", "-"), row["verdict"])


def worker_lines_first() -> None:
    """Shut down the Ray this process runs, if any, so that its workers' last forwarded lines reach
    the terminal before the line the caller prints next (Ray's exit would do it after)."""
    if (ray := sys.modules.get("ray")) is not None and ray.is_initialized():
        ray.shutdown()
