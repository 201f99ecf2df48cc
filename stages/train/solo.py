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
- after the driver died, was interrupted, or the retries ran out, the next run is a new Tune
  experiment (`<state>/<name>/attempt-NNN`) whose trial starts from the last checkpoint an earlier
  attempt committed (listed in its trial's result.json, which Tune writes after the checkpoint is
  stored). Not `Tuner.restore`: it unpickles the folder's tuner.pkl, keeps the failure count
  and config of the first attempt, and in 1 of 4 reruns after a killed actor (max_failures=0)
  it marked the errored trial finished without running it (Ray 2.60).
`session.train_host` decides when this host is used; a run keeps the host its state was made by.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import signal
import threading
from typing import Any

from stages.common import console, session, storage
from stages.common.config import TrainConfig
from stages.train import checkpointing
from stages.train.loop import train_loop
from stages.train.run_hooks import TuneHooks

__all__ = ["Attempt", "committed", "holds_state", "first_line", "TRIAL_DIR", "ATTEMPT"]

log = logging.getLogger(__name__)

TRIAL_DIR = "solo"  # the one trial's folder in each attempt: its checkpoint_00000N folders
ATTEMPT = "attempt-"  # one Tune experiment per `raymill train` of this run


def holds_state(state_uri: str, name: str, s3: Any | None = None) -> bool:
    """Whether `<state_uri>/<name>` was made by this host (an attempt folder). Names only."""
    fs, root = storage.filesystem(state_uri, s3)
    return bool(_attempts(fs, storage.join(root, name)))


def _attempts(fs, folder: str) -> list[str]:
    try:
        return sorted(n for n in (p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(folder, detail=False))
                      if n.startswith(ATTEMPT))
    except FileNotFoundError:
        return []


def committed(state_uri: str, name: str, s3: Any | None = None) -> list[tuple[str, dict[str, Any]]]:
    """(path under the run's folder, reported metrics) of each checkpoint the attempts so far
    committed and still keep, in report order: result.json lists a checkpoint only after Tune
    stored it, so a folder a killed actor was still copying is never resumed from."""
    fs, root = storage.filesystem(state_uri, s3)
    folder, found = storage.join(root, name), []
    for attempt in _attempts(fs, folder):
        trial = storage.join(folder, attempt, TRIAL_DIR)
        try:
            lines = fs.cat_file(storage.join(trial, "result.json")).decode().splitlines()
        except FileNotFoundError:
            continue
        for line in lines:
            try:
                row = json.loads(line)
            except ValueError:  # a line cut by a killed driver
                continue
            kept = row.get("checkpoint_dir_name")
            if kept and fs.exists(storage.join(trial, kept, "meta.json")):
                found.append((f"{attempt}/{TRIAL_DIR}/{kept}", row))
    return found


