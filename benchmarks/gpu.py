"""On a GPU machine: resnet50 fed by each ingest path, against the GPU's own limit.

    python -m benchmarks gpu [--images 16000] [--batch-size 256] [--threads 12]

resnet50 at 224 px, bf16 autocast, channels_last, SGD, batch 256, on synthetic 320x240 JPEGs
put through the real ETL (224 px JPEG-in-parquet). The limit: the same step on random tensors
already on the GPU. Each path's fed rate is divided by it; utilisation comes from CUDA events
(stages.feed.meters) and from `nvidia-smi` sampled every 200 ms. "before" is decode in 12 threads.
Not run on the 2-core box (no GPU): it is ready for a lent device (shared/PLATFORM.md).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.common import fmt, md_table, pct, ratio, targets_table, wait_for_quiet
from benchmarks.feed import Data, as_a_gpu_worker
from benchmarks.feed_cpu import RayDataFeed
from stages.feed import decoded_tier
from stages.feed import meters
from stages.feed.decode_pool import DecodePool
from stages.feed.feeds import PoolFeed, ThreadFeed
from stages.model.zoo import build_model
from stages.model.predict import to_batch

CORES = os.cpu_count() or 1


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--images", type=int, default=16000, help="generated source JPEGs (default 16000)")
    p.add_argument("--source-size", default="320x240", help="source JPEG size WxH (default 320x240)")
    p.add_argument("--image-size", type=int, default=224, help="training side in px (default 224)")
    p.add_argument("--batch-size", type=int, default=256, help="per step (default 256)")
    p.add_argument("--threads", type=int, default=12, help="decode threads of the 'before' row (default 12)")
    p.add_argument("--skip-ray-data", action="store_true", help="leave out train.ingest=ray_data")
    p.add_argument("--wait-for-quiet", type=float, default=120, help="seconds to wait for load < cores")


class Step:
    """resnet50 training step as stages.train.loop runs it on a GPU (bf16, channels_last)."""

    def __init__(self, classes: int = 10):
        self.device = torch.device("cuda")
        self.model = build_model("resnet50", classes).to(self.device, memory_format=torch.channels_last)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)

    def __call__(self, images, labels: torch.Tensor) -> None:
        ready = isinstance(images, torch.Tensor) and images.is_floating_point()  # the limit's tensors
        x = images if ready else to_batch(images, (0.5,) * 3, (0.25,) * 3, self.device, True, True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(self.model(x).float(), labels)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()


class Smi:
    """`nvidia-smi` GPU utilisation, sampled every 200 ms while the block runs."""

    def __enter__(self) -> "Smi":
        self.samples: list[float] = []
        try:
            self._proc = subprocess.Popen(["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits",
                                           "-lms", "200"], stdout=subprocess.PIPE, text=True)
        except FileNotFoundError:  # no nvidia-smi: the CUDA-event figure stands alone
            self._proc = None
            return self
        threading.Thread(target=self._read, daemon=True).start()
        return self

    def _read(self) -> None:
        for line in self._proc.stdout:
            try:
                self.samples.append(float(line.strip().split(",")[0]) / 100)
            except ValueError:
                pass

    def __exit__(self, *exc) -> None:
        if self._proc:
            self._proc.terminate()

    def mean(self) -> float | None:
        return sum(self.samples) / len(self.samples) if self.samples else None


def fed(feed, step: Step, batch: int, skip: int = 2) -> dict[str, Any]:
    """Feed into the step, timed like the loop; the first `skip` steps (cuDNN autotuning, first
    batch) are left out of the rates."""
    meter, images, t0 = meters.StepMeter(step.device), 0, None
    labels = torch.zeros(batch, dtype=torch.long, device=step.device)
    with Smi() as smi:
        for i, batch in enumerate(feed):
            if i == skip:
                torch.cuda.synchronize()
                t0, wait0, meter, images = time.perf_counter(), feed.wait_s, meters.StepMeter(step.device), 0
            meter.start()
            step(batch.images, labels[:len(batch.rows)])
            meter.stop()
            images += len(batch.rows)
        torch.cuda.synchronize()
    feed.close()
    wall = time.perf_counter() - t0
    times = meters.EpochTimes(images, feed.wait_s - wait0, meter.busy_s(), wall)
    return {"images_per_s": round(images / wall, 1), "utilisation_events": round(times.utilisation, 3),
            "utilisation_smi": smi.mean(), "stall": round(times.stall, 3),
            "verdict": meters.verdict(times, "GPU", getattr(feed, "ingest", "stream"), feed.capacity(),
                                      getattr(feed, "tier", None))}


def limit(step: Step, batch: int, size: int) -> dict[str, float]:
    x = torch.randn(batch, 3, size, size, device=step.device).contiguous(memory_format=torch.channels_last)
    host = torch.randint(0, 255, (batch, size, size, 3), dtype=torch.uint8).numpy()
    labels = torch.zeros(batch, dtype=torch.long, device=step.device)
    out = {}
    for name, images in (("random tensors on the GPU", x), ("host uint8 → to_batch", host)):
        for _ in range(3):
            step(images, labels)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(15):
            step(images, labels)
        torch.cuda.synchronize()
        out[name] = round(15 * batch / (time.perf_counter() - t0), 1)
    return out


def available() -> str | None:
    """Why this benchmark cannot run here, or None."""
    return None if torch.cuda.is_available() else "no CUDA device (run it on a lent GPU machine)"


def run(args) -> dict[str, Any]:
    if reason := available():
        raise SystemExit(f"benchmarks gpu: {reason}")
    quiet = wait_for_quiet(args.wait_for_quiet, CORES)
    as_a_gpu_worker()
    step = Step()
    with tempfile.TemporaryDirectory() as tmp:
        data = Data(args, Path(tmp))
        lim = limit(step, data.batch, data.size)
        gpu_limit, paths = lim["random tensors on the GPU"], {}
        with DecodePool(CORES, data.batch, data.size, 5, keep_plain=True) as pool:
            ours = PoolFeed(pool, data.batches(1), data.spec(1))
            paths[f"stream, {CORES} processes (ours)"] = fed(ours, step, data.batch)
            tier = decoded_tier.DecodedTier(data.images, data.size, "gpu", step.device)
            for i, b in enumerate(PoolFeed(pool, data.batches(0), data.spec(0, keep_plain=True))):
                tier.put(i * data.batch, b.rows, b.plain)
        augment = {"scale_min": 0.35, "random_resized_crop": True, "flip": True}
        steps = -(-data.images // data.batch)
        paths["decoded tier (gpu)"] = fed(tier.feed(0, 1, 0, data.batch, 0, steps, augment), step, data.batch)
        paths[f"stream, {args.threads} threads (before)"] = fed(
            ThreadFeed(data.batches(1), data.spec(1), args.threads, 4), step, data.batch)
        if not args.skip_ray_data:
            cpus, alone = ray_data_alone(data)
            paths[f"ray_data ({cpus:g} CPU a task)"] = fed(RayDataFeed(data, cpus), step, data.batch)
    for p in paths.values():
        p["of_limit"] = ratio(p["images_per_s"], gpu_limit)
    def need(name: str) -> float:
        return 0.8 if name.startswith("ray_data") else 0.9

    targets = [{"target": f"{name} ≥ {need(name)} of the GPU's limit", "measured": p["of_limit"],
                "pass": (p["of_limit"] or 0) >= need(name)} for name, p in paths.items() if "before" not in name]
    return {"args": vars(args), "cores": CORES, "device": torch.cuda.get_device_name(), "quiet": quiet,
            "images": data.images, "limits": lim, "paths": paths, "targets": targets,
            "ray_data_alone": alone if not args.skip_ray_data else None}


def ray_data_alone(data: Data) -> tuple[float, list[dict[str, Any]]]:
    """The CPUs a Ray Data task gets from the plan of one GPU worker with train.ingest=ray_data
    on this node, and Ray Data's own rate (nothing consuming) at that and at 0.5 CPU a task, in
    the order planned, 0.5, planned, so that a warm-up effect cannot pass for a difference."""
    from stages.common import session
    from stages.common.config import RayConfig, TrainConfig

    resources = session.start(RayConfig())
    train = TrainConfig(ingest="ray_data", use_gpu=True, num_workers=1, batch_size=data.batch)
    planned = session.plan_workers(train, resources, RayConfig().data_reserved_cpus).data_cpus_per_task
    runs = []
    for cpus in (planned, 0.5, planned):
        started, first, n = time.perf_counter(), None, 0
        for b in RayDataFeed(data, cpus):
            first, n = first or time.perf_counter() - started, n + len(b.rows)
        runs.append({"cpus_per_task": cpus, "images_per_s": round(n / (time.perf_counter() - started), 1),
                     "first_batch_s": round(first, 2)})
    return planned, runs


def render(r: dict[str, Any]) -> str:
    lines = [f"resnet50, {r['args']['image_size']} px, bf16, channels_last, batch {r['args']['batch_size']} on "
             f"{r['device']} with {r['cores']} CPU cores; {r['images']} train images of the real ETL output.", ""]
    rows = [[name, fmt(v), "1.00" if i == 0 else fmt(ratio(v, r["limits"]["random tensors on the GPU"]), 2),
             "", "", "", ""] for i, (name, v) in enumerate(r["limits"].items())]
    rows += [[name, fmt(p["images_per_s"]), fmt(p["of_limit"], 2), pct(p["utilisation_events"]),
              pct(p["utilisation_smi"]), pct(p["stall"]), p["verdict"]] for name, p in r["paths"].items()]
    lines += md_table(["path", "img/s", "÷ limit", "GPU busy (events)", "GPU util (nvidia-smi)", "stall", "verdict"],
                      rows, "lrrrrrl")
    alone = r.get("ray_data_alone")
    if alone:
        lines += ["", "Ray Data alone (nothing consuming), by CPUs a task, in the order run: " + "; ".join(
            f"{a['cpus_per_task']:g} CPU: {fmt(a['images_per_s'])} img/s, first batch {a['first_batch_s']} s"
            for a in alone) + "."]
    return "\n".join(lines + [""] + targets_table(r["targets"]))
