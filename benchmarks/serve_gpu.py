"""Serving on a GPU (issue 22): resnet50 at 224 px on a CUDA replica, dynamic batching on and off.

    python -m benchmarks serve_gpu [--requests 400] [--levels 1,32] [--rounds 2]

  model     resnet50, 10 classes, 224 px, random weights (stages.model.publish.save_model), fp32.
  bodies    --bodies JPEGs of --size px (benchmarks/serve._jpegs), raw `image/jpeg` to /predict.
  variants  apps on one Ray, each on its own route, every model replica on a fifth of a GPU
            (serve.gpus_per_replica=0.2) so that the idle ones sit beside the measured one:
              batching on    `raymill serve` defaults with serve.use_gpu=true;
              batching off   the same with serve.batching=false;
              2 ingress      batching on with serve.ingress_replicas=2;
              one hop, on/off  batching on / off with serve.model_deployment=false (the model
                             in the ingress replica: no ingress -> model hop a request);
              ray floor[, one hop]  Ray Serve's floor (benchmarks/serve_apps.floor_app) of each
                             topology: the same hops, limits and CPUs, returning a constant. Its c=32
                             requests/s over batching off's is the most that batching can gain.
  GPU       nvidia-smi utilisation, sampled every 200 ms while each level runs.
  batch     images/s through /v2 (binary tensors) with N images a request, 8 clients, against
            `raymill infer` with infer.use_gpu=true on the same model and JPEGs; then again on one
            app of 3 model replicas (3 decoding processes) sharing the GPU.

Load as in benchmarks/serve.py (k keep-alive httpx clients, best of --rounds interleaved rounds).
Not run on the 2-core box (no GPU): it is for a lent device (shared/PLATFORM.md).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.common import targets_table, wait_for_quiet

__all__ = ["add_arguments", "available", "run", "render"]

VARIANTS = {"batching on": {}, "batching off": {"batching": False}, "2 ingress": {"ingress_replicas": 2},
            "one hop, on": {"model_deployment": False}, "one hop, off": {"model_deployment": False, "batching": False}}
# Ray's floor apps (benchmarks/serve_apps.floor_app) by hops: the no-model bound of each topology
FLOORS = {"ray floor": 2, "ray floor, one hop": 1}
BATCH_TARGET = 1.5  # issue 22: c=32 requests/s, batching on / off, resnet50 on the GPU
GPU_SHARE = 0.2  # every variant's model replica on one GPU at once (5 x 0.2 <= 1)
# /v2 again on one app of 3 model replicas (3 processes) sharing the GPU: a replica's decodes are
# threads under one GIL, so this shows how far /v2 scales with decoding processes.
V2_REPLICAS = 3


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--bodies", type=int, default=64, help="distinct JPEG bodies (default 64)")
    p.add_argument("--size", default="500x375", help="JPEG size WxH (default 500x375)")
    p.add_argument("--levels", default="1,32", help="client concurrency levels (default 1,32)")
    p.add_argument("--requests", type=int, default=400, help="timed requests per level (default 400)")
    p.add_argument("--time-cap", type=float, default=15.0, help="seconds per level at most (default 15)")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds (default 2)")
    p.add_argument("--batch-sizes", default="1,8,32", help="images per /v2 request (default 1,8,32)")
    p.add_argument("--batch-images", type=int, default=2048, help="images per /v2 batch size (default 2048)")
    p.add_argument("--infer-images", type=int, default=2000, help="images for `raymill infer` (default 2000)")
    p.add_argument("--wait-for-quiet", type=float, default=60, help="seconds to wait for a quiet machine")


def _make_model(out: Path) -> None:
    import torch

    from stages.model.zoo import build_model
    from stages.model.publish import save_model

    torch.manual_seed(0)
    info = {"architecture": "resnet50", "width": 32, "dropout": 0.0, "classes": [f"c{i}" for i in range(10)],
            "image_size": 224, "resize": "crop", "mean": [0.5] * 3, "std": [0.25] * 3, "version": "bench-gpu"}
    save_model(str(out), build_model("resnet50", 10).state_dict(), info)


def _measure(args, model_dir: str, bodies: list[bytes]) -> tuple[dict, dict]:
    """{variant: {level: best round, with GPU utilisation}} and the /v2 rates of "batching on"."""
    import ray
    from ray import serve

    from benchmarks.gpu import Smi
    from benchmarks.serve import _free_port, _level
    from benchmarks.serve_apps import floor_app
    from stages.serve import app as serve_stage
    from stages.common import session
    from stages.common.config import RayConfig, ServeConfig

    base = ServeConfig(port=_free_port(), use_gpu=True, gpus_per_replica=GPU_SHARE, request_timeout_s=60.0)
    session.start(RayConfig())
    try:
        urls = {}
        for i, (name, change) in enumerate(VARIANTS.items()):
            cfg = base.model_copy(update={**change, "app_name": f"gpu{i}"})
            urls[name] = serve_stage.start(cfg, model_dir, route_prefix=f"/g{i}")
        for name, hops in FLOORS.items():
            serve.run(floor_app(base, hops), name=f"floor{hops}", route_prefix=f"/floor{hops}")
            urls[name] = serve_stage.base_url(base) + f"/floor{hops}"
        best: dict[str, dict[str, Any]] = {name: {} for name in urls}
        for _ in range(args.rounds):
            for k in (int(x) for x in args.levels.split(",")):
                for name, url in urls.items():
                    with Smi() as smi:
                        m = asyncio.run(_level(url, bodies, k, args.requests, args.time_cap))
                    m["gpu_util_smi"] = smi.mean()
                    if m["rps"] >= best[name].get(str(k), {}).get("rps", -1):
                        best[name][str(k)] = m
                    print(f"[serve_gpu] {name:>12} c={k:<3} p50 {m['p50_ms']:7.2f} ms {m['rps']:7.1f} req/s "
                          f"GPU {m['gpu_util_smi'] or 0:.0%} errors {m['errors']}", flush=True)
        batch = _v2_rates(args, urls["batching on"], base.model_name, bodies)
        for i in range(len(VARIANTS)):  # free the GPU shares for one app of 3 replicas
            serve.delete(f"gpu{i}")
        spread = base.model_copy(update={"app_name": "gpu-v2x3", "num_replicas": V2_REPLICAS})
        batch["replicas"] = _v2_rates(args, serve_stage.start(spread, model_dir, route_prefix="/v2x3"),
                                      base.model_name, bodies)
        return best, batch
    finally:
        serve.shutdown()
        ray.shutdown()


def _v2_rates(args, url: str, model_name: str, bodies: list[bytes]) -> dict[str, Any]:
    """/v2 images/s by images a request (8 clients), with the GPU's mean utilisation."""
    from benchmarks.gpu import Smi
    from benchmarks.serve_batch import v2_images_per_s

    with Smi() as smi:
        rates = v2_images_per_s(url, model_name, bodies, [int(n) for n in args.batch_sizes.split(",")], 8,
                                args.batch_images, 60.0)
    rates["gpu_util_smi"] = smi.mean()
    return rates


