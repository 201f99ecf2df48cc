"""Results of a Tune search: per-trial summaries, tables, the best checkpoint, and publishing.

Everything here reads public results only: the `ResultGrid` (each `Result`'s path, config,
metrics, error and metrics dataframe) and the checkpoints the trials' Train runs kept.
"""
from __future__ import annotations

import csv
import io
import json
import logging
import math
import re
import time
from pathlib import Path
from typing import Any

from stages.feed import meters
from stages.model.publish import (curves, init_inputs, init_lineage, model_info, read_checkpoint, save_model,
                                  state_hash, test_metrics)
from stages.common import console, storage
from stages.common.artifacts import Artifact, base_manifest, config_hash, data_fingerprint, write_manifest
from stages.common.config import TrainConfig, TuneConfig, section_dict
from stages.common.trials import OUTCOMES, outcome
from stages.tune.checks import EXPERIMENT, searched_keys, tie_value, trial_train_config

__all__ = ["EXPERIMENT", "summaries", "write_tables", "pick_best", "publish", "mark_finished"]

log = logging.getLogger(__name__)


def _fs(ray_dir: str, s3):
    import pyarrow.fs as pafs

    fs, base = storage.pyarrow_filesystem(ray_dir, s3)
    return fs or pafs.LocalFileSystem(), base


def _checkpoint_history(ray_dir: str, s3, trial_id: str, metric: str) -> list[dict[str, Any]]:
    """Epoch-end checkpoints that the trial kept, with the metric from meta.json: those of its
    Train run (`trial-<id>/checkpoint-e…`, a TorchTrainer trial) or those it reported to Tune
    itself (`tune/trial-<id>/checkpoint_…`, a one-worker trial).

    Tune's own record misses a report that was in flight when a search was interrupted (the
    checkpoint was still saved), so the kept checkpoints complete it.
    """
    import pyarrow.fs as pafs

    fs, base = _fs(ray_dir, s3)
    found = []
    for folder in (f"{base}/trial-{trial_id}", f"{base}/{EXPERIMENT}/trial-{trial_id}"):
        for item in fs.get_file_info(pafs.FileSelector(folder, allow_not_found=True)):
            if item.type != pafs.FileType.Directory or not re.fullmatch(r"checkpoint[-_].*", item.base_name):
                continue
            try:
                with fs.open_input_stream(f"{item.path}/meta.json") as f:
                    meta = json.loads(f.read())
            except (OSError, ValueError):  # incomplete checkpoint: meta.json is written last
                continue
            value = meta.get("val", {}).get(metric)
            if meta.get("step") == 0 and meta.get("epoch", 0) >= 1 and value is not None and not _nan(value):
                found.append({"epoch": int(meta["epoch"]), "value": float(value), "checkpoint_path": item.path,
                              "tie": tie_value(meta.get("val", {}), metric)})
    return found


def _history(result, metric: str) -> tuple[list[dict[str, Any]], bool]:
    """(epoch-end reports of `metric`, whether the loss diverged) from a trial's results."""
    df = result.metrics_dataframe
    history, diverged = [], False
    if df is not None and len(df) and "epoch" in df:
        diverged = bool("stopped" in df and (df["stopped"] == "nan_loss").any())
        ends = df[df["position_step"].fillna(-1) == 0] if "position_step" in df else df.iloc[0:0]
        for _, r in ends.iterrows():
            if r["epoch"] >= 1 and r.get(metric) is not None and not _nan(r[metric]):
                history.append({"epoch": int(r["epoch"]), "value": float(r[metric]),
                                "checkpoint_path": _checkpoint_path(result, r), "tie": tie_value(r, metric)})
    return history, diverged


def _trained_params(result, keys: list[str]) -> dict[str, Any]:
    """The searched values the trial's last report was trained with. PBT changes a trial's config at
    each exploit, and `Result.config` and params.json both named another one than the last epoch
    trained with (a donor's unperturbed values; an exploit after the last epoch that never trained)."""
    df = result.metrics_dataframe
    if df is None or not len(df):
        return {}
    last = df.iloc[-1]
    cells = {k: last[f"config/{k}"] for k in keys if f"config/{k}" in df}
    return {k: _plain(v) for k, v in cells.items()
            if v is not None and not (isinstance(v, float) and math.isnan(v))}


