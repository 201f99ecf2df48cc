"""The run summary: a table on stdout, `report.json` and `report.md` in the run folder."""
from __future__ import annotations

import json
from typing import Any

from workflow import storage
from workflow.artifacts import Artifact
from workflow.config import Config

__all__ = ["write"]


def _rows(data: Artifact, model: Artifact, preds: Artifact, timings: dict[str, float]) -> list[dict]:
    etl_m, train_m, infer_m = data.manifest, model.manifest.get("metrics", {}), preds.manifest.get("metrics", {})
    train_stage = "tune" if "tune" in timings else "train"
    return [
        {"stage": "etl", "rows": etl_m["totals"]["rows_out"], "seconds": timings["etl"],
         "images_per_s": etl_m["metrics"]["images_per_s"],
         "note": f"{etl_m['totals']['quarantined']} quarantined"},
        {"stage": train_stage, "rows": sum(etl_m["counts"]["train"].values()),
         "seconds": timings[train_stage], "images_per_s": train_m.get("images_per_s"),
         "note": f"test_acc {train_m.get('test_acc', float('nan')):.3f}, stall "
                 f"{(train_m.get('stall_fraction') or 0):.1%}"},
        {"stage": "infer", "rows": infer_m.get("rows"), "seconds": timings["infer"],
         "images_per_s": infer_m.get("images_per_s"), "note": f"accuracy {infer_m.get('accuracy', float('nan')):.3f}"},
    ]


def _table(rows: list[dict], serve: dict | None) -> str:
    lines = ["| stage | rows | seconds | images/s | note |", "|---|---:|---:|---:|---|"]
    for r in rows:
        ips = f"{r['images_per_s']:.0f}" if r["images_per_s"] else "-"
        lines.append(f"| {r['stage']} | {r['rows']} | {r['seconds']:.1f} | {ips} | {r['note']} |")
    if serve:
        lines.append(f"| serve | {serve['requests']} | - | - | p50 {serve['p50_ms']:.1f} ms, "
                     f"p99 {serve['p99_ms']:.1f} ms |")
    return "\n".join(lines)


def write(cfg: Config, data: Artifact, model: Artifact, preds: Artifact, serve: dict | None,
          timings: dict[str, float], seconds: float) -> dict[str, Any]:
    rows = _rows(data, model, preds, timings)
    train_m, infer_m = model.manifest.get("metrics", {}), preds.manifest.get("metrics", {})
    report = {"run": cfg.run.name, "dir": cfg.run.dir, "seconds": round(seconds, 1), "stages": rows,
              "test_accuracy": infer_m.get("accuracy", train_m.get("test_acc")),
              "input_stall_fraction": train_m.get("stall_fraction"), "bottleneck": train_m.get("verdict"),
              "serve": serve, "outputs": {"etl": data.path, "model": model.path, "predictions": preds.path}}
    table = _table(rows, serve)
    md = (f"# raymill run `{cfg.run.name}`\n\n{table}\n\n"
          f"- test accuracy: **{report['test_accuracy']:.3f}**\n"
          f"- bottleneck: {report['bottleneck']}\n"
          f"- curves: ![curves]({storage.join('train' if 'train' in timings else 'tune', 'curves.png')})\n"
          f"- total: {seconds:.0f} s\n")
    fs, root = storage.filesystem(cfg.run.dir, cfg.s3)
    storage.write_bytes_atomic(fs, storage.join(root, "report.json"), json.dumps(report, indent=2).encode())
    storage.write_bytes_atomic(fs, storage.join(root, "report.md"), md.encode())
    print(f"\nraymill run {cfg.run.name}: {seconds:.0f} s\n{table}\n"
          f"test accuracy {report['test_accuracy']:.3f}; bottleneck: {report['bottleneck']}\n"
          f"report: {storage.join(cfg.run.dir, 'report.md')}", flush=True)
    return report
