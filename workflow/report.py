"""The run summary: `report.json` and `report.md` in the run folder, and the table the CLI prints last."""
from __future__ import annotations

import json
import logging
from typing import Any

from stages.common import console, storage, tracking
from stages.common.artifacts import Artifact
from stages.common.config import Config
from stages.train import timings as train_timings

log = logging.getLogger(__name__)

__all__ = ["write", "summary", "RAY_START"]

RAY_START = "Ray's start, with torch imported beside it"


def _rows(data: Artifact, model: Artifact, preds: Artifact, timings: dict[str, float],
          exported: Artifact | None = None) -> list[dict]:
    etl_m, train_m, infer_m = data.manifest, model.manifest.get("metrics", {}), preds.manifest.get("metrics", {})
    train_stage = "tune" if "tune" in timings else "train"
    return _stage_rows(etl_m, train_m, infer_m, train_stage, timings) + _export_row(exported, timings)


def _export_row(exported: Artifact | None, timings: dict[str, float]) -> list[dict]:
    """The export's row: its format and its check against the model in torch (it had no row)."""
    if exported is None:
        return []
    m, check = exported.manifest, exported.manifest.get("check") or {}
    return [{"stage": "export", "rows": check.get("images"), "seconds": timings["export"], "images_per_s": None,
             "note": f"{m.get('format')}, logits within {check.get('logits_max_abs_diff', 0):.1e} of torch, classes "
                     f"agree {check.get('class_agreement', 0):.1%}"}]


def _stage_rows(etl_m: dict, train_m: dict, infer_m: dict, train_stage: str, timings: dict[str, float]) -> list[dict]:
    return [
        {"stage": "etl", "rows": etl_m["totals"]["rows_out"], "seconds": timings["etl"],
         "images_per_s": etl_m["metrics"]["images_per_s"],
         "note": f"{etl_m['totals']['quarantined']} quarantined"},
        {"stage": train_stage, "rows": sum(etl_m["counts"]["train"].values()),
         "seconds": timings[train_stage], "images_per_s": train_m.get("images_per_s"),
         "note": f"test_acc {console.score(train_m.get('test_acc'))}, stall "
                 f"{(train_m.get('stall_fraction') or 0):.1%}"},
        {"stage": "infer", "rows": infer_m.get("rows"), "seconds": timings["infer"],
         "images_per_s": infer_m.get("images_per_s"), "note": f"accuracy {console.score(infer_m.get('accuracy'))}"},
    ]


def _table(rows: list[dict], serve: dict | None) -> str:
    # images/s is the stage's rate while it worked (train: every epoch's images over the epochs' wall;
    # infer: its predictions), not rows / seconds: the seconds hold the stage's fixed costs too
    lines = ["| stage | rows | seconds | images/s at work | note |", "|---|---:|---:|---:|---|"]
    for r in rows:
        ips = "-" if not r["images_per_s"] else f"{r['images_per_s']:.0f}" if r["images_per_s"] >= 10 \
            else f"{r['images_per_s']:.2g}"
        # a reused stage took its seconds to be found; its rates are those of the run that made it
        note = f"reused (unchanged; images/s of the run that made it), {r['note']}" if r.get("reused") else r["note"]
        lines.append(f"| {r['stage']} | {r['rows']} | {r['seconds']:.1f} | {ips} | {note} |")
    if serve:
        lines.append(f"| serve | {serve['requests']} | - | - | p50 {serve['p50_ms']:.1f} ms, "
                     f"p99 {serve['p99_ms']:.1f} ms |")
    lines.append("")  # a line right below a table is one of its rows in GitHub's markdown
    lines.append("images/s at work: train's over its epochs (every epoch's images), infer's over its predictions; "
                 "the seconds also hold each stage's fixed costs")
    return "\n".join(lines)


def _tracking(cfg: Config, model: Artifact) -> dict[str, Any] | None:
    """The MLflow run of the model (train run, or the tune parent run), for the report's links."""
    found = tracking.find(model.path, cfg.s3) if cfg.tracking.enabled else None
    if not found:
        return None
    return {**found, "ui": tracking.ui_command(found["uri"])}


def _tracking_md(info: dict[str, Any] | None) -> str:
    if not info:
        return "- MLflow: not tracked (tracking.enabled=false, or the tracking store failed: see the log)\n"
    model = f"; model `{info['model_name']}` version {info['model_version']}" if info.get("model_version") else ""
    return (f"- MLflow: run `{info['run_id']}` (experiment {info['experiment_id']}) in `{info['uri']}`{model}; "
            f"it holds the train params, per-epoch metrics, artifacts and the infer accuracy. "
            f"Browse: `{info['ui']}`, then open "
            f"`http://127.0.0.1:5000/#/experiments/{info['experiment_id']}/runs/{info['run_id']}`\n")