def _plain(value: Any) -> Any:
    """A dataframe cell as the Python value it was reported as (numpy scalars are not JSON)."""
    return value.item() if hasattr(value, "item") else value


def _checkpoint_path(result, row) -> str | None:
    """Where a report's checkpoint is: a TorchTrainer trial reports the path of its Train run's
    checkpoint; a one-worker trial's checkpoint is a folder Tune named in the trial folder."""
    path = row.get("checkpoint_path")
    if isinstance(path, str):
        return path
    name = row.get("checkpoint_dir_name")
    return f"{str(result.path).rstrip('/')}/{name}" if isinstance(name, str) else None


def _startup_s(result) -> float | None:
    """Seconds from the trial's start to its first batch (the first report that carries it)."""
    df = result.metrics_dataframe
    if df is None or "startup_s" not in df:
        return None
    values = df["startup_s"].dropna()
    return round(float(values.iloc[0]), 2) if len(values) else None


def _trial_config(result, ray_dir: str, s3) -> dict[str, Any]:
    """A trial's sampled config. `Result.config` comes from its last report, so a trial that
    failed before reporting has none; Tune's `params.json` in the trial folder has it ({} when the
    trial never started)."""
    if result.config:
        return result.config
    fs, _ = _fs(ray_dir, s3)
    try:
        with fs.open_input_stream(f"{str(result.path).rstrip('/')}/params.json") as f:
            return json.loads(f.read())
    except (OSError, ValueError):
        return {}


def mark_finished(ray_dir: str, trial_id: str, s3: Any | None) -> None:
    """Called by a trial whose function ran to its end. Tune marks such a trial's last result `done`
    only in memory: its result.json and saved state keep the last report (`done: false`), so after a
    Ctrl-C or a killed driver the rerun read it as unfinished, Tune did not run it again (its state
    says TERMINATED), and every rerun refused to publish. A trial the scheduler stops is saved `done`."""
    fs, root = storage.filesystem(ray_dir, s3)
    storage.write_bytes_atomic(fs, storage.join(root, EXPERIMENT, FINISHED_RECORD, trial_id), b"")


def finished(ray_dir: str, s3: Any | None) -> set[str]:
    """The trial ids `mark_finished` recorded (none for a search of an older raymill: `done` alone)."""
    fs, root = storage.filesystem(ray_dir, s3)
    try:
        listed = fs.ls(storage.join(root, EXPERIMENT, FINISHED_RECORD), detail=False)
        return {p.rstrip("/").rsplit("/", 1)[-1] for p in listed}
    except FileNotFoundError:
        return set()


def _status(result, trial_id: str, ended: set[str]) -> str:
    """ERROR, TERMINATED (finished: by completion or a scheduler stop) or UNFINISHED.

    A finished trial's last result is marked `done` in the search that ran it; after a restore only
    `mark_finished`'s record (`ended`) says so for one that ran to its end. The trials Tune stops
    when a search is interrupted are in neither (their saved state says RUNNING: a restore resumes them).
    """
    if result.error:
        return "ERROR"
    return "TERMINATED" if (result.metrics or {}).get("done") or trial_id in ended else "UNFINISHED"


def _ran_to_its_end(trial_id: str, epochs: int, error: str) -> str:
    """A failed trial whose checkpoints hold every planned epoch ran to its end before a driver kill;
    Tune's restore failed it (retention deleted the checkpoint its saved state named; ASHA stops a
    trial at its last report, so mark_finished never ran). Counted finished: its checkpoints rank."""
    log.info("tune: trial %s holds all %d epochs' checkpoints; restoring it failed (%s): counted as finished",
             trial_id, epochs, error or "no error text")
    return ""


