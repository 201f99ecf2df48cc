"""On a GPU machine, as a user runs it: whole epochs of `raymill train` by ingest path, against the
GPU's own limit, and the demo's `raymill run` with training and inference on the GPU.

    python -m benchmarks gpu_user [--images 16000] [--epochs 3]

Data: synthetic 320x240 JPEGs (workflow.demo_data) through `raymill etl` at 224 px. Each row is
one `raymill train` subprocess given only the model settings (resnet50, train.use_gpu, batch
256, epochs); the planner picks workers, CPUs and decode processes. Its figure is the run's
images / Σ epoch wall (metrics.jsonl `wall_s`: the whole epoch, its first-batch wait included),
over all epochs and over epochs 2+. The limit: the same resnet50 step (bf16, channels_last, SGD)
on random tensors already on the GPU, measured in this process before the runs (benchmarks.gpu).
- `stream`: the default ingest; `ray_data`: Ray Data decodes on the node's spare CPUs;
- `finetune`: stream, starting from the stream run's model (train.init_from,
  train.backbone_lr_scale=0.1): the #38 line, a fine-tune fed like a run from scratch.
`demo run`: `raymill run` of configs/default.yaml on the demo (1,500 images), train and infer on
the GPU, tracking off (the device has no MLflow): wall from the command's start to its exit.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.common import fmt, md_table, ratio, targets_table, wait_for_quiet
from benchmarks.user_runs import epochs_summary, raymill as _cli, train_sets

__all__ = ["add_arguments", "run", "render"]

CORES = os.cpu_count() or 1
TARGETS = {"stream": 0.9, "ray_data": 0.9, "finetune": 0.9}
DEMO_RUN_S = 30.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--images", type=int, default=16000, help="generated source JPEGs (default 16000)")
    p.add_argument("--epochs", type=int, default=3, help="train.epochs of each run (default 3)")
    p.add_argument("--batch-size", type=int, default=256, help="train.batch_size (default 256)")
    p.add_argument("--paths", default="stream,ray_data,finetune", help="rows to run, comma-separated")
    p.add_argument("--skip-demo", action="store_true", help="leave out the demo `raymill run`")
    p.add_argument("--wait-for-quiet", type=float, default=20, help="seconds to wait for load < cores")


def available() -> str | None:
    """Why this benchmark cannot run here, or None (benchmarks.gpu's answer: imported late, so that
    rendering RESULTS.md from this module needs no torch)."""
    from benchmarks.gpu import available as gpu_available

    return gpu_available()


def _limit(batch: int) -> float:
    import torch

    from benchmarks.gpu import Step, limit

    step = Step()
    value = limit(step, batch, 224)["random tensors on the GPU"]
    del step
    torch.cuda.empty_cache()
    return value


def _train(path: str, data: Path, out: Path, args, init: Path | None) -> dict[str, Any]:
    sets = ["train.model=resnet50", "train.use_gpu=true", f"train.epochs={args.epochs}",
            f"train.batch_size={args.batch_size}", "tracking.enabled=false",
            f"train.ingest={'ray_data' if path == 'ray_data' else 'stream'}"]
    if init is not None:
        sets += [f"train.init_from={init}", "train.backbone_lr_scale=0.1"]
    return epochs_summary(out, _cli("train", "--data", str(data), "--output", str(out), *train_sets(sets)))


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    if reason := available():
        raise SystemExit(f"benchmarks gpu_user: {reason}")
    quiet = wait_for_quiet(args.wait_for_quiet, CORES)
    out: dict[str, Any] = {"args": vars(args), "cores": CORES, "device": torch.cuda.get_device_name(),
                           "quiet": quiet, "paths": {}}
    out["limit"] = _limit(args.batch_size)
    with tempfile.TemporaryDirectory(prefix="raymill-gpu-user-") as tmp:
        root = Path(tmp)
        from workflow import demo_data

        if not args.skip_demo:
            demo_data.generate(root / "demo", images=1500, seed=0)
            try:
                out["demo_run_s"] = _cli("run", "--config", "configs/default.yaml", "--set", f"run.source={root / 'demo'}",
                                         "--set", f"run.dir={root / 'run'}", "--set", "train.use_gpu=true",
                                         "--set", "infer.use_gpu=true", "--set", "tracking.enabled=false")
                report = json.loads((root / "run" / "report.json").read_text())
                out["demo_stages_s"] = {s["stage"]: round(s["seconds"], 1) for s in report["stages"]}
                out["demo_pipeline_s"] = report["seconds"]
                out["demo_run_split"] = report.get("run_seconds_split")  # the whole wait, in parts
                out["demo_train_split"] = report.get("train_seconds_split")
            except Exception as e:
                out["demo_error"] = str(e)[-1500:]
            print(f"[gpu_user] demo run: {out.get('demo_run_s')} s {out.get('demo_stages_s')} "
                  f"{out.get('demo_error', '')}", flush=True)
        demo_data.generate(root / "src", images=args.images, seed=0, size=(320, 240), png_fraction=0.0)
        print(f"[gpu_user] limit {out['limit']} img/s", flush=True)
        out["etl_s"] = _cli("etl", "--input", str(root / "src"), "--output", str(root / "etl"),
                            "--set", "etl.image_size=224", "--set", "tracking.enabled=false")
        for path in [p for p in args.paths.split(",") if p]:
            init = root / "stream" if path == "finetune" else None
            try:
                row = _train(path, root / "etl", root / path, args, init)
            except Exception as e:  # one failed row leaves the others their measurement
                row = {"error": str(e)[-1500:]}
            row["of_limit"] = ratio(row.get("images_per_s"), out["limit"])
            row["of_limit_after_first"] = ratio(row.get("images_per_s_after_first"), out["limit"])
            out["paths"][path] = row
            print(f"[gpu_user] {path}: " + json.dumps({k: v for k, v in row.items() if k != "epochs"}), flush=True)
            for e in row.get("epochs", []):
                print(f"[gpu_user]   {json.dumps(e)}", flush=True)
    targets = [{"target": f"`raymill train` {p}, whole epochs 2+, ≥ {TARGETS[p]} of the GPU's limit",
                "measured": r.get("of_limit_after_first"), "pass": (r.get("of_limit_after_first") or 0) >= TARGETS[p]}
               for p, r in out["paths"].items() if p in TARGETS]
    if "demo_run_s" in out:
        targets.append({"target": f"demo `raymill run` on the GPU ≤ {DEMO_RUN_S:g} s", "measured": out["demo_run_s"],
                        "pass": out["demo_run_s"] <= DEMO_RUN_S})
    out["targets"] = targets
    return out


def render(r: dict[str, Any]) -> str:
    a = r["args"]
    a = {"batch_size": 256, "epochs": 3, "images": 16000, **a}
    lines = [f"`raymill train` resnet50 at 224 px, batch {a['batch_size']}, {a['epochs']} epochs, only the model "
             f"settings given (the planner decides the rest), on {r['device']} with {r['cores']} CPU cores; "
             f"{a['images']} synthetic 320x240 JPEGs through `raymill etl` ({r.get('etl_s', '?')} s). The limit: the same "
             f"step on random tensors on the GPU, {fmt(r['limit'])} img/s. Rates are images / Σ epoch wall "
             "(whole epochs, each one's first-batch wait included).", ""]
    rows = []
    for path, p in r["paths"].items():
        if "error" in p:
            rows.append([path, "failed: " + p["error"].splitlines()[-1][:120], "", "", "", "", ""])
            continue
        rows.append([path, fmt(p["images_per_s"]), fmt(p["of_limit"], 2), fmt(p["of_limit_after_first"], 2),
                     fmt(p["wall_s"]), fmt(p["fixed_s"]), p["epochs"][-1]["verdict"]])
    lines += md_table(["path", "img/s (all epochs)", "÷ limit", "÷ limit, epochs 2+", "train wall s",
                       "fixed s", "last epoch's verdict"], rows, "lrrrrrl")
    starts = {path: [e.get("ray_data_start_wait_s") for e in p.get("epochs", [])] for path, p in r["paths"].items()}
    if any(v for v in starts.get("ray_data", []) if v is not None):
        lines += ["", "ray_data's wait before each epoch's first batch (s): " +
                  ", ".join(fmt(v, 2) for v in starts["ray_data"]) + "."]
    if "demo_run_s" in r:
        lines += ["", f"Demo `raymill run` (train and infer on the GPU): {fmt(r['demo_run_s'])} s; "
                  f"stages: {r.get('demo_stages_s')}."]
        for name in ("demo_run_split", "demo_train_split"):
            if r.get(name):
                lines += ["", f"{'The run' if name == 'demo_run_split' else 'Its train stage'}, in parts (s): "
                          + ", ".join(f"{k} {fmt(v, 2)}" for k, v in r[name].items()) + "."]
    elif "demo_error" in r:
        lines += ["", f"Demo `raymill run` failed: {r['demo_error'].splitlines()[-1][:200]}"]
    if r.get("note"):
        lines += ["", r["note"]]
    return "\n".join(lines + [""] + targets_table(r["targets"]))
