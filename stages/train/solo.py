"""A one-worker train stage on one node, hosted by a Tune trial actor instead of Ray Train.

Ray Train V2 starts a controller actor, Ray Data's AutoscalingCoordinator actor, the worker actor
and a torch process group even for one worker: 11.2 s of the 20.2 s demo train stage on an H100,
where the epochs took 2.6 s (RESULTS.md gpu_user). The same no-op run of 10 checkpointed reports
took 10.9-11.3 s through a one-worker TorchTrainer and 4.3 s through a one-trial Tuner (2 cores).
A one-worker run needs none of Train's parts, so the loop runs in one Tune function actor, as a
one-worker Tune trial already does (`run_hooks.TuneHooks`). The guarantees stay Ray's:
- a checkpoint is committed (copied into the run's storage) before `ray.tune.report` returns;
- `FailureConfig(max_failures)` restarts a killed actor from the trial's latest checkpoint, and
  the loop resumes there as a Train rank does (same checkpoint files, same RNG and position);
- the experiment state in `<state>/<name>` is restored by the next run (`Tuner.restore`) after
  the driver died, was interrupted, or the retries ran out.
`session.train_host` decides when this host is used; a run keeps the host its state was made by.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Any

from stages.common import console, session, storage
from stages.common.config import TrainConfig
from stages.train.loop import train_loop
from stages.train.run_hooks import TuneHooks

__all__ = ["fit", "holds_state", "run_uri", "interrupted", "first_line", "TRIAL_DIR"]

log = logging.getLogger(__name__)

TRIAL_DIR = "solo"  # the one trial's folder under the run's: its checkpoint_00000N folders


def holds_state(state_uri: str, name: str, s3: Any | None = None) -> bool:
    """Whether `<state_uri>/<name>` was made by this host: Tune's experiment file, or the trial's
    folder (a driver killed before Tune's first snapshot). Reads names only, imports no Tune."""
    fs, root = storage.filesystem(state_uri, s3)
    folder = storage.join(root, name)
    return any(fs.exists(storage.join(folder, part)) for part in ("tuner.pkl", TRIAL_DIR))


def run_uri(state_uri: str, name: str) -> str:
    """The folder that holds this host's checkpoints (stages.train.epoch_log reads it)."""
    return storage.join(state_uri, name, TRIAL_DIR)


def interrupted(result) -> bool:
    """A trial that Tune stopped without finishing or failing: the driver's Ctrl-C. Its last row
    is not marked `done` (a finished trial's is, a NaN stop included)."""
    return result.error is None and not (result.metrics or {}).get("done")


def fit(cfg: TrainConfig, loop: dict[str, Any], plan: session.WorkerPlan, state_uri: str, name: str,
        s3: Any | None = None, metric: str = "val_acc", mode: str = "max"):
    """Train in one Tune trial actor, or resume the experiment saved in `<state_uri>/<name>`;
    the trial's `ray.tune.Result` (checkpoint, best_checkpoints, metrics, error, path)."""
    from ray import tune

    pafs, base = storage.pyarrow_filesystem(state_uri, s3)
    experiment = f"{base}/{name}"
    resources = {"CPU": plan.cpus_per_worker, **({"GPU": plan.gpus_per_worker} if plan.use_gpu else {}),
                 **cfg.worker_resources}
    # The loop travels in the function's closure, not in the experiment state: a restored run
    # trains with this run's loop config (the fingerprint guard has checked it is the same run's).
    trainable = tune.with_resources(_trial(loop), resources)
    verbose = console.tune_verbosity()  # before a restore too: it sets Tune's switches for this process
    if tune.Tuner.can_restore(experiment, storage_filesystem=pafs):
        log.info("train: resuming the one-worker run in %s from its latest checkpoint", storage.join(state_uri, name))
        tuner = tune.Tuner.restore(experiment, trainable=trainable, resume_unfinished=True,
                                   resume_errored=True, storage_filesystem=pafs)
    else:
        tuner = tune.Tuner(
            trainable,
            tune_config=tune.TuneConfig(num_samples=1, trial_dirname_creator=lambda trial: TRIAL_DIR),
            run_config=tune.RunConfig(
                name=name, storage_path=base, storage_filesystem=pafs, verbose=verbose,
                checkpoint_config=tune.CheckpointConfig(num_to_keep=cfg.num_to_keep, checkpoint_score_attribute=metric,
                                                        checkpoint_score_order=mode),
                failure_config=tune.FailureConfig(max_failures=cfg.max_failures)))
    with _quiet_tune():
        grid = tuner.fit()  # a trial that raises past its retries comes back with `error` set
    if len(grid) == 0:  # Ctrl-C before Tune made the trial
        raise KeyboardInterrupt
    return grid[0]


def first_line(error: BaseException) -> str:
    """The line a user reads of a failure: a Tune trial's RayTaskError names the actor and pid
    first, so its cause's message is taken."""
    cause = getattr(error, "cause", None)  # RayTaskError.cause: the exception the actor raised (an
    cause = cause if isinstance(cause, BaseException) else error  # ActorDiedError's is Ray's context record)
    return f"{type(cause).__name__}: {(str(cause).splitlines() or [''])[0]}"


class _TuneLines(logging.Filter):
    """Tune's driver lines that the train stage says better, without --verbose: a trial's failure
    (with its 30-line traceback, even when Tune retries it) becomes one line; Tune's own Ctrl-C
    notes, which advise `Tuner.restore(...)`, and its "Trials did not complete" are dropped (the
    stage's own error or exit says what to do: rerun the same command)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        if record.exc_info and "Trial task failed" in message:
            record.msg, record.args = ("train: the trial actor failed (%s); Tune restarts it from its latest "
                                       "checkpoint while train.max_failures allows", (first_line(record.exc_info[1]),))
            record.exc_info = record.exc_text = None
            record.levelno, record.levelname = logging.WARNING, "WARNING"  # retried, not yet the run's failure
            return True
        return not message.startswith(("Stop signal received", "Experiment has been interrupted",
                                       "Trials did not complete"))


@contextlib.contextmanager
def _quiet_tune():
    """`_TuneLines` on Tune's driver loggers for one fit, unless --verbose: a search later in the
    same process (a notebook, `raymill run`) keeps Tune's own lines."""
    loggers = [logging.getLogger(n) for n in ("ray.tune.execution.tune_controller", "ray.tune.tune")]
    line = None if console.verbose() else _TuneLines()
    for logger in loggers if line else []:
        logger.addFilter(line)
    try:
        yield
    finally:
        for logger in loggers if line else []:
            logger.removeFilter(line)


def _trial(loop: dict[str, Any]):
    def raymill_train(config: dict) -> None:  # the actor's name in `ray list actors` and in logs
        console.epoch_lines_here()
        train_loop(loop, TuneHooks())

    return raymill_train