def summaries(grid, cfg: TuneConfig, train_cfg: TrainConfig, ray_dir: str, s3) -> list[dict[str, Any]]:
    """One dict per trial: params, status, per-epoch history of the metric, best value, timing."""
    rows, ended = [], finished(ray_dir, s3)
    for result in grid:
        trial_id = str(result.path).rstrip("/").rsplit("/", 1)[-1].removeprefix("trial-")
        params = {**{k: _trial_config(result, ray_dir, s3).get(k) for k in searched_keys(cfg)},
                  **_trained_params(result, searched_keys(cfg))}
        history, diverged = _history(result, cfg.metric)
        # `kept` adds checkpoints Tune was never told about (a report in flight at an interruption,
        # or the epoch a stopped run finished meanwhile): epochs that ran, so they count in epochs_run
        # (an interrupted trial had shown epochs_run 0 beside a best_epoch 1).
        seen = {h["epoch"] for h in history}
        kept = [h for h in _checkpoint_history(ray_dir, s3, trial_id, cfg.metric) if h["epoch"] not in seen]
        candidates = sorted(history + kept, key=lambda h: h["epoch"])
        epochs_run = max((h["epoch"] for h in candidates), default=0)
        best = min(candidates, key=_rank(cfg)) if candidates else None  # as pick_best ranks
        status = _status(result, trial_id, ended)
        try:
            planned = trial_train_config(train_cfg, params, cfg).epochs
        except ValueError:  # params that fail validation fail the trial too
            planned = cfg.max_epochs
        # by what the scheduler saw, unless the trial's function recorded its own end (`ended`): Tune's
        # record of a resumed trial can miss epochs its checkpoints hold (a PBT resume: its result.json
        # kept epoch 1 of 3, and the row said stopped_early beside 3 epochs run). Its own name: reusing
        # `ended` had made every trial after the first UNFINISHED in a resumed search.
        ran = epochs_run if trial_id in ended else max(seen, default=0)
        error = str(result.error).strip().splitlines()[-1][:300] if result.error else ""
        if status == "ERROR" and not diverged and epochs_run >= planned:  # see _ran_to_its_end
            status, ran, error = "TERMINATED", epochs_run, _ran_to_its_end(trial_id, epochs_run, error)
        result_outcome = outcome(status, diverged, ran, planned)
        wall = (result.metrics or {}).get("time_total_s")
        rows.append({"trial_id": trial_id, "status": status, "outcome": result_outcome, "params": params,
                     "best": best["value"] if best else None, "best_epoch": best["epoch"] if best else None,
                     "epochs_run": epochs_run, "epochs_planned": planned,
                     "stopped_early": result_outcome == "stopped_early",
                     "wall_s": round(float(wall), 1) if wall is not None else None, "error": error,
                     "startup_s": _startup_s(result),
                     "history": history, "candidates": candidates,
                     "last": {k: v for k, v in (result.metrics or {}).items()
                              if k in ("images_per_s", "stall_fraction", "verdict")}})
    return sorted(rows, key=lambda r: r["trial_id"])


