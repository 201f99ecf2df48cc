"""A search's console: one raymill line per finished trial, in place of Tune's status tables.

Tune's default output (`RunConfig(verbose=1)`) drew a configuration box, a status table every few
seconds and a result box per trial: hundreds of lines for a small search, against the console's
one-line-per-event rule (README "Console"). `--verbose` brings Tune's own output back. A module of
its own because a Tuner pickles its callbacks by reference: the class must live at module level.
"""
from __future__ import annotations

import logging

from ray import tune

from stages.common.console import tune_verbosity as verbosity  # noqa: F401 (the search's; re-exported)
from stages.common.trials import ended as trial_ended

__all__ = ["TrialLines", "verbosity"]

log = logging.getLogger(__name__)


class TrialLines(tune.Callback):
    """`tune: trial <id> <outcome> after <n>/<max> epochs, val_acc ..., <params>` per finished trial."""

    # Class-level defaults: a search resumed from an older raymill unpickles an instance (Tuner.restore
    # restores its RunConfig's callbacks) whose __dict__ lacks the later attributes.
    started = False
    best: dict | None = None

    def __init__(self, total: int, max_epochs: int, metric: str, keys: list[str]):
        self.total, self.max_epochs, self.metric, self.keys = total, max_epochs, metric, keys
        self.done, self.started, self.best = 0, False, {}

    def on_step_begin(self, iteration: int, trials: list, **info) -> None:
        if not self.started:  # a resumed search counts on from the trials that had ended ("1/6" again before)
            self.started = True
            self.done = sum(t.status in ("TERMINATED", "ERROR") for t in trials)

    def on_trial_result(self, iteration: int, trials: list, trial, result: dict, **info) -> None:
        value = result.get(self.metric)
        if result.get("position_step") == 0 and isinstance(value, (int, float)):  # epoch ends only
            lower = self.metric == "val_loss"
            self.best = self.best if self.best is not None else {}
            held = self.best.get(trial.trial_id)
            if held is None or (value < held[0] if lower else value > held[0]):
                self.best[trial.trial_id] = (value, result.get("epoch"))

    def on_trial_complete(self, iteration: int, trials: list, trial, **info) -> None:
        # trials.md's rule: a trial whose loss went NaN reads "diverged" here too, not "stopped early"
        ended, epochs, planned = trial_ended(trial, False, self.max_epochs)
        last = trial.last_result or {}
        best = (self.best or {}).get(trial.trial_id)  # the line had shown the last epoch's value alone
        said = f", best {_number(best[0])} at epoch {best[1]}" if best and best[0] != last.get(self.metric) else ""
        self._line(trial, f"{ended.replace('_', ' ')} after {epochs}/{planned} epoch(s), "
                          f"{self.metric} {_number(last.get(self.metric))}{said}")

    def on_trial_error(self, iteration: int, trials: list, trial, **info) -> None:
        self._line(trial, "failed (see its error in trials.md)")

    def _line(self, trial, what: str) -> None:
        self.done += 1
        params = ", ".join(f"{k}={_number(trial.config.get(k))}" for k in self.keys if k in trial.config)
        log.info("tune: %d/%d trial %s %s; %s", self.done, self.total, trial.trial_id, what, params)


def _number(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)
