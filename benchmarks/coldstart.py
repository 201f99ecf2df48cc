"""Ray Data's cold start in `train.ingest=ray_data`, by what each new task worker imports first.

    python -m benchmarks coldstart [--images 1500] [--runs 3]

Ray pickles a map function by its module, so a task worker imports that module before its first
block. Until 2026-11-27 the decode + augment function lived in stages.feed.ray_data, which
imports torch; it now lives in stages.feed.ray_udfs (numpy, Pillow, ray). Both layouts run here
side by side, alternating, each in a fresh process with a fresh Ray on all the cores:

  ours      the product's train dataset (stages.feed.ray_data.build_train_dataset), then a
            pass-through map_batches defined in this module (no torch);
  baseline  the same, with the pass-through defined in benchmarks/coldstart_old.py, which imports
            stages.feed.ray_data (and torch): fused into the same tasks, it makes each task worker
            import what the old home of the task functions made it import.

Data: demo JPEGs (workflow.demo_data) through `raymill etl` (configs/default.yaml: 64 px). Each
run reads the train split twice (pass 1: cold workers, pass 2: the same workers, warm).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import fmt, loadavg, md_table, ratio, targets_table, wait_for_quiet
from benchmarks.user_runs import REPO, raymill

__all__ = ["add_arguments", "run", "render", "passthrough"]

CORES = os.cpu_count() or 1
KINDS = ("baseline", "ours")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--images", type=int, default=1500, help="generated source JPEGs (default 1500)")
    p.add_argument("--runs", type=int, default=3, help="runs of each kind, alternating (default 3)")
    p.add_argument("--wait-for-quiet", type=float, default=60, help="seconds to wait for load < 1 before each run")


def passthrough(batch):
    return batch


def _child(kind: str, etl: str) -> dict[str, Any]:
    """One run, in this (fresh) process: Ray up, then two passes over the product's train dataset."""
    import ray

    from stages.common.config import load_config
    from stages.feed import ray_data

    ray.init(num_cpus=CORES, include_dashboard=False, logging_level="ERROR",
             runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}})
    manifest = json.loads((Path(etl) / "manifest.json").read_text())
    shards = [{**s, "uri": str(Path(etl) / s["path"])} for s in manifest["shards"]
              if s["split"] == "train" and s["format"] == "parquet"]
    cfg = load_config(REPO / "configs/default.yaml", ["train.ingest=ray_data", "train.data_cpus_per_task=1"])
    ds, _ = ray_data.build_train_dataset(cfg.train, shards, seed=0, image_size=manifest["config"]["image_size"],
                                         raw=False, s3=None)
    if kind == "baseline":
        from benchmarks.coldstart_old import passthrough as last
    else:
        last = passthrough
    ds = ds.map_batches(last, batch_size=None, num_cpus=cfg.train.data_cpus_per_task)
    times: dict[str, Any] = {"kind": kind, "loadavg_before": loadavg()}
    for name in ("pass1", "pass2"):
        started, rows, first = time.perf_counter(), 0, None
        for batch in ds.iter_batches(batch_size=64):
            first = first if first is not None else time.perf_counter() - started
            rows += len(batch["key"])
        times.update({f"{name}_s": round(time.perf_counter() - started, 2), f"{name}_first_batch_s": round(first, 2),
                      "rows": rows})
    ray.shutdown()
    return times


def run(args: argparse.Namespace) -> dict[str, Any]:
    from workflow import demo_data

    out: dict[str, Any] = {"args": vars(args), "cores": CORES, "runs": []}
    with tempfile.TemporaryDirectory(prefix="raymill-coldstart-") as tmp:
        root = Path(tmp)
        demo_data.generate(root / "src", images=args.images, seed=0)
        out["etl_s"] = raymill("etl", "--input", str(root / "src"), "--output", str(root / "etl"),
                               "--config", "configs/default.yaml", "--set", "tracking.enabled=false")
        for i in range(args.runs):
            for kind in KINDS:
                quiet = wait_for_quiet(args.wait_for_quiet, CORES)
                proc = subprocess.run([sys.executable, "-c", "import json, sys; from benchmarks.coldstart import "
                                       f"_child; print('RESULT', json.dumps(_child({kind!r}, {str(root / 'etl')!r})))"],
                                      cwd=REPO, capture_output=True, text=True, timeout=600)
                line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
                if not line:
                    raise RuntimeError(f"coldstart {kind} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
                out["runs"].append({**json.loads(line[-1][len("RESULT "):]), "quiet": quiet})
                print(f"coldstart run {i + 1} {kind}: {out['runs'][-1]}", flush=True)
    return out


def _median(result: dict[str, Any], kind: str, key: str) -> float:
    return statistics.median(r[key] for r in result["runs"] if r["kind"] == kind)


def render(result: dict[str, Any]) -> str:
    runs = result["runs"]
    lines = [f"{runs[0]['rows']} train rows of demo JPEGs through `raymill etl` (configs/default.yaml, "
             f"{result['etl_s']} s); each run a fresh process and a fresh Ray with {result['cores']} CPUs, "
             "the product's `ray_data` train dataset read twice. baseline: its task workers also unpickle a "
             "pass-through from a module that imports stages.feed.ray_data (and torch), as the task "
             "functions' old home made them; ours: the same pass-through from a module without torch.", ""]
    lines += md_table(["run", "kind", "pass 1 s (cold)", "its first batch s", "pass 2 s (warm)", "load at start"],
                      [[i // 2 + 1, r["kind"], r["pass1_s"], r["pass1_first_batch_s"], r["pass2_s"],
                        fmt((r["loadavg_before"] or [None])[0], 2)] for i, r in enumerate(runs)])
    cold = ratio(_median(result, "ours", "pass1_s"), _median(result, "baseline", "pass1_s"))
    lines += ["", *targets_table([{"target": "pass 1 (cold workers), median: ours / baseline < 1", "measured": cold,
                                   "pass": cold is not None and cold < 1}])]
    return "\n".join(lines)
