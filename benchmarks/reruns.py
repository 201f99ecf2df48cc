"""Time to a result when most of a run is already done: `raymill run` again on its own run.dir.

- **All reused**: the demo's `raymill run` (configs/default.yaml, 1,500 images) once, then the same
  command again, `--runs` times: every stage is reused, and Ray starts at the first stage that must
  compute (workflow/preflight.RayOnDemand), so these start neither Ray nor torch.
- **Only infer changed**: the same command with `infer.top_k` changed each time (2, 3, 2, ...):
  ETL and train are reused and infer runs again; 158 test images are a small job, which runs in the
  driver without Ray (infer.local_max_rows).
- **Ray's floor**: what any Ray program pays before its first task, each in a fresh process timed from
  its start to its exit: `import ray; ray.init(); ray.shutdown()` (Ray's defaults). A rerun that
  started Ray (raymill before 2026-11-29 did) could not go below it.
Each timed from the subprocess's start to its exit, alternating the three, one at a time.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import REPO, fmt, loadavg, md_table, ratio, targets_table
from benchmarks.user_runs import raymill, train_sets

__all__ = ["add_arguments", "run", "render"]

FLOOR = "import ray; ray.init(); ray.shutdown()"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--images", type=int, default=1500, help="demo images (default 1500: `make run`'s)")
    p.add_argument("--runs", type=int, default=3, help="timed runs of each kind, alternating (default 3)")


def _floor() -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", FLOOR], cwd=REPO, check=True, capture_output=True, timeout=300)
    return round(time.perf_counter() - started, 2)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from workflow import demo_data

    load, out = loadavg(), {"args": vars(args), "reused": [], "infer_only": [], "floor": []}
    with tempfile.TemporaryDirectory(prefix="raymill-reruns-") as tmp:
        demo_data.generate(Path(tmp) / "demo", images=args.images, seed=0)
        runs = {kind: (Path(tmp) / kind, ["run", "--config", str(REPO / "configs" / "default.yaml"), *train_sets(
            [f"run.source={Path(tmp) / 'demo'}", f"run.dir={Path(tmp) / kind}"])]) for kind in ("reused", "infer_only")}
        out["first_s"] = [raymill(*command) for _, command in runs.values()]  # each kind's own run.dir
        for i in range(args.runs):
            for kind, (run_dir, command) in runs.items():  # infer_only: top_k 2, 4, 2, ... (never the last one)
                extra = ["--set", f"infer.top_k={2 + 2 * (i % 2)}"] if kind == "infer_only" else []
                out[kind].append({"wall_s": raymill(*command, *extra), **_split(run_dir)})
            out["floor"].append(_floor())
    out["loadavg_at_start"] = load
    return out


def _split(run_dir: Path) -> dict[str, Any]:
    report = json.loads((run_dir / "report.json").read_text())
    return {"reported_s": report["seconds"], "split": report["run_seconds_split"],
            "reused": [s["stage"] for s in report["stages"] if s["reused"]]}


def render(result: dict[str, Any]) -> str:
    a, reused, infer, floor = result["args"], result["reused"], result["infer_only"], result["floor"]
    first = result["first_s"] if isinstance(result["first_s"], list) else [result["first_s"]]
    lines = [f"Demo data ({a['images']} images, configs/default.yaml); each kind reruns its own run.dir, whose "
             f"first `raymill run` took {' and '.join(fmt(f, 1) for f in first)} s. Load average at start: "
             f"{result['loadavg_at_start']}. Each "
             "figure is a subprocess's wall from its start to its exit (seconds), the three kinds "
             "alternating.", ""]
    rows = [["`raymill run` again, every stage reused", *(fmt(r["wall_s"], 2) for r in reused)],
            ["`raymill run` again with `infer.top_k` changed (2, 4, 2: infer runs, 158 images)",
             *(fmt(r["wall_s"], 2) for r in infer)],
            [f"Ray's floor: `{FLOOR}`", *(fmt(f, 2) for f in floor)]]
    lines += md_table(["run", *(f"{i + 1}" for i in range(len(floor)))], rows, "l" + "r" * len(floor)) + [""]
    lines += ["Where the last of each went (the run's report.json `run_seconds_split`, seconds):", ""]
    for name, r in (("every stage reused", reused[-1]), ("infer changed", infer[-1])):
        lines.append(f"- {name} (reused: {', '.join(r['reused'])}): " +
                     "; ".join(f"{k} {v:.2f}" for k, v in r["split"].items()))
    lines.append("")
    worst_reused, worst_infer = max(r["wall_s"] for r in reused), max(r["wall_s"] for r in infer)
    median_floor = statistics.median(floor)
    targets = [{"target": "a rerun with every stage reused, slowest / Ray's floor, median (<= 0.5: no Ray)",
                "measured": ratio(worst_reused, median_floor, 3), "pass": worst_reused <= 0.5 * median_floor},
               {"target": "a rerun whose only change is infer's, slowest / Ray's floor, median (<= 1.0: "
                          "the small job runs without Ray)",
                "measured": ratio(worst_infer, median_floor, 3), "pass": worst_infer <= median_floor}]
    return "\n".join(lines + targets_table(targets, 3))
