"""Where a train stage's wall went: Ray's start-up, raymill's own fixed costs, and the epochs.

Read from what the stage publishes: the manifest's `timings` (the driver's clocks around
`trainer.fit()` and publishing) and metrics.jsonl's rows (rank 0's clocks: `loop_at` when its train
function started, `model_at` when its model was built, `ready_at` when its restore check ended, `at`
when each epoch's row was complete, before its report; `wall_s`, `eval_s`, `test_seconds`). The
driver and rank 0 share a node on one machine, so their `time.time()` clocks compare; across nodes
the two Ray parts absorb any clock skew between them. The parts add up to the stage's wall (the
telescoping sums below), so nothing is hidden in a remainder.
"""
from __future__ import annotations

from typing import Any

__all__ = ["split", "EPOCHS", "RAY_START", "WORKER_SETUP"]

EPOCHS = "epochs (real work)"  # the epochs' own training passes; every other part is the fixed cost
# the train function's start to its model on its device (and wrapped in DDP where ranks > 1): the same
# words on a CPU or a GPU run, so the label never names a device the run did not use
WORKER_SETUP = "worker: start, model on its device, DDP wrap"
# Ray's part by the run's host (stages.common.session.train_host)
RAY_START = {"ray_train": "Ray: controller and worker group start", "tune_trial": "Ray: Tune's trial actor start"}


def split(manifest: dict[str, Any], history: list[dict[str, Any]],
          stage_s: float | None = None) -> dict[str, float] | None:
    """Seconds per named part of one train stage, EPOCHS among them; None for a run
    that resumed from a checkpoint (its clocks span attempts). An attempt that failed before any
    checkpoint counts in Ray's part: the next one starts from scratch, as the first did. `stage_s`:
    the pipeline's own seconds for the stage (report.json), which add MLflow's run and model
    logging; without it that part is left out."""
    t = manifest.get("timings") or {}
    if not history or "loop_at" not in history[0] or any("loop_at" in h for h in history[1:]) \
            or any(h.get("resumed") for h in history) \
            or not {"before_fit_s", "fit_started_at", "fit_ended_at", "publish_s"} <= set(t) \
            or history[0]["loop_at"] < t["fit_started_at"] - 60:  # an earlier fit's rows (60 s: clock skew)
        return None
    first, last = history[0], history[-1]

    def own(h: dict[str, Any]) -> float:  # an epoch's training pass, its mid-epoch checkpoints, its evaluation
        return _wall(h) + h.get("report_s", 0.0) + h.get("eval_s", 0.0) + h.get("test_seconds", 0.0)

    worker = first["at"] - own(first) - first["loop_at"]  # the attempt's start to epoch 1's first step
    if {"model_at", "ready_at"} <= set(first):  # rows of this raymill: the set-up in three parts
        model, restore = first["model_at"] - first["loop_at"], first["ready_at"] - first["model_at"]
        workers = {WORKER_SETUP: model, "worker: restore check": restore,
                   "worker: first feed's start (decode pool), row bookkeeping": worker - model - restore}
    else:
        workers = {"worker: model, DDP, decode pool, restore": worker}
    between = sum(b["at"] - a["at"] - own(b) for a, b in zip(history, history[1:]))
    between += sum(h.get("report_s", 0.0) for h in history)
    parts = {"driver: checks, plan, trainer": t["before_fit_s"],
             RAY_START[t.get("host", "ray_train")]: first["loop_at"] - t["fit_started_at"],
             **workers,
             EPOCHS: sum(_wall(h) for h in history),
             "evaluation: val and test splits": sum(h.get("eval_s", 0.0) + h.get("test_seconds", 0.0)
                                                    for h in history),
             "reports and checkpoints": between,
             "last report and Ray's shutdown": t["fit_ended_at"] - last["at"],
             "publish: export, curves, manifest": t["publish_s"]}
    if stage_s is not None:  # what the stage's own clock (metrics.seconds + publish) did not see
        parts["MLflow, the manifest's write, the stage's record"] = stage_s - sum(parts.values())
    return {k: round(v, 3) for k, v in parts.items()}


def _wall(h: dict[str, Any]) -> float:
    """An epoch's training wall on rank 0, whose marks the split uses: `wall_s` is the ranks' mean,
    and a rank 1 that started its epoch earlier had made rank 0's set-up part negative (-0.071 s)."""
    return h.get("local_wall_s", h["wall_s"])