def available() -> str | None:
    """Why this benchmark cannot run here, or None (`benchmarks all` skips it then)."""
    from benchmarks.gpu import available as gpu_available

    return gpu_available()


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from benchmarks.serve import _jpegs
    from benchmarks.serve_batch import infer_images_per_s
    from stages.common import session
    from stages.common.config import InferConfig, RayConfig

    if reason := available():
        raise SystemExit(f"benchmarks serve_gpu: {reason}")
    quiet = wait_for_quiet(args.wait_for_quiet, os.cpu_count() or 1)
    with tempfile.TemporaryDirectory(prefix="raymill-serve-gpu-") as tmp:
        model_dir = str(Path(tmp) / "model")
        _make_model(Path(model_dir))
        bodies = _jpegs(args.bodies, args.size)
        best, batch = _measure(args, model_dir, bodies)
        session.start(RayConfig())
        try:
            infer = infer_images_per_s(model_dir, bodies, args.infer_images, InferConfig(use_gpu=True))
        finally:
            import ray
            ray.shutdown()
    targets = _targets(best)
    return {"device": torch.cuda.get_device_name(), "quiet": quiet, "gpu_share": GPU_SHARE, "bodies": args.bodies,
            "size": args.size, "levels": args.levels.split(","), "modes": best, "batch": batch, "infer": infer,
            "targets": targets}


