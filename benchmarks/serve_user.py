"""A lone request as a user meets it: `raymill serve` against Ray Serve's floor, each started the
way a user starts it, in its own process with its own Ray.

    python -m benchmarks serve_user [--requests 300] [--rounds 3]

`benchmarks serve` measures its variants inside one process and one Ray (with extra logical CPUs
so that idle variants fit). #39's held-out probe ran the product's own command instead. Here:

  ours   `python -m workflow serve --model M --port P` (ServeConfig defaults);
  floor  a process that starts Ray as raymill does (session.start), then serve.start with the
         same HTTP options and serve.run(benchmarks.serve_apps.floor_app(cfg.serve)): the same two
         hops, limits and CPUs, answering a constant;
  model  the model's own time for one image in this process: decode + preprocess + forward pass,
         torch with 1 thread (as in a 0.5-CPU replica) and with every core.

The model is benchmarks.serve's (small_cnn width 32, 64 px, untrained); the body one 500x375 JPEG.
Each round starts each server, sends --requests sequential requests over one keep-alive
connection after 30 untimed ones, and stops it with SIGTERM. The spread over rounds is reported.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import REPO, fmt, loadavg, md_table, ratio, targets_table
from benchmarks.serve import _free_port, _jpegs, _make_model, _wait_healthy

__all__ = ["add_arguments", "run", "render"]

TARGET = 1.2  # c=1 p50 ours / (floor + the model's own time), #39
FLOOR = ("import signal, sys; from ray import serve; from stages.common import session; "
         "from stages.common.config import load_config; from stages.serve import app; "
         "from benchmarks.serve_apps import floor_app; cfg = load_config(None, [f'serve.port={sys.argv[1]}']); "
         "app.apply_ingress_env(cfg.serve); session.start(cfg.ray); "
         "serve.start(http_options={'host': cfg.serve.host, 'port': cfg.serve.port, "
         "'request_timeout_s': cfg.serve.request_timeout_s}); "
         "serve.run(floor_app(cfg.serve), name='floor', route_prefix='/'); print('ready', flush=True); "
         "signal.sigwait({signal.SIGTERM, signal.SIGINT})")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=300, help="timed requests per server and round (default 300)")
    p.add_argument("--rounds", type=int, default=3, help="rounds, each starting both servers (default 3)")


def _probe(url: str, body: bytes, n: int) -> float:
    """p50 ms of `n` sequential POSTs over one keep-alive connection."""
    import httpx

    headers = {"content-type": "image/jpeg"}
    with httpx.Client(base_url=url, timeout=60) as client:
        for _ in range(30):
            client.post("/predict", content=body, headers=headers).raise_for_status()
        times = []
        for _ in range(n):
            started = time.perf_counter()
            client.post("/predict", content=body, headers=headers).raise_for_status()
            times.append((time.perf_counter() - started) * 1e3)
    return round(statistics.median(times), 2)


def _serve_one(kind: str, model: Path, body: bytes, n: int) -> dict[str, Any]:
    port = _free_port()
    command = ([sys.executable, "-m", "workflow", "serve", "--model", str(model), "--port", str(port)]
               if kind == "ours" else [sys.executable, "-c", FLOOR, str(port)])
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("RAY_ADDRESS", None)
    load = loadavg()
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_healthy(f"http://127.0.0.1:{port}", proc, timeout_s=180,
                      what="raymill serve" if kind == "ours" else "the floor app")
        time.sleep(2)  # the replicas' own start-up work settles
        return {"kind": kind, "p50_ms": _probe(f"http://127.0.0.1:{port}", body, n), "loadavg_before": load}
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _model_ms(model: Path, body: bytes) -> dict[str, float]:
    import torch

    from stages.model.predict import load_model, predict_arrays, preprocess

    net, info = load_model(str(model))
    out = {}
    for threads in (1, os.cpu_count() or 1):
        torch.set_num_threads(threads)
        times = []
        for _ in range(300):
            started = time.perf_counter()
            predict_arrays(net, info, [preprocess(body, info)], 3)
            times.append((time.perf_counter() - started) * 1e3)
        out[f"threads_{threads}"] = round(statistics.median(times[50:]), 3)
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"args": vars(args), "cores": os.cpu_count(), "rounds": []}
    with tempfile.TemporaryDirectory(prefix="raymill-serve-user-") as tmp:
        model, body = Path(tmp) / "model", _jpegs(1, "500x375")[0]
        _make_model(model)
        out["model_ms"] = _model_ms(model, body)
        for i in range(args.rounds):
            pair = [_serve_one(kind, model, body, args.requests) for kind in ("ours", "floor")]
            out["rounds"].append(pair)
            print(f"serve_user round {i + 1}: {json.dumps(pair)}", flush=True)
    return out


def render(result: dict[str, Any]) -> str:
    own, cores = result["model_ms"]["threads_1"], result["cores"]
    every = result["model_ms"].get(f"threads_{cores}")
    rows, ratios = [], []
    for i, (ours, floor) in enumerate(result["rounds"], 1):
        r = ratio(ours["p50_ms"], floor["p50_ms"] + own)
        ratios.append(r)
        rows.append([i, ours["p50_ms"], floor["p50_ms"], r, fmt((ours["loadavg_before"] or [None])[0], 2),
                     fmt((floor["loadavg_before"] or [None])[0], 2)])
    lines = [f"c=1: {result['args']['requests']} sequential requests over one keep-alive connection (httpx), one "
             "500x375 JPEG, each server in its own process with its own Ray, started as a user starts it. "
             f"The model's own time for one image in one process (decode, preprocess, forward): {own} ms with "
             f"1 torch thread (as a 0.5-CPU replica runs it), {every} ms with {cores}.", ""]
    lines += md_table(["round", "ours p50 ms", "floor p50 ms", "ours / (floor + model's own)", "load (ours)",
                       "load (floor)"], rows)
    worst = max(r for r in ratios if r is not None) if any(r is not None for r in ratios) else None
    lines += ["", *targets_table([{"target": f"c=1 p50 ours / (floor + model's own), worst round <= {TARGET}",
                                   "measured": worst, "pass": worst is not None and worst <= TARGET}])]
    return "\n".join(lines)