def write(cfg: Config, data: Artifact, model: Artifact, preds: Artifact, serve: dict | None,
          timings: dict[str, float], seconds: float, reused: set[str] = frozenset(),
          before_s: float | None = None, ray_s: float | None = None, exported: Artifact | None = None) -> dict[str, Any]:
    """Write report.json and report.md; return the report (`summary(report)` is its console text).
    `reused`: the stages this run took unchanged from an earlier one; `before_s`: the seconds
    before the first stage and `ray_s` Ray's start, None when no stage needed it (the run's split
    says where the whole wait went)."""
    rows = [{**r, "reused": r["stage"] in reused} for r in _rows(data, model, preds, timings, exported)]
    train_m, infer_m = model.manifest.get("metrics", {}), preds.manifest.get("metrics", {})
    tracked = _tracking(cfg, model)
    split = _train_split(cfg, model, timings) if "train" in timings and "train" not in reused else None
    name = cfg.run.named(cfg.run.dir)
    report = {"run": name, "dir": cfg.run.dir, "seconds": round(seconds, 1), "stages": rows,
              "run_seconds_split": _run_split(timings, seconds, before_s, ray_s, serve is not None),
              "train_seconds_split": split,
              "test_accuracy": infer_m.get("accuracy", train_m.get("test_acc")),
              "input_stall_fraction": train_m.get("stall_fraction"), "bottleneck": train_m.get("verdict"),
              "serve": serve, "outputs": {"etl": data.path, "model": model.path, "predictions": preds.path},
              "mlflow": tracked, "table": _table(rows, serve)}
    md = (f"# raymill run `{name}`\n\n{report['table']}\n\n"
          f"- test accuracy: **{console.score(report['test_accuracy'])}**\n"
          f"- bottleneck: {report['bottleneck']}\n"
          f"- curves: ![curves]({storage.join('train' if 'train' in timings else 'tune', 'curves.png')})\n"
          f"{_tracking_md(tracked)}"
          f"- total: {seconds:.1f} s"
          + "".join(f"; {k} {v:.1f} s" for k, v in (report["run_seconds_split"] or {}).items())
          + f"\n{_split_md(split)}")
    fs, root = storage.filesystem(cfg.run.dir, cfg.s3)
    storage.write_bytes_atomic(fs, storage.join(root, "report.json"), json.dumps(report, indent=2).encode())
    storage.write_bytes_atomic(fs, storage.join(root, "report.md"), md.encode())
    return report


def _run_split(timings: dict[str, float], seconds: float, before_s: float | None, ray_s: float | None,
               served: bool) -> dict[str, float] | None:
    """The run's wall in parts that add up to it: before the first stage, Ray's start (when a stage
    needed it), each stage's own work, the rest."""
    if before_s is None:
        return None
    rest = "the rest: " + ("the endpoint's start and probe, " if served else "") + "the report"
    ray = {} if ray_s is None else {RAY_START: round(ray_s, 2)}
    return {"before the first stage: the command's start, imports, checks": round(before_s, 2), **ray,
            **{name: round(value, 2) for name, value in timings.items()},
            rest: round(seconds - before_s - (ray_s or 0.0) - sum(timings.values()), 2)}


def summary(report: dict[str, Any]) -> str:
    """The console summary of a run: the stage table, accuracy, bottleneck, where to look next."""
    mlflow = report.get("mlflow")
    seconds = report["seconds"]
    lines = [f"raymill run {report['run']}: {seconds:.1f} s" if seconds < 10 else
             f"raymill run {report['run']}: {seconds:.0f} s", report["table"],
             f"test accuracy {console.score(report['test_accuracy'])}; bottleneck: {report['bottleneck']}",
             f"report: {storage.join(report['dir'], 'report.md')}"]
    if mlflow:
        lines.append(f"mlflow: run {mlflow['run_id']}; browse with: {mlflow['ui']}")
    return "\n".join(lines)


def _train_split(cfg: Config, model: Artifact, timings: dict[str, float]) -> dict[str, float] | None:
    """Where the train stage's seconds went (stages.train.timings); None for a resumed run, or
    when its metrics cannot be read (the report leaves the section out; the run is not failed)."""
    fs, root = storage.filesystem(model.path, cfg.s3)
    try:
        history = [json.loads(x) for x in fs.cat_file(storage.join(root, "metrics.jsonl")).decode().splitlines()]
        return train_timings.split(model.manifest, history, timings["train"])
    except (OSError, ValueError, KeyError) as e:
        log.info("report: no split of the train stage's time (%s)", e)
        return None


def _split_md(split: dict[str, float] | None) -> str:
    if not split:
        return ""
    rows = "".join(f"| {name} | {s:.2f} |\n" for name, s in split.items())
    fixed = sum(s for name, s in split.items() if name != train_timings.EPOCHS)
    return (f"\n## Where the train stage's {sum(split.values()):.1f} s went\n\n| part | seconds |\n|---|---:|\n{rows}"
            f"\nFixed cost (all but the epochs' training passes): {fixed:.1f} s.\n")
