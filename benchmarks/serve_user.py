"""A lone request as a user meets it: `raymill serve` against Ray Serve's floor, each started the
way a user starts it, in its own process with its own Ray.

    python -m benchmarks serve_user [--requests 300] [--rounds 3] [--archs small_cnn resnet18]

`benchmarks serve` measures its variants inside one process and one Ray (with extra logical CPUs
so that idle variants fit). #39's held-out probe ran the product's own command instead. Here:

  ours   `python -m workflow serve --model M --port P` (ServeConfig defaults);
  floor  a process that starts Ray as raymill does (session.start), then serve.start with the
         same HTTP options and serve.run(benchmarks.serve_apps.floor_app(cfg.serve)): the same two
         hops, limits and CPUs, answering a constant;
  every core  ours with serve.torch_threads = the cores (ours runs on Ray's 1 thread for a
         0.5-CPU replica);
  model  the model's own time for one image in a plain process: decode + preprocess + forward
         pass, on 1 torch thread (as the replica) and on torch's default (every core, as a user
         measures it in a notebook); back to back, and as lone calls 10 ms apart (what a
         sequential client's requests are to the replica: a forward after an idle gap runs slower).

Two models (untrained, 64 px): benchmarks.serve's small_cnn width 32, whose forward pass hardly
gains from threads, and resnet18, which does. The body is one 500x375 JPEG. Each round starts
each server, sends --requests sequential requests over one keep-alive connection after 30
untimed ones, and stops it with SIGTERM. The spread over rounds is reported.
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
ARCHS = ("small_cnn", "resnet18")
CORES = os.cpu_count() or 1  # "every core": the server's serve.torch_threads and the model's own threads
SERVERS = {"ours": [], "ours, every core": ["--set", f"serve.torch_threads={CORES}"], "floor": None}
GAP_S = 0.01  # between lone calls of the model's own time
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
    p.add_argument("--rounds", type=int, default=3, help="rounds, each starting every server (default 3)")
    p.add_argument("--archs", nargs="+", default=list(ARCHS), choices=list(ARCHS), help="models (default: both)")


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
    command = ([sys.executable, "-c", FLOOR, str(port)] if SERVERS[kind] is None else
               [sys.executable, "-m", "workflow", "serve", "--model", str(model), "--port", str(port), *SERVERS[kind]])
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("RAY_ADDRESS", None)
    load = loadavg()
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_healthy(f"http://127.0.0.1:{port}", proc, timeout_s=180,
                      what="the floor app" if SERVERS[kind] is None else "raymill serve")
        time.sleep(2)  # the replicas' own start-up work settles
        return {"kind": kind, "p50_ms": _probe(f"http://127.0.0.1:{port}", body, n), "loadavg_before": load}
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _model_ms(model: Path, body: bytes) -> dict[str, Any]:
    """{threads_N: ms back to back, lone_threads_N: ms for calls GAP_S apart, default_threads: the
    N of every core}, for N = 1 and every core."""
    import torch

    from stages.model.predict import load_model, predict_arrays, preprocess

    net, info = load_model(str(model))
    default, out = torch.get_num_threads(), {}
    for threads in sorted({1, CORES}):
        torch.set_num_threads(threads)
        for key, gap in ((f"threads_{threads}", 0.0), (f"lone_threads_{threads}", GAP_S)):
            times = []
            for _ in range(250):
                started = time.perf_counter()
                predict_arrays(net, info, [preprocess(body, info)], 3)
                times.append((time.perf_counter() - started) * 1e3)
                time.sleep(gap)
            out[key] = round(statistics.median(times[50:]), 3)
    torch.set_num_threads(default)
    return {**out, "default_threads": CORES}


def run(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"args": vars(args), "cores": os.cpu_count(), "models": {}}
    with tempfile.TemporaryDirectory(prefix="raymill-serve-user-") as tmp:
        body = _jpegs(1, "500x375")[0]
        for arch in args.archs:
            model = Path(tmp) / arch
            _make_model(model, arch)
            result = out["models"][arch] = {"model_ms": _model_ms(model, body), "rounds": []}
            for i in range(args.rounds):
                row = {kind: _serve_one(kind, model, body, args.requests) for kind in SERVERS}
                result["rounds"].append(row)
                print(f"serve_user {arch} round {i + 1}: {json.dumps(row)}", flush=True)
    return out


def render(result: dict[str, Any]) -> str:
    lines = [f"c=1: {result['args']['requests']} sequential requests over one keep-alive connection (httpx), one "
             "500x375 JPEG, each server in its own process with its own Ray, started as a user starts it. The "
             "model's own time is one image's decode, preprocess and forward pass in a plain process: back to back "
             f"on every core (b2b, all: how #39's probe measured it), back to back on 1 thread (b2b, 1: as the "
             f"replica runs it), and as lone calls {GAP_S * 1e3:.0f} ms apart on 1 thread (lone, 1).", ""]
    targets = []
    for arch, model in result["models"].items():
        own, cores = model["model_ms"], model["model_ms"]["default_threads"]
        owns = {"b2b, all": own[f"threads_{cores}"], "b2b, 1": own["threads_1"], "lone, 1": own["lone_threads_1"]}
        rows, measured = [], {k: [] for k in owns}
        for i, row in enumerate(model["rounds"], 1):
            floor, ours = row["floor"]["p50_ms"], row["ours"]["p50_ms"]
            ratios = {k: ratio(ours, floor + v) for k, v in owns.items()}
            for k, r in ratios.items():
                if r is not None:
                    measured[k].append(r)
            every = row.get("ours, every core", {}).get("p50_ms")
            rows.append([i, ours, fmt(every, 2), floor, *(fmt(r, 2) for r in ratios.values()),
                         *(fmt((row[kind]["loadavg_before"] or [None])[0], 2) for kind in ("ours", "floor"))])
        worst = {k: max(v) if v else None for k, v in measured.items()}
        lines += [f"**{arch}**, 64 px. The model's own ms: b2b on {cores} threads {owns['b2b, all']}, b2b on 1 "
                  f"{owns['b2b, 1']}, lone on 1 {owns['lone, 1']} (lone on {cores}: {own[f'lone_threads_{cores}']}).",
                  ""]
        lines += md_table(["round", "ours p50 ms", f"ours, {cores} threads p50 ms", "floor p50 ms",
                           *[f"ours / (floor + own {k})" for k in owns], "load (ours)", "load (floor)"], rows) + [""]
        targets += [{"target": f"{arch}: c=1 p50 ours / (floor + own {k}), worst round <= {TARGET}",
                     "measured": worst[k], "pass": worst[k] is not None and worst[k] <= TARGET} for k in owns]
    return "\n".join(lines + targets_table(targets))