def write_tables(fs, root: str, trials: list[dict], cfg: TuneConfig) -> None:
    keys = searched_keys(cfg)
    header = ["trial_id", "status", "outcome", *keys, f"best_{cfg.metric}", "best_epoch", "epochs_run",
              "stopped_early", "wall_s", "startup_s", "error"]
    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow(header)
    table = []
    for t in trials:
        row = [t["trial_id"], t["status"], t["outcome"], *[_fmt(t["params"][k]) for k in keys],
               _fmt(t["best"]), _fmt(t["best_epoch"]), t["epochs_run"], t["stopped_early"],
               _fmt(t["wall_s"]), _fmt(t["startup_s"]), t["error"]]
        writer.writerow(row)
        table.append(row)
    md = [f"# Tune trials ({cfg.scheduler}, metric {cfg.metric} {cfg.mode}, max {cfg.max_epochs} epochs)", "",
          "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    md += ["| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |" for row in table]
    counts = {o: sum(t["outcome"] == o for t in trials) for o in OUTCOMES}
    if left := sum(t["outcome"] not in OUTCOMES for t in trials):  # an interrupted search's
        counts["unfinished"] = left
    md += ["", ", ".join(f"{n} {o.replace('_', ' ')}" for o, n in counts.items()), ""]
    storage.write_bytes_atomic(fs, storage.join(root, "trials.csv"), buf.getvalue().encode())
    storage.write_bytes_atomic(fs, storage.join(root, "trials.md"), "\n".join(md).encode())


def _rank(cfg: TuneConfig):
    """A history entry's sort key, best first: the metric, then the other one (tie_value), then the
    earlier epoch. pick_best hands on by it; a trial's best_epoch (trials.md) is chosen by it too."""
    sign = -1 if cfg.mode == "max" else 1
    return lambda h: (sign * h["value"], h.get("tie", math.inf), h["epoch"])


def pick_best(trials: list[dict], cfg: TuneConfig, ray_dir: str, s3) -> dict | None:
    """{"trial", "entry"}: the best epoch over all finished trials whose checkpoint still holds it.

    Retention may have deleted an epoch's checkpoint; and a PBT trial that exploited a donor numbers
    its next checkpoints from the donor's, so a folder its earlier epoch reported can hold a later
    epoch's weights (seen: checkpoint_000001 overwritten). A checkpoint is taken only when its own
    meta.json names the entry's epoch and value: the model handed on is the one the entry scored.
    """
    fs, _ = _fs(ray_dir, s3)
    candidates = [(h, t) for t in trials if t["status"] == "TERMINATED" for h in t["candidates"]
                  if isinstance(h["checkpoint_path"], str)]
    rank = _rank(cfg)
    candidates.sort(key=lambda c: (*rank(c[0]), trials.index(c[1])))  # then the earlier trial
    for entry, trial in candidates:
        try:
            with fs.open_input_stream(f"{entry['checkpoint_path']}/meta.json") as f:
                meta = json.loads(f.read())
        except (OSError, ValueError):  # deleted by retention, or incomplete: meta.json is written last
            continue
        held = meta.get("val", {}).get(cfg.metric)
        if meta.get("epoch") == entry["epoch"] and held is not None and math.isclose(held, entry["value"]):
            return {"trial": trial, "entry": entry}
        log.info("tune: %s holds epoch %s now, not the epoch %d its trial %s reported there; passed over",
                 entry["checkpoint_path"], meta.get("epoch"), entry["epoch"], trial["trial_id"])
    return None


def _startup_summary(trials: list[dict]) -> dict[str, float | None]:
    """Median and worst trial start-up (trial start -> first batch), for the manifest's metrics."""
    import statistics

    values = [t["startup_s"] for t in trials if t["startup_s"] is not None]
    return {"startup_s_median": round(statistics.median(values), 2) if values else None,
            "startup_s_max": max(values, default=None)}


def _nan(value) -> bool:
    try:
        return math.isnan(float(value))
    except (TypeError, ValueError):
        return True


def _fmt(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def _search_png(trials: list[dict], cfg: TuneConfig) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for t in trials:
        if not t["history"]:
            continue
        epochs = [h["epoch"] for h in t["history"]]
        values = [h["value"] for h in t["history"]]
        params = ", ".join(f"{k}={_fmt(v)}" for k, v in t["params"].items())
        (line,) = ax.plot(epochs, values, marker=".", label=f"{t['trial_id'][-5:]} {params}"[:60])
        if t["outcome"] == "stopped_early":
            ax.plot(epochs[-1], values[-1], marker="x", markersize=10, color=line.get_color())
    failed = [t["trial_id"][-5:] for t in trials if t["outcome"] == "failed"]
    stopped = sum(t["outcome"] == "stopped_early" for t in trials)
    title = f"{cfg.scheduler}: {len(trials)} trials, {stopped} stopped early (x)"
    if failed:
        title += f", failed: {', '.join(failed)}"
    ax.set(xlabel="epoch", ylabel=cfg.metric, title=title)
    ax.set_xticks(range(1, cfg.max_epochs + 1))
    ax.grid(alpha=0.3)
    if any(t["history"] for t in trials):
        ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return buf.getvalue()




def _best_model_files(cfg: TuneConfig, tcfg: TrainConfig, data: Artifact, out: str, s3, loop: dict,
                      trial: dict, entry: dict) -> tuple[dict[str, bytes], dict, dict]:
    """Export the best checkpoint as model.pt + model.json; (files, test result, checkpoint meta)."""
    import tempfile
    import ray.train


    pafs, _ = storage.pyarrow_filesystem(storage.join(out, "ray"), s3)
    state, meta, _ = read_checkpoint(ray.train.Checkpoint(entry["checkpoint_path"], filesystem=pafs))
    info = model_info(tcfg, data, {
        "val_acc": meta.get("val", {}).get("val_acc"), "epoch": meta["epoch"],
        "version": f"tune-{trial['trial_id']}-{meta['epoch']}-{config_hash(state_hash(state))}",
        "tune": {"trial_id": trial["trial_id"], "params": trial["params"], cfg.metric: entry["value"]},
        **init_lineage(loop)})
    save_model(out, state, info, s3)
    # the trial's workers scored the test split at this epoch when it was their best val_acc
    row = next((h for h in meta["history"] if h.get("epoch") == meta["epoch"]), {})
    test = test_metrics(row, out, loop, tcfg.cache_dir, s3)
    files = {"metrics.jsonl": "".join(json.dumps(h) + "\n" for h in meta["history"]).encode()}
    with tempfile.TemporaryDirectory() as tmp:
        curves(meta["history"], Path(tmp) / "curves.png")
        files["curves.png"] = (Path(tmp) / "curves.png").read_bytes()
    return files, test, meta


def publish(cfg: TuneConfig, train_cfg: TrainConfig, data: Artifact, out: str, *, seed: int, s3, plan,
            loop: dict, trials: list[dict], best: dict, seconds_so_far: float) -> Artifact:
    """Write the search's files and the best trial's model to `out`; manifest.json last."""
    started = time.perf_counter()
    trial, entry = best["trial"], best["entry"]
    # the trial's config as it trained: its mean/std may come from train.init_from (loop["train"])
    tcfg = trial_train_config(TrainConfig.model_validate(loop["train"]), trial["params"], cfg)
    files, test, meta = _best_model_files(cfg, tcfg, data, out, s3, loop, trial, entry)
    best_json = {"trial_id": trial["trial_id"], "params": trial["params"], "metric": cfg.metric,
                 "value": entry["value"], "epoch": entry["epoch"], "checkpoint": entry["checkpoint_path"],
                 "train_config": section_dict(tcfg)}
    files.update({"best.json": json.dumps(best_json, indent=2).encode(), "search.png": _search_png(trials, cfg)})
    fs, root = storage.filesystem(out, s3)
    for name, payload in files.items():
        storage.write_bytes_atomic(fs, storage.join(root, name), payload)
    counts = {o: sum(t["outcome"] == o for t in trials) for o in OUTCOMES}
    manifest = base_manifest("tune", section_dict(cfg), {
        "data": data.path, "data_manifest_hash": config_hash(data.manifest),
        "data_fingerprint": data_fingerprint(data.manifest), "train": section_dict(train_cfg), "seed": seed,
        **init_inputs(loop)})
    feed = meters.over_epochs(meta["history"])  # the best trial's epochs to its checkpoint, not its last one's
    val_acc = meta.get("val", {}).get("val_acc")
    metrics = {"best_val_acc": val_acc, f"best_{cfg.metric}": entry["value"], "model_val_acc": val_acc,
               "test_acc": test["acc"], "test_rows": test["rows"], "trials": len(trials), **counts,
               "seconds": round(seconds_so_far + time.perf_counter() - started, 1),
               **feed, **_startup_summary(trials)}
    manifest.update({
        "resource_plan": {"concurrent_trials": plan.concurrent_trials, "trial_in_function": plan.in_function,
                          "trial_resources": plan.trial_resources(tcfg.worker_resources), **plan.workers.as_dict()},
        "startup_s": {t["trial_id"]: t["startup_s"] for t in trials},
        "experiment": storage.join(out, "ray", EXPERIMENT), "best": best_json,
        "model": {"path": "model.pt", "info": "model.json", "architecture": tcfg.model,
                  "source": "trial checkpoint"},
        "metrics": metrics, "files": sorted({*files, "trials.csv", "trials.md", "model.pt", "model.json"})})
    write_manifest(out, manifest, s3)  # the publish step, last
    log.info("tune: best %s %.3f (trial %s, %s); %d trials: %d completed, %d stopped early, %d diverged, "
             "%d failed; test_acc %s; %.0fs", cfg.metric, entry["value"], trial["trial_id"], json.dumps(trial["params"]),
             len(trials), counts["completed"], counts["stopped_early"], counts["diverged"], counts["failed"],
             console.score(test["acc"]), metrics["seconds"])
    return Artifact("tune", str(out).rstrip("/"), manifest)

FINISHED_RECORD = "finished"  # in it: an empty file per trial whose function ran to its end (mark_finished)