def _targets(best: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Issue 22's batching row per topology, and beside each the bound that the node sets: Ray's
    floor app of the same hops over batching off, both at c=32. Batching cannot lift /predict past
    the proxy and ingress work that the floor measures, so a bound below the target means that
    the target cannot be met with that topology on this node."""
    rps = {name: per_level.get("32", {}).get("rps") for name, per_level in best.items()}
    rows = []
    for label, on, off, floor in (("two hops", "batching on", "batching off", "ray floor"),
                                  ("one hop", "one hop, on", "one hop, off", "ray floor, one hop")):
        on, off, floor = rps.get(on), rps.get(off), rps.get(floor)
        ratio = round(on / off, 2) if on and off else None
        rows += [{"target": f"c=32 req/s, batching on / off ≥ {BATCH_TARGET} (resnet50, GPU, {label})",
                  "measured": ratio, "pass": ratio is not None and ratio >= BATCH_TARGET},
                 {"target": f"bound: c=32 req/s, Ray's floor / batching off ({label})",
                  "measured": round(floor / off, 2) if floor and off else None, "pass": None}]
    return rows


def _marginal(infer: dict[str, Any]) -> str:
    rate = infer.get("marginal_images_per_s")
    if rate:
        return f"{rate} marginal"
    return "no marginal rate (the quarter-size run took at least as long: start-up dominates)"


def render(r: dict[str, Any]) -> str:
    levels, share = r["levels"], r.get("gpu_share", 0.33)  # runs before 2026-11-26 used 0.33
    lines = [f"resnet50, 224 px, fp32 on {r['device']}, model replicas of {share} GPU; {r['bodies']} JPEGs of "
             f"{r['size']} px as raw `image/jpeg`. Cells: client p50 ms / requests/s / GPU utilisation "
             "(nvidia-smi) (non-200 count if any).", "",
             "| variant | " + " | ".join(f"c={k}" for k in levels) + " |", "|---|" + "---:|" * len(levels)]
    for name, per_level in r["modes"].items():
        cells = [f"{m['p50_ms']:.1f} / {m['rps']:.0f} / {(m.get('gpu_util_smi') or 0):.0%}"
                 + (f" ({m['errors']} err)" if m["errors"] else "") for m in (per_level.get(k) for k in levels) if m]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    b, infer = r["batch"], r["infer"]
    lines += ["", f"/v2 images/s by images a request (8 clients, batching on; GPU {(b.get('gpu_util_smi') or 0):.0%} "
              f"busy over all sizes), against `raymill infer` with infer.use_gpu=true: {infer['images_per_s']} "
              f"images/s end to end ({infer['images']} images in {infer['seconds']} s), "
              f"{_marginal(infer)}:", "",
              "| images a request | images/s | request p50 ms | non-200 |", "|---:|---:|---:|---:|"]
    lines += [f"| {n} | {m['images_per_s']} | {m['p50_ms']} | {m['errors']} |" for n, m in b.items() if n.isdigit()]
    if spread := b.get("replicas"):  # runs before 2026-11-25 evening measured one replica only
        lines += ["", f"The same /v2 load on one app of {V2_REPLICAS} model replicas ({V2_REPLICAS} processes "
                  f"decoding) of {share} GPU each (GPU {(spread.get('gpu_util_smi') or 0):.0%} busy): "
                  + ", ".join(f"N={n} {m['images_per_s']} images/s" for n, m in spread.items() if n.isdigit())
                  + "."]
    return "\n".join(lines + [""] + targets_table(r["targets"]))
