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

    def __init__(self, total: int, max_epochs: int, metric: str, keys: list[str]):
        self.total, self.max_epochs, self.metric, self.keys = total, max_epochs, metric, keys
        self.done = 0

    def on_trial_complete(self, iteration: int, trials: list, trial, **info) -> None:
        # trials.md's rule: a trial whose loss went NaN reads "diverged" here too, not "stopped early"
        ended, epochs, planned = trial_ended(trial, False, self.max_epochs)
        last = trial.last_result or {}
        self._line(trial, f"{ended.replace('_', ' ')} after {epochs}/{planned} epoch(s), "
                          f"{self.metric} {_number(last.get(self.metric))}")

    def on_trial_error(self, iteration: int, trials: list, trial, **info) -> None:
        self._line(trial, "failed (see its error in trials.md)")

    def _line(self, trial, what: str) -> None:
        self.done += 1
        params = ", ".join(f"{k}={_number(trial.config.get(k))}" for k in self.keys if k in trial.config)
        log.info("tune: %d/%d trial %s %s; %s", self.done, self.total, trial.trial_id, what, params)


def _number(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)
