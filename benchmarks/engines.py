"""The CPU forward pass: torch's eager mode against onnxruntime on the same model and pixels.

    python -m benchmarks engines [--repeat 10] [--archs small_cnn resnet18 resnet50]

What `serve.engine` and `infer.engine` choose between on a CPU (stages/model/runtime.py). Each model
is untrained, at the size it is used at (small_cnn width 32 and resnet18 at 64 px, resnet50 at
224 px). Both engines run the whole of what a replica or an infer actor runs per batch: uint8 NHWC
pixels in, the eval normalisation, the forward pass, logits out (predict.predict_arrays's work before
the softmax), at batch 1 (a lone request), 16 (serve.max_batch_size) and 128 (infer.batch_size;
resnet50: 16 only). Per cell: the median of --repeat timed calls after 2 untimed ones, on 1 thread
(a serve replica's) and on every core. The engines take turns within each cell, so both see the
same box. Also: the one-off export of the graph (runtime.for_device with an empty cache).
"""
from __future__ import annotations

import argparse
import io
import os
import statistics
import tempfile
import time
from typing import Any

import numpy as np

from benchmarks.common import fmt, loadavg, md_table, ratio

__all__ = ["add_arguments", "run", "render"]

MODELS = {"small_cnn": 64, "resnet18": 64, "resnet50": 224}
BATCHES = {"small_cnn": (1, 16, 128), "resnet18": (1, 16, 128), "resnet50": (1, 16)}
CORES = os.cpu_count() or 1


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--repeat", type=int, default=10, help="timed calls per cell and engine (default 10)")
    p.add_argument("--archs", nargs="+", default=list(MODELS), choices=list(MODELS), help="models (default: all)")


def _info(arch: str, size: int, model) -> dict[str, Any]:
    import torch

    from stages.common import storage

    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    return {"architecture": arch, "width": 32, "classes": [f"c{i}" for i in range(10)], "image_size": size,
            "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225],
            "weights_sha256": storage.sha256_bytes(buf.getvalue())}


def _median_ms(fn, pixels, repeat: int) -> float:
    fn(pixels), fn(pixels)
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn(pixels)
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def _one_model(arch: str, repeat: int, cache: str) -> dict[str, Any]:
    import torch

    from stages.model import runtime
    from stages.model.zoo import build_model

    size = MODELS[arch]
    model = build_model(arch, 10, 32).eval()
    info = _info(arch, size, model)
    wrapper = runtime.Pixels(model, info["mean"], info["std"], probabilities=False).eval()
    started = time.perf_counter()
    runtime.for_device(model, info, "onnxruntime", torch.device("cpu"), 1, cache)
    export_s = time.perf_counter() - started
    cells = []
    for threads in sorted({1, CORES}):
        torch.set_num_threads(threads)
        forward = runtime.for_device(model, info, "onnxruntime", torch.device("cpu"), threads, cache)
        for batch in BATCHES[arch]:
            pixels = np.random.default_rng(0).integers(0, 256, (batch, size, size, 3), dtype=np.uint8)
            with torch.inference_mode():
                torch_ms = _median_ms(lambda p: wrapper(torch.from_numpy(p)), pixels, repeat)
                diff = float(np.abs(wrapper(torch.from_numpy(pixels)).numpy() - forward(pixels)).max())
            onnx_ms = _median_ms(forward, pixels, repeat)
            cells.append({"threads": threads, "batch": batch, "torch_ms": round(torch_ms, 3),
                          "onnxruntime_ms": round(onnx_ms, 3), "logits_max_abs_diff": diff})
            print(f"engines {arch} {cells[-1]}", flush=True)
    return {"image_size": size, "export_s": round(export_s, 2), "cells": cells}


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    default = torch.get_num_threads()
    out: dict[str, Any] = {"args": vars(args), "cores": CORES, "loadavg_before": loadavg(), "models": {}}
    with tempfile.TemporaryDirectory(prefix="raymill-engines-") as cache:
        for arch in args.archs:
            out["models"][arch] = _one_model(arch, args.repeat, cache)
    torch.set_num_threads(default)
    return out


def render(result: dict[str, Any]) -> str:
    load = (result.get("loadavg_before") or [None])[0]
    lines = [f"One forward pass of uint8 pixels to logits (normalisation inside), torch eager against onnxruntime "
             f"(CPUExecutionProvider), median of {result['args']['repeat']} calls, {result['cores']} cores, load "
             f"{fmt(load, 2)} at start. The physical limit is the same for both: the cores' arithmetic; the ratio "
             "is how much of it each engine leaves unused relative to the other.", ""]
    rows = []
    for arch, model in result["models"].items():
        for cell in model["cells"]:
            per_image = cell["onnxruntime_ms"] / cell["batch"]
            rows.append([arch, model["image_size"], cell["threads"], cell["batch"], fmt(cell["torch_ms"], 2),
                         fmt(cell["onnxruntime_ms"], 2), fmt(ratio(cell["torch_ms"], cell["onnxruntime_ms"]), 2),
                         fmt(per_image, 3), f"{cell['logits_max_abs_diff']:.1e}" if "logits_max_abs_diff" in cell else "-"])
    lines += md_table(["model", "px", "threads", "batch", "torch ms", "onnxruntime ms", "torch ÷ onnxruntime",
                       "onnxruntime ms / image", "max \\|logits diff\\|"], rows) + [""]
    lines.append("The one-off export (torch.onnx in a child process, then the check against torch) with an empty cache, seconds: "
                 + ", ".join(f"{arch} {model['export_s']}" for arch, model in result["models"].items())
                 + ". A node pays it once per model: the graph is kept in ~/.cache/raymill/onnx.")
    return "\n".join(lines)
