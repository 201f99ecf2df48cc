"""What a user waits for: `raymill` commands run as subprocesses, and a train run's whole epochs.

Shared by benchmarks gpu_user and cpu_user: each row is one command as a user types it, timed from
its start to its exit, and its rate is read from what the run itself published (metrics.jsonl).
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import REPO

__all__ = ["raymill", "train_sets", "epochs_summary"]

EPOCH_KEYS = ("epoch", "images_per_s", "wall_s", "wait_s", "stall_fraction", "device_utilisation",
              "ray_data_start_wait_s", "verdict")


def raymill(*args: str, timeout: float = 900) -> float:
    """Run `raymill ARGS` (python -m workflow); its wall seconds. Raises with its output's tail on failure."""
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "workflow", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise RuntimeError(f"raymill {args[0]} exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return round(wall, 2)


def train_sets(settings: list[str]) -> list[str]:
    """`--set KEY=VALUE` arguments for `settings`."""
    return [x for s in settings for x in ("--set", s)]


def epochs_summary(out: Path, wall: float) -> dict[str, Any]:
    """A finished `raymill train` in `out`: images / Σ epoch wall over all epochs and over epochs 2+
    (metrics.jsonl `wall_s`: each whole epoch, its first-batch wait included), and the fixed cost."""
    history = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    images = [h["images_per_s"] * h["wall_s"] for h in history]
    walls = [h["wall_s"] for h in history]
    later = slice(1, None) if len(history) > 1 else slice(0, None)
    return {"wall_s": wall, "epochs_wall_s": round(sum(walls), 2), "fixed_s": round(wall - sum(walls), 2),
            "images_per_s": round(sum(images) / sum(walls), 1),
            "images_per_s_after_first": round(sum(images[later]) / sum(walls[later]), 1),
            "epochs": [{k: h.get(k) for k in EPOCH_KEYS} for h in history]}
