"""Chaos loop: the two-node node-loss scenario N times, counting the runs that recover.

Each run is `tests/two_node_run.py` (a real 2-node Ray cluster on loopback, 1 CPU per node): a
2-worker DDP run loses node B right after Ray Train registers a mid-epoch checkpoint, and must
finish its 2 epochs (elastic: on the surviving node; replace: on the survivor plus a node started
with `ray start --address`). The judgement is `two_node_run.problems`, the one test_cluster.py uses.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import REPO, loadavg

__all__ = ["add_arguments", "run", "render"]

HARNESS = REPO / "tests" / "two_node_run.py"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--runs", type=int, default=10, help="runs per scenario (default 10; target: all pass)")
    p.add_argument("--modes", default="node-loss-recover",
                   help="comma-separated two_node_run modes (default node-loss-recover; also node-replace)")
    p.add_argument("--timeout-s", type=int, default=900, help="per-run limit before it counts as failed")


def _one(mode: str, workdir: Path, timeout_s: int) -> dict[str, Any]:
    from tests.two_node_run import problems

    started, load = time.perf_counter(), loadavg()
    try:
        proc = subprocess.run([sys.executable, str(HARNESS), str(workdir), mode], capture_output=True,
                              text=True, timeout=timeout_s, cwd=REPO)
        lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        result = json.loads(lines[-1][len("RESULT "):]) if lines else None
        found = problems(result) if result else [f"no RESULT line (exit {proc.returncode}): "
                                                 f"{proc.stderr[-300:]}"]
    except subprocess.TimeoutExpired:
        found = [f"hung: no result within {timeout_s} s"]
    return {"passed": not found, "problems": found, "seconds": round(time.perf_counter() - started, 1),
            "loadavg_before": load}


def run(args: argparse.Namespace) -> dict[str, Any]:
    scenarios: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="raymill-chaos-") as tmp:
        shared = Path(tmp) / "ds"
        for mode in args.modes.split(","):
            runs = []
            for i in range(args.runs):
                # Each run trains from scratch in its own folder; the ETL output is made once.
                workdir = Path(tmp) / f"{mode}-{i}"
                if shared.exists():
                    shutil.copytree(shared, workdir / "ds")
                runs.append(_one(mode, workdir, args.timeout_s))
                if not shared.exists() and (workdir / "ds" / "manifest.json").exists():
                    shutil.copytree(workdir / "ds", shared)
                print(f"chaos {mode} run {i + 1}/{args.runs}: {'pass' if runs[-1]['passed'] else 'FAIL'} "
                      f"({runs[-1]['seconds']} s) {'; '.join(runs[-1]['problems'])[:300]}", flush=True)
            scenarios[mode] = {"runs": runs, "passed": sum(r["passed"] for r in runs), "total": len(runs)}
    return {"scenarios": scenarios}


def render(result: dict[str, Any]) -> str:
    lines = ["Node loss on a real 2-node Ray cluster (loopback, 1 CPU per node, 2 DDP workers): node B is "
             "killed right after Ray Train registers a mid-epoch checkpoint. A run passes when training "
             "finishes both epochs where it must (see `tests/two_node_run.py::problems`).", "",
             "| scenario | passed | runs | median s | result (target: every run, at least 10) |",
             "|---|---:|---:|---:|---|"]
    for mode, s in result["scenarios"].items():
        seconds = sorted(r["seconds"] for r in s["runs"])
        ok = s["passed"] == s["total"] >= 10
        lines.append(f"| {mode} | {s['passed']} | {s['total']} | {seconds[len(seconds) // 2] if seconds else '-'} | "
                     f"{'PASS' if ok else 'FAIL'} |")
    failures = [f"- {mode} run {i + 1}: {'; '.join(r['problems'])[:400]}"
                for mode, s in result["scenarios"].items() for i, r in enumerate(s["runs"]) if not r["passed"]]
    return "\n".join(lines + (["", "Failed runs:"] + failures if failures else []))
