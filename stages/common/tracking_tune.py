"""Tune's MLflow logger: Ray's `MLflowLoggerCallback`, made failure-proof and outcome-aware.

Separate from stages/common/tracking.py because it imports Ray at module level (a Tuner pickles its
callbacks by reference, so the class must live at module level).
"""
from __future__ import annotations

import os
from typing import Any, Callable

from ray.air.integrations.mlflow import MLflowLoggerCallback

from stages.common import trials
from stages.common.tracking_guard import has_failed, warn_failure

__all__ = ["TrialLogger"]

# Report keys that are Tune's or the loop's bookkeeping, not a trial's metrics: each had become an
# MLflow metric per report (config/lr beside raymill's config.lr, pid, timestamp, done, ...)
_BOOKKEEPING = frozenset({"config", "pid", "timestamp", "done", "should_checkpoint", "at", "first_batch_at",
                          "time_since_restore", "iterations_since_restore", "position_step"})


class TrialLogger(MLflowLoggerCallback):
    """One child run per trial, tagged `raymill.outcome` by trials.md's rule: a trial the scheduler
    (ASHA) stopped before its planned epochs ends KILLED (`stopped_early`); failed and diverged trials
    FAILED; the rest FINISHED."""

    def __init__(self, *, max_epochs: int, **kwargs: Any):
        super().__init__(**kwargs)
        self.max_epochs = max_epochs

    def _guard(self, what: str, fn: Callable, *args: Any) -> None:
        uri = self.tracking_uri or ""
        if has_failed(uri):
            return
        try:
            fn(*args)
        except Exception as e:  # a dead server must not stop the search
            warn_failure(uri, e, f"the search goes on untracked ({what})")

    def setup(self, *args: Any, **kwargs: Any) -> None:
        # A dead server must cost one short request, not MLflow's default retries with backoff.
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        self._trial_runs = {}
        self._earlier: dict[str, str] | None = None  # trial name -> run id of an interrupted attempt, read once
        self._guard("setup", super().setup)

    def log_trial_start(self, trial) -> None:
        if trial not in self._trial_runs:  # a resumed search: the trial's run from before goes on
            self._guard("trial resume", self._resume_run, trial)
            if trial in self._trial_runs:
                self._guard("trial resume", self._log_explored, trial)
                return
        if trial in self._trial_runs:  # restarted by a PBT exploit: a donor's weights, an explored config
            self._guard("trial exploit", self._log_explored, trial)
        else:
            self._guard("trial start", super().log_trial_start, trial)
            self._guard("trial start", self._log_explored, trial)

    def _resume_run(self, trial) -> None:
        """Adopt this trial's run of an interrupted attempt of the same search (same parent run): a
        resume had started a second child run per trial, the first left RUNNING for good. The parent's
        child runs are listed once per search (one request, not one per trial start)."""
        from mlflow import MlflowClient

        client = MlflowClient(tracking_uri=self.tracking_uri)
        if self._earlier is None:
            self._earlier = {}
            experiment = client.get_experiment_by_name(self.experiment_name) if self.experiment_name else None
            if experiment is not None and (parent := (self.tags or {}).get("mlflow.parentRunId")) is not None:
                for run in client.search_runs([experiment.experiment_id], max_results=10_000,
                                              filter_string=f"tags.`mlflow.parentRunId` = '{parent}'"):
                    self._earlier.setdefault(run.data.tags.get("trial_name", ""), run.info.run_id)
        if (run_id := self._earlier.get(str(trial))) is not None:
            self._trial_runs[trial] = run_id
            client.update_run(run_id, status="RUNNING")

    def on_experiment_end(self, trials: list, **info: Any) -> None:
        """A search that ends with trials unfinished (Ctrl-C, Tune's stop): their runs end KILLED, not
        RUNNING forever; a resume takes them up again (`_resume_run`)."""
        self._guard("search end", self._end_unfinished, trials)

    def _end_unfinished(self, trials: list) -> None:
        from mlflow import MlflowClient

        client = MlflowClient(tracking_uri=self.tracking_uri)
        for trial in trials:
            if trial in self._trial_runs and trial.status not in ("TERMINATED", "ERROR"):
                client.set_terminated(self._trial_runs[trial], status="KILLED")

    def _log_explored(self, trial) -> None:
        """The trial's numeric config as metrics `config.<key>` at its current iteration. MLflow
        params are write-once: logging PBT's explored lr as a param again raised, and the one
        warning then turned tracking off for the rest of the search, its model included."""
        from mlflow import MlflowClient

        step = int((trial.last_result or {}).get("training_iteration", 0))
        client = MlflowClient(tracking_uri=self.tracking_uri)
        for key, value in trial.config.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                client.log_metric(self._trial_runs[trial], f"config.{key}", float(value), step=step)

    def log_trial_result(self, iteration: int, trial, result: dict) -> None:
        if trial in self._trial_runs:  # the config is logged once (params, `config.*`), not per report
            # test_*: the workers score the test split for the hand-off only; logged per trial, it
            # put the test score beside every trial's val score for a person to choose by
            kept = {k: v for k, v in result.items() if k not in _BOOKKEEPING and not k.startswith("test_")}
            self._guard("trial result", super().log_trial_result, iteration, trial, kept)

    def log_trial_end(self, trial, failed: bool = False) -> None:
        if trial in self._trial_runs:
            self._guard("trial end", self._end, trial, failed)

    def _end(self, trial, failed: bool) -> None:
        outcome, epochs, _ = trials.ended(trial, failed, self.max_epochs)  # trials.md's rule
        from mlflow import MlflowClient

        client = MlflowClient(tracking_uri=self.tracking_uri)
        run_id = self._trial_runs[trial]
        client.set_tag(run_id, "raymill.outcome", outcome)
        client.set_tag(run_id, "raymill.epochs", str(epochs))
        # a diverged trial (NaN loss) left no usable model: FAILED, its tag says why
        client.set_terminated(run_id, status={"failed": "FAILED", "diverged": "FAILED",
                                              "stopped_early": "KILLED"}.get(outcome, "FINISHED"))
