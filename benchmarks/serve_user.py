"""A lone request as a user meets it: `raymill serve` against Ray Serve's floor, each started the
way a user starts it, in its own process with its own Ray.

    python -m benchmarks serve_user [--requests 300] [--windows 6] [--rounds 3] [--archs small_cnn resnet18]

`benchmarks serve` measures its variants inside one process and one Ray (with extra logical CPUs
so that idle variants fit). #39's held-out probe ran the product's own command instead. Here:

  ours   `python -m workflow serve --model M --port P` (ServeConfig defaults: on a CPU the replica runs
         the model in onnxruntime, serve.engine=auto);
  ours, torch  (--torch) the same with serve.engine=torch (the product before onnxruntime);
  floor  a process that starts Ray as raymill does (session.start), then serve.start with the
         same HTTP options and serve.run(benchmarks.serve_apps.floor_app(cfg.serve)): the same two
         hops, limits and CPUs, answering a constant;
  every core  (--every-core) ours with serve.torch_threads = the cores (the replica runs on Ray's
         1 thread for a 0.5-CPU replica);
  model  the model's own time for one image in a plain process: decode + preprocess + forward
         pass, in torch and in onnxruntime, on 1 thread (as the replica) and on every core (torch's
         default, as a user measures it in a notebook); back to back, and as lone calls 10 ms apart
         (what a sequential client's requests are to the replica: a forward after an idle gap runs
         slower).

Two models (untrained, 64 px): benchmarks.serve's small_cnn width 32, whose forward pass hardly
gains from threads, and resnet18, which does. The body is one 500x375 JPEG.

Each round starts every server and keeps them all up at once; after 30 untimed requests each, it
sends --requests sequential requests to each over one keep-alive connection, in --windows windows
taken in turn (ours, floor, ours, floor, ...), and stops them with SIGTERM. A round's p50 pools
its windows. Why at once: one p50 per server start moved +-20% between starts of the same server
minutes apart on a 2-core box (2026-11-29: the floor's 9.2-12.5 ms, ours 9.6-13.7 ms), so one
round of servers started one after the other compared two draws of that drift, not the servers.
Alternating windows puts both under the same moment's load; the idle daemons of the other
server's Ray are beside each (on 2 cores, the price of a paired measurement). The spread over
rounds is reported, and the target is the worst round.
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

from benchmarks.common import REPO, fmt, loadavg, md_table, ratio, targets_table, wait_for_quiet
from benchmarks.serve import _free_port, _jpegs, _make_model, _wait_healthy

__all__ = ["add_arguments", "run", "render"]

TARGET = 1.2  # c=1 p50 ours / (floor + the model's own time), #39
ARCHS = ("small_cnn", "resnet18")
CORES = os.cpu_count() or 1  # "every core": the server's serve.torch_threads and the model's own threads
SERVERS = {"ours": [], "floor": None}
TORCH = {"ours, torch": ["--set", "serve.engine=torch"]}
EVERY_CORE = {"ours, every core": ["--set", f"serve.torch_threads={CORES}"]}
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
    p.add_argument("--windows", type=int, default=6, help="windows each server's requests are split into, "
                   "taken in turn across the servers (default 6)")
    p.add_argument("--rounds", type=int, default=3, help="rounds, each starting every server (default 3)")
    p.add_argument("--archs", nargs="+", default=list(ARCHS), choices=list(ARCHS), help="models (default: both)")
    p.add_argument("--torch", action="store_true", help="also ours with serve.engine=torch")
    p.add_argument("--every-core", action="store_true", help="also ours with serve.torch_threads = every core")
    p.add_argument("--quiet-s", type=float, default=45, help="longest wait before each round's servers start, "
                   "and again before their probe, for the load average to fall below 1.5 (default 45)")
    p.add_argument("--settle-s", type=float, default=5, help="wait between the servers' first healthy answers "
                   "and their probe, for their start-up work to settle (default 5)")


HEADERS = {"content-type": "image/jpeg"}


def _alternate(urls: dict[str, str], body: bytes, n: int, windows: int) -> dict[str, dict[str, Any]]:
    """{kind: {p50_ms, window_p50_ms}}: `n` sequential POSTs to each server over its own keep-alive
    connection, in `windows` windows taken in turn; p50_ms pools every window's requests."""
    import httpx

    clients = {kind: httpx.Client(base_url=url, timeout=60) for kind, url in urls.items()}
    times: dict[str, list[list[float]]] = {kind: [] for kind in urls}
    try:
        for client in clients.values():
            for _ in range(30):
                client.post("/predict", content=body, headers=HEADERS).raise_for_status()
        for w in range(windows):
            for kind, client in clients.items():
                window = []
                for _ in range(n // windows):
                    started = time.perf_counter()
                    client.post("/predict", content=body, headers=HEADERS).raise_for_status()
                    window.append((time.perf_counter() - started) * 1e3)
                times[kind].append(window)
    finally:
        for client in clients.values():
            client.close()
    return {kind: {"p50_ms": round(statistics.median([t for w in ws for t in w]), 2),
                   "window_p50_ms": [round(statistics.median(w), 2) for w in ws]} for kind, ws in times.items()}


def _start(extra: list[str] | None, model: Path, port: int) -> subprocess.Popen:
    command = ([sys.executable, "-c", FLOOR, str(port)] if extra is None else
               [sys.executable, "-m", "workflow", "serve", "--model", str(model), "--port", str(port), *extra])
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("RAY_ADDRESS", None)
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _round(servers: dict[str, list[str] | None], model: Path, body: bytes,
           args: argparse.Namespace) -> dict[str, Any]:
    """Start every server, probe them in alternating windows, stop them."""
    wait_for_quiet(args.quiet_s, CORES)
    load, procs, urls = loadavg(), {}, {}
    try:
        for kind, extra in servers.items():  # one at a time: their starts would compete for the cores
            port = _free_port()
            procs[kind], urls[kind] = _start(extra, model, port), f"http://127.0.0.1:{port}"
            _wait_healthy(urls[kind], procs[kind], timeout_s=180,
                          what="the floor app" if extra is None else f"raymill serve ({kind})")
        time.sleep(args.settle_s)  # the replicas' own start-up work settles
        wait_for_quiet(args.quiet_s, CORES)
        probe_load = loadavg()
        row = _alternate(urls, body, args.requests, args.windows)
    finally:
        for proc in procs.values():
            _stop(proc)
    return {kind: {**r, "loadavg_before": load, "loadavg_at_probe": probe_load} for kind, r in row.items()}


def _model_ms(model: Path, body: bytes) -> dict[str, Any]:
    """{<engine>_threads_N: ms back to back, <engine>_lone_threads_N: ms for calls GAP_S apart,
    default_threads: the N of every core}, for torch and onnxruntime and N = 1 and every core."""
    import torch

    from stages.model import runtime
    from stages.model.predict import load_model, predict_arrays, preprocess

    net, info = load_model(str(model))
    default, out = torch.get_num_threads(), {}
    for engine in ("torch", "onnxruntime"):
        for threads in sorted({1, CORES}):
            torch.set_num_threads(threads)
            forward = runtime.for_device(net, info, engine, torch.device("cpu"), threads)
            for key, gap in ((f"{engine}_threads_{threads}", 0.0), (f"{engine}_lone_threads_{threads}", GAP_S)):
                times = []
                for _ in range(250):
                    started = time.perf_counter()
                    predict_arrays(forward, info, [preprocess(body, info)], 3)
                    times.append((time.perf_counter() - started) * 1e3)
                    time.sleep(gap)
                out[key] = round(statistics.median(times[50:]), 3)
    torch.set_num_threads(default)
    return {**out, "default_threads": CORES}


def run(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"args": vars(args), "cores": os.cpu_count(), "models": {}, "design": "alternating"}
    servers = {**SERVERS, **(TORCH if args.torch else {}), **(EVERY_CORE if args.every_core else {})}
    with tempfile.TemporaryDirectory(prefix="raymill-serve-user-") as tmp:
        body = _jpegs(1, "500x375")[0]
        for arch in args.archs:
            model = Path(tmp) / arch
            _make_model(model, arch)
            result = out["models"][arch] = {"model_ms": _model_ms(model, body), "rounds": []}
            for i in range(args.rounds):
                row = _round(servers, model, body, args)
                result["rounds"].append(row)
                print(f"serve_user {arch} round {i + 1}: {json.dumps(row)}", flush=True)
    return out


def _probe_load(server: dict[str, Any]) -> float | None:
    """The 1-minute load average as the probe began (older results: at the server's start)."""
    return (server.get("loadavg_at_probe") or server.get("loadavg_before") or [None])[0]


def _spread(server: dict[str, Any] | None) -> str:
    """A round's window p50s as 'min-max' (older results had one window)."""
    windows = (server or {}).get("window_p50_ms")
    return f"{min(windows):.1f}-{max(windows):.1f}" if windows else "-"


def render(result: dict[str, Any]) -> str:
    together = result.get("design") == "alternating"
    how = (f"every server of a round up at once, its {result['args'].get('windows')} windows taken in turn "
           "across the servers, the p50 pooled over them" if together else
           "each server started and probed alone, one after the other")
    lines = [f"c=1: {result['args']['requests']} sequential requests a server and round over one keep-alive "
             f"connection (httpx), one 500x375 JPEG; {how}; each server in its own process with its own Ray, "
             "started as a user starts it. ours: the defaults (on a CPU, onnxruntime); ours, torch: "
             "serve.engine=torch. The model's own time is one image's decode, preprocess and forward pass in a "
             "plain process: in torch back to back on every core (torch b2b all: how #39's probe measured it) "
             f"and as lone calls {GAP_S * 1e3:.0f} ms apart on 1 thread (as the replica runs it), and the same "
             "in onnxruntime.", ""]
    targets = []
    for arch, model in result["models"].items():
        own, cores = model["model_ms"], model["model_ms"]["default_threads"]
        owns = {"torch b2b all": own[f"torch_threads_{cores}"], "torch lone 1": own["torch_lone_threads_1"],
                "onnxruntime lone 1": own["onnxruntime_lone_threads_1"]}
        pairs = [("ours", "torch b2b all"), ("ours", "onnxruntime lone 1"), ("ours, torch", "torch b2b all"),
                 ("ours, torch", "torch lone 1")]
        pairs = [pair for pair in pairs if any(pair[0] in row for row in model["rounds"])]
        rows, measured = [], {pair: [] for pair in pairs}
        for i, row in enumerate(model["rounds"], 1):
            floor = row["floor"]["p50_ms"]
            ratios = {(kind, k): ratio(row[kind]["p50_ms"], floor + owns[k]) for kind, k in pairs}
            for pair, r in ratios.items():
                if r is not None:
                    measured[pair].append(r)
            rows.append([i, *(fmt(row.get(kind, {}).get("p50_ms"), 2) for kind in ("ours", "ours, torch", "floor")),
                         _spread(row.get("ours")), _spread(row.get("floor")),
                         *(fmt(ratios.get(pair), 2) for pair in pairs), fmt(_probe_load(row["ours"]), 2)])
        lines += [f"**{arch}**, 64 px. The model's own ms, back to back / lone, on 1 thread and on {cores}: " + "; ".join(
            f"{e} {own[f'{e}_threads_1']} / {own[f'{e}_lone_threads_1']} and {own[f'{e}_threads_{cores}']} / "
            f"{own[f'{e}_lone_threads_{cores}']}" for e in ("torch", "onnxruntime")) + ".", ""]
        lines += md_table(["round", "ours p50 ms", "ours, torch p50 ms", "floor p50 ms", "ours window p50s",
                           "floor window p50s", *[f"{kind} / (floor + {k})" for kind, k in pairs],
                           "load at probe"], rows) + [""]
        targets += [{"target": f"{arch}: c=1 p50 {kind} / (floor + own {k}), worst round <= {TARGET}",
                     "measured": max(v) if v else None, "pass": bool(v) and max(v) <= TARGET}
                    for (kind, k), v in measured.items() if kind == "ours"]
    return "\n".join(lines + targets_table(targets))