class Attempt:
    """This run's Tune experiment: `run_uri` holds its checkpoints (stages.train.epoch_log reads
    them while `fit()` trains)."""

    def __init__(self, cfg: TrainConfig, loop: dict[str, Any], plan: session.WorkerPlan, state_uri: str,
                 name: str, s3: Any | None = None):
        self.cfg, self.loop, self.plan, self.state_uri, self.name, self.s3 = cfg, loop, plan, state_uri, name, s3
        fs, root = storage.filesystem(state_uri, s3)
        self.index = len(_attempts(fs, storage.join(root, name)))
        self.run_uri = storage.join(state_uri, name, f"{ATTEMPT}{self.index:03d}", TRIAL_DIR)

    def fit(self):
        """The trial's `ray.tune.Result`, its `best_checkpoints` over every attempt of the run and
        `error` set when it failed; KeyboardInterrupt when Tune stopped it (Ctrl-C)."""
        from ray import tune

        pafs, base = storage.pyarrow_filesystem(self.state_uri, self.s3)
        earlier = [(tune.Checkpoint(f"{base}/{self.name}/{path}", filesystem=pafs), row)
                   for path, row in committed(self.state_uri, self.name, self.s3)]
        if earlier and _trained_through(earlier[-1][1], self.cfg.epochs):
            # stopped between its last epoch and publishing: nothing to train, no trial to start
            log.info("train: %s already holds all %d epochs; publishing them", earlier[-1][0].path, self.cfg.epochs)
            last, row = earlier[-1]
            return tune.Result(metrics={**row, "done": True}, checkpoint=last, error=None, path=last.path,
                               best_checkpoints=earlier)
        if earlier:
            log.info("train: resuming from %s (attempt %d of this run)", earlier[-1][0].path, self.index + 1)
        cfg, plan = self.cfg, self.plan
        resources = plan.resources(cfg.worker_resources)
        tuner = tune.Tuner(
            tune.with_resources(_trial(self.loop, earlier[-1][0] if earlier else None), resources),
            tune_config=tune.TuneConfig(num_samples=1, trial_dirname_creator=lambda trial: TRIAL_DIR),
            run_config=tune.RunConfig(
                name=f"{ATTEMPT}{self.index:03d}", storage_path=f"{base}/{self.name}", storage_filesystem=pafs,
                verbose=console.tune_verbosity(), callbacks=console.tune_result_loggers(),
                checkpoint_config=tune.CheckpointConfig(num_to_keep=cfg.num_to_keep,
                                                        checkpoint_score_attribute=checkpointing.score_key("val_acc"),
                                                        checkpoint_score_order="max"),
                failure_config=tune.FailureConfig(max_failures=cfg.max_failures)))
        return _outcome(_fit(tuner), earlier)


def _trained_through(row: dict[str, Any], epochs: int) -> bool:
    """Whether a committed checkpoint's row is the end of the run's last epoch (not a mid-epoch one)."""
    return row.get("position_epoch") == epochs and row.get("position_step") == 0


def _fit(tuner):
    """`tuner.fit()` under `_quiet_tune`; with whether a Ctrl-C stopped it. Tune swaps in its own
    SIGINT handler for the fit and puts the one before back only when the signal came: the one
    sign of a Ctrl-C that does not depend on the trial's recorded state."""
    before = signal.getsignal(signal.SIGINT) if threading.current_thread() is threading.main_thread() else None
    with _quiet_tune(), console.no_tensorboard():
        grid = tuner.fit()
    return grid, before is not None and signal.getsignal(signal.SIGINT) is before


def _outcome(fitted, earlier: list):
    grid, ctrl_c = fitted
    if len(grid) == 0:  # Tune made no trial: stopped at once
        if ctrl_c:
            raise KeyboardInterrupt
        raise RuntimeError("Tune ended the run before it made its trial")
    result = grid[0]
    if grid.num_errors and result.error is None:  # its error file not read back yet
        result = dataclasses.replace(result, error=RuntimeError(f"the trial actor failed (see {result.path})"))
    if result.error is None and not (result.metrics or {}).get("done"):  # neither finished nor failed
        if ctrl_c:
            raise KeyboardInterrupt
        result = dataclasses.replace(result, error=RuntimeError(
            f"Tune stopped the trial before its last epoch and recorded no error (see {result.path})"))
    if result.error is None and "epoch" not in (result.metrics or {}) and earlier:
        # Resumed after the last epoch (a run that stopped before publishing): the loop had nothing
        # to train and reported nothing, so the run's last row is the last committed checkpoint's.
        result = dataclasses.replace(result, metrics={**earlier[-1][1], "done": True})
    # the best is chosen over the whole run: an earlier attempt's best epoch counts as it would have
    return dataclasses.replace(result, best_checkpoints=earlier + list(result.best_checkpoints or []),
                               checkpoint=result.checkpoint or (earlier[-1][0] if earlier else None))


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


def _trial(loop: dict[str, Any], resume):
    def raymill_train(config: dict) -> None:  # the actor's name in `ray list actors` and in logs
        console.epoch_lines_here()
        train_loop(loop, TuneHooks(resume))

    return raymill_train
