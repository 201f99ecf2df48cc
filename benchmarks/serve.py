"""Serving (P5): `raymill serve` against a bare FastAPI + uvicorn process on the same model.

Everything runs on loopback with one model and one set of request bodies:

  model    small_cnn width 32, 10 classes, 64 px, untrained weights (stages.model.publish.save_model).
  bodies   --bodies JPEGs of --size px (smooth noise, quality 90), sent as raw `image/jpeg`.
  fastapi  benchmarks/serve_apps.py in a subprocess: one uvicorn process, torch 1 thread,
           stages.model.predict.preprocess + predict_arrays inline in an async handler.
  ours     stages.serve.app.start with ServeConfig defaults (what `raymill serve` runs);
  nobatch  the same with serve.batching=false;
  2 replicas  the same with serve.num_replicas=2;
  one hop  the same with serve.model_deployment=false (model inside the ingress replica);
  ray floor  Ray Serve's floor: a no-op app with the same hops, limits and CPUs that returns a
           constant (benchmarks/serve_apps.floor_app).
  batch    images/s through the Open Inference Protocol (/v2, binary tensors) with N images a
           request, against `raymill infer` on the same model (benchmarks/serve_batch.py).

The Serve variants are apps on one Ray (own route prefixes). Ray gets 2x the machine's
cores (+ 1) as logical CPUs so that the idle variants can sit beside the measured one; the measured
one still has its default 0.5 CPU (torch 1 thread) per replica. Each --ingress mode restarts Ray
with that mode's environment (stages.serve.app.ingress_env) and measures FastAPI again beside it.

Load: k async httpx clients (k = each of --levels) share --requests requests over keep-alive
connections, after a few untimed warm-up requests, stopping early at --time-cap. Per level:
client p50/p99 latency, requests/s (200s over wall time), non-200 count, and the p50 of the
response's `latency_ms` (time inside the app: ingress + model call) to show where the time goes. Variants are
measured in --rounds interleaved rounds; the round with the most requests/s is reported.
"""
from __future__ import annotations

import argparse
import asyncio
import io
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import REPO

__all__ = ["add_arguments", "run", "render"]

VARIANTS = {"ours": {}, "nobatch": {"batching": False}, "2 replicas": {"num_replicas": 2},
            "one hop": {"model_deployment": False}, "no access log": {"access_log": False}}
# (what, variant, level, ratio of) -> bound; checked per ingress mode against FastAPI in that mode
TARGETS = [("c=1 p50 ours / fastapi <= 1.5", "p50_ms", "1", 1.5, "max"),
           ("c=32 req/s ours / fastapi >= 1.0", "rps", "32", 1.0, "min")]
BATCH_TARGET = 1.3  # c=32 req/s, ours (batching on) / nobatch
FLOOR_P50, FLOOR_RPS, V2_INFER = 1.2, 0.8, 0.7  # issue 22's targets against Ray's floor and `raymill infer`
# --quick: a smoke run of every row in a few minutes (numbers are not for RESULTS.md)
QUICK = {"bodies": 16, "requests": 60, "time_cap": 5.0, "rounds": 1, "ingress": "proxy", "levels": "1,32",
         "batch_images": 256, "infer_images": 1024}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--bodies", type=int, default=64, help="distinct JPEG bodies (default 64)")
    p.add_argument("--size", default="500x375", help="JPEG size WxH (default 500x375)")
    p.add_argument("--levels", default="1,8,32", help="client concurrency levels (default 1,8,32)")
    p.add_argument("--requests", type=int, default=300, help="timed requests per level (default 300)")
    p.add_argument("--time-cap", type=float, default=20.0, help="seconds per level at most (default 20)")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds (default 2)")
    p.add_argument("--ingress", default="proxy,throughput_optimized",
                   help="serve.ingress modes, each on a fresh Ray (default proxy,throughput_optimized)")
    p.add_argument("--batch-sizes", default="1,8,32", help="images per /v2 request (default 1,8,32)")
    p.add_argument("--batch-clients", type=int, default=8, help="concurrent /v2 clients (default 8)")
    p.add_argument("--batch-images", type=int, default=2048, help="images per /v2 batch size (default 2048)")
    p.add_argument("--infer-images", type=int, default=2000, help="images for `raymill infer` (default 2000)")
    p.add_argument("--quick", action="store_true", help="smoke run with small counts (not for RESULTS.md)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _make_model(out: Path, arch: str = "small_cnn") -> None:
    import torch

    from stages.model.publish import save_model
    from stages.model.zoo import build_model

    torch.manual_seed(0)
    info = {"architecture": arch, "width": 32, "dropout": 0.0, "classes": [f"c{i}" for i in range(10)],
            "image_size": 64, "resize": "crop", "mean": [0.5] * 3, "std": [0.25] * 3, "version": "bench"}
    save_model(str(out), build_model(arch, 10, width=32).state_dict(), info)  # resnets take no width


def _jpegs(n: int, size: str) -> list[bytes]:
    import numpy as np
    from PIL import Image

    w, h = (int(x) for x in size.lower().split("x"))
    rng, out = np.random.default_rng(5), []
    for _ in range(n):
        y, x = np.mgrid[0:h, 0:w]
        base = rng.uniform(0, 200, 3) + np.stack([x / w, y / h, (x + y) / (w + h)], -1) * 55
        buf = io.BytesIO()
        Image.fromarray(np.clip(base + rng.normal(0, 6, base.shape), 0, 255).astype(np.uint8)).save(
            buf, format="JPEG", quality=90)
        out.append(buf.getvalue())
    return out


def _wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 120, what: str = "the FastAPI baseline") -> None:
    """Wait for `url`/healthz; fail at once, naming `what`, when the child serving it has exited."""
    import httpx

    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode} before {url} was healthy")
        try:
            if httpx.get(f"{url}/healthz", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url}/healthz not healthy after {timeout_s:.0f} s")


async def _level(url: str, bodies: list[bytes], k: int, total: int, cap_s: float) -> dict[str, Any]:
    """k concurrent keep-alive clients share `total` requests; latency per 200, errors counted."""
    import httpx

    latencies: list[float] = []
    inside: list[float] = []  # the app's own `latency_ms`: ingress + model, without proxy and HTTP
    errors, issued = 0, 0
    headers = {"content-type": "image/jpeg"}
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=httpx.Limits(max_connections=k)) as ac:
        await asyncio.gather(*[ac.post("/predict", content=bodies[i % len(bodies)], headers=headers)
                               for i in range(k)])  # warm-up: open the k connections
        cpu_before, started = _cpu_by_role(), time.perf_counter()

        async def worker() -> None:
            nonlocal errors, issued
            while issued < total and time.perf_counter() - started < cap_s:
                i, issued = issued, issued + 1
                t0 = time.perf_counter()
                try:
                    r = await ac.post("/predict", content=bodies[i % len(bodies)], headers=headers)
                    ok = r.status_code == 200
                except httpx.HTTPError:
                    ok = False
                if ok:
                    latencies.append((time.perf_counter() - t0) * 1000)
                    inside.append(r.json().get("latency_ms", float("nan")))
                else:
                    errors += 1

        await asyncio.gather(*[worker() for _ in range(k)])
        wall = time.perf_counter() - started
        cpu = _per_request(cpu_before, _cpu_by_role(), len(latencies) + errors)
    lat = sorted(latencies) or [float("nan")]
    return {"p50_ms": round(statistics.median(lat), 2), "p99_ms": round(lat[int(0.99 * (len(lat) - 1))], 2),
            "rps": round(len(latencies) / wall, 1), "ok": len(latencies), "errors": errors,
            "server_p50_ms": round(statistics.median(inside), 2) if inside else None, "cpu_ms_per_request": cpu}


# Substring of a process's command line -> its role in the request path (first match wins).
# The floor app's model deployment is `Constant` (before 2026-11-25 it was counted as the ingress).
ROLES = [("ProxyActor", "proxy"), (":Classifier", "model replica"), (":Constant", "model replica"),
         ("ServeReplica", "ingress replica"),
         ("benchmarks.serve_apps", "fastapi"), ("raylet", "ray daemons"), ("gcs_server", "ray daemons"),
         ("site-packages/ray", "ray daemons"), ("ray::", "ray daemons")]


def _cpu_by_role() -> dict[str, float]:
    """CPU seconds used so far by every process on the machine, summed by role (see ROLES)."""
    import psutil

    totals: dict[str, float] = {}
    for proc in psutil.process_iter(["pid", "cmdline", "cpu_times"]):
        times, cmd = proc.info["cpu_times"], " ".join(proc.info["cmdline"] or [])
        if times is None:
            continue
        role = "client (httpx)" if proc.info["pid"] == os.getpid() else next(
            (r for key, r in ROLES if key in cmd), "other")
        totals[role] = totals.get(role, 0.0) + times.user + times.system
    return totals


def _per_request(before: dict[str, float], after: dict[str, float], requests: int) -> dict[str, float]:
    """CPU milliseconds per request by role between two _cpu_by_role snapshots (roles under 0.05 ms dropped)."""
    out = {role: 1000 * (after[role] - before.get(role, 0.0)) / max(1, requests) for role in after}
    return {role: round(ms, 2) for role, ms in sorted(out.items()) if ms >= 0.05}


def _forward_costs(model_dir: str, bodies: list[bytes], batch: int = 16) -> dict[str, float]:
    """In this process, torch 1 thread: decode+preprocess, and the forward pass per image at
    batch 1 and at `batch`: the most CPU that dynamic batching can save per request."""
    import torch

    from stages.model.predict import load_model, predict_arrays, preprocess

    torch.set_num_threads(1)
    model, info = load_model(model_dir)
    t0 = time.perf_counter()
    arrays = [preprocess(b, info) for b in bodies]
    decode = (time.perf_counter() - t0) / len(bodies)
    per_image = {}
    for size in (1, batch):
        predict_arrays(model, info, arrays[:size])  # warm-up
        t0, n = time.perf_counter(), 0
        while n < 4 * batch:
            predict_arrays(model, info, arrays[:size])
            n += size
        per_image[size] = (time.perf_counter() - t0) / n
    return {"decode_ms": round(1000 * decode, 2), "forward_b1_ms": round(1000 * per_image[1], 2),
            f"forward_b{batch}_ms": round(1000 * per_image[batch], 2), "batch": batch}


def _measure_mode(args, mode: str, model_dir: str, fastapi_url: str, bodies: list[bytes]) -> dict[str, Any]:
    """All variants plus FastAPI under one ingress mode: {variant: {level: best round}}."""
    import ray

    from stages.serve import app as serve_stage
    from stages.common import session
    from stages.common.config import RayConfig, ServeConfig

    from ray import serve

    from benchmarks.serve_apps import floor_app
    from benchmarks.serve_batch import v2_images_per_s

    base = ServeConfig(port=_free_port(), ingress=mode)
    env = serve_stage.ingress_env(base)
    os.environ.update(env)
    session.start(RayConfig(num_cpus=2 * (os.cpu_count() or 1) + 1))  # + 1: the floor app's 0.75 CPU
    try:
        urls = {"fastapi": fastapi_url}
        for i, (name, change) in enumerate(VARIANTS.items()):
            cfg = base.model_copy(update={**change, "app_name": f"bench{i}"})
            urls[name] = serve_stage.start(cfg, model_dir, route_prefix=f"/v{i}")
        serve.run(floor_app(base), name="floor", route_prefix="/floor")
        urls["ray floor"] = serve_stage.base_url(base) + "/floor"
        levels = [int(x) for x in args.levels.split(",")]
        best: dict[str, dict[str, Any]] = {name: {} for name in urls}
        for _ in range(args.rounds):
            for k in levels:
                for name, url in urls.items():
                    m = asyncio.run(_level(url, bodies, k, args.requests, args.time_cap))
                    if m["rps"] >= best[name].get(str(k), {}).get("rps", -1):
                        best[name][str(k)] = m
                    print(f"[serve bench] {mode:>20} {name:>10} c={k:<3} p50 {m['p50_ms']:7.2f} ms "
                          f"{m['rps']:7.1f} req/s errors {m['errors']}", flush=True)
        sizes = [int(n) for n in args.batch_sizes.split(",")]
        batch = v2_images_per_s(urls["ours"], base.model_name, bodies, sizes, args.batch_clients,
                                args.batch_images, 4 * args.time_cap)
        print(f"[serve bench] {mode:>20} /v2 images/s by images a request: "
              f"{ {n: m['images_per_s'] for n, m in batch.items()} }", flush=True)
        return best, batch
    finally:
        serve.shutdown()
        ray.shutdown()
        for key in env:
            os.environ.pop(key, None)


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.quick:
        vars(args).update(QUICK)
    with tempfile.TemporaryDirectory(prefix="raymill-serve-bench-") as tmp:
        model_dir = str(Path(tmp) / "model")
        _make_model(Path(model_dir))
        bodies = _jpegs(args.bodies, args.size)
        forward = _forward_costs(model_dir, bodies)
        port = _free_port()
        # Extend the child's PYTHONPATH: an install that relies on it (a carried site folder) keeps uvicorn.
        path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
        proc = subprocess.Popen([sys.executable, "-m", "benchmarks.serve_apps", "--model", model_dir,
                                 "--port", str(port)], env={**os.environ, "PYTHONPATH": path}, cwd=REPO)
        try:
            _wait_healthy(f"http://127.0.0.1:{port}", proc)
            measured = {mode: _measure_mode(args, mode, model_dir, f"http://127.0.0.1:{port}", bodies)
                        for mode in args.ingress.split(",")}
        finally:
            proc.terminate()
            proc.wait(timeout=30)
        infer = _infer_rate(model_dir, bodies, args.infer_images)
    modes, batch = {m: v[0] for m, v in measured.items()}, {m: v[1] for m, v in measured.items()}
    return {"bodies": args.bodies, "size": args.size, "mean_kib": round(sum(map(len, bodies)) / len(bodies) / 1024, 1),
            "levels": args.levels.split(","), "requests": args.requests, "rounds": args.rounds, "quick": args.quick,
            "modes": modes, "forward": forward, "batch": batch, "infer": infer,
            "targets": {m: _targets(v, forward, batch[m], infer) for m, v in modes.items()}}


def _infer_rate(model_dir: str, bodies: list[bytes], images: int) -> dict[str, Any]:
    """`raymill infer` on the same model and JPEGs, on a Ray of this machine's cores."""
    import ray

    from benchmarks.serve_batch import infer_images_per_s
    from stages.common import session
    from stages.common.config import RayConfig

    session.start(RayConfig())
    try:
        return infer_images_per_s(model_dir, bodies, images)
    finally:
        ray.shutdown()


def _floor_targets(best: dict[str, dict[str, Any]], forward: dict[str, Any], batch: dict[str, Any],
                   infer: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 22's rows: raymill against Ray's floor app, and /v2 at N=32 against `raymill infer`."""
    def row(what: str, ours: float | None, ref: float | None, bound: float, kind: str) -> dict[str, Any]:
        ratio = round(ours / ref, 2) if ours and ref else None
        return {"what": what, "ratio": ratio,
                "pass": ratio is not None and (ratio <= bound if kind == "max" else ratio >= bound)}

    floor = best.get("ray floor", {})
    model_ms = forward["decode_ms"] + forward["forward_b1_ms"]
    p50_floor = floor.get("1", {}).get("p50_ms")
    return [row(f"c=1 p50 ours / (floor + model's own {model_ms:.1f} ms) <= {FLOOR_P50}",
                best["ours"].get("1", {}).get("p50_ms"), p50_floor and p50_floor + model_ms, FLOOR_P50, "max"),
            row(f"c=32 req/s ours / floor >= {FLOOR_RPS}", best["ours"].get("32", {}).get("rps"),
                floor.get("32", {}).get("rps"), FLOOR_RPS, "min"),
            row(f"/v2 images/s at N=32 / `raymill infer` marginal >= {V2_INFER}",
                batch.get("32", {}).get("images_per_s"), infer.get("marginal_images_per_s"), V2_INFER, "min")]


def _targets(best: dict[str, dict[str, Any]], forward: dict[str, Any] | None = None,
             batch: dict[str, Any] | None = None, infer: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    rows = []
    for what, key, level, bound, kind in TARGETS:
        ours, ref = best["ours"].get(level, {}).get(key), best["fastapi"].get(level, {}).get(key)
        ratio = round(ours / ref, 2) if ours and ref else None
        ok = ratio is not None and (ratio <= bound if kind == "max" else ratio >= bound)
        rows.append({"what": what, "ratio": ratio, "pass": ok})
    on, off = best["ours"].get("32", {}).get("rps"), best["nobatch"].get("32", {}).get("rps")
    ratio = round(on / off, 2) if on and off else None
    rows.append({"what": f"c=32 req/s batching on / off >= {BATCH_TARGET}", "ratio": ratio,
                 "pass": ratio is not None and ratio >= BATCH_TARGET})
    return rows + (_floor_targets(best, forward, batch, infer) if forward and batch and infer else [])


def render(result: dict[str, Any]) -> str:
    if "modes" not in result:
        return "(result from an older benchmark layout; rerun `python -m benchmarks serve`)\n"
    levels = result["levels"]
    lines = [f"{result['bodies']} JPEG bodies of {result['size']} px (mean {result['mean_kib']} KiB), raw "
             f"`image/jpeg`, async httpx on loopback; {result['requests']} requests per level, best of "
             f"{result['rounds']} interleaved rounds. Cells: client p50 ms / requests/s [p50 of the app's own `latency_ms`; the rest of the client's p50 "
             f"is the proxy, HTTP and the client] (non-200 count if any).", ""]
    for mode, best in result["modes"].items():
        lines += [f"`serve.ingress={mode}`:", "", "| variant | " + " | ".join(f"c={k}" for k in levels) + " |",
                  "|---|" + "---:|" * len(levels)]
        for name, per_level in best.items():
            cells = [f"{m['p50_ms']:.1f} / {m['rps']:.0f}" + (f" [{m['server_p50_ms']:.1f}]" if m.get("server_p50_ms")
                                                              else "") + (f" ({m['errors']} err)" if m["errors"] else "")
                     for m in (per_level.get(k) for k in levels) if m]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines += _batch_table(result.get("batch", {}).get(mode), result.get("infer"))
        lines += ["", "| target | ratio | result |", "|---|---:|---|"]
        lines += [f"| {t['what']} | {t['ratio']} | {'PASS' if t['pass'] else 'FAIL'} |"
                  for t in result["targets"][mode]] + [""]
        lines += _cpu_table(best, result.get("forward"))
    return "\n".join(lines)


def _cpu_table(best: dict[str, dict[str, Any]], forward: dict[str, Any] | None) -> list[str]:
    """Where the time goes at c=32: CPU ms per request by process role, and what batching can save."""
    cells = {name: per_level.get("32", {}).get("cpu_ms_per_request") for name, per_level in best.items()}
    cells = {name: c for name, c in cells.items() if c}
    if not cells:
        return []
    roles = sorted({r for c in cells.values() for r in c})
    lines = ["CPU milliseconds per request at c=32, by process (all processes on the machine; 2 cores = "
             "2000 CPU ms per second):", "", "| variant | " + " | ".join(roles) + " | total |",
             "|---|" + "---:|" * (len(roles) + 1)]
    for name, c in cells.items():
        lines.append(f"| {name} | " + " | ".join(f"{c.get(r, 0):.2f}" for r in roles) + f" | {sum(c.values()):.2f} |")
    if forward and cells.get("nobatch"):
        b = forward["batch"]
        saving = forward["forward_b1_ms"] - forward[f"forward_b{b}_ms"]
        total = sum(cells["nobatch"].values())
        bound = total / max(total - saving, 1e-9)
        lines += ["", f"In one process, torch 1 thread: decode + preprocess {forward['decode_ms']} ms per image; "
                  f"forward pass {forward['forward_b1_ms']} ms per image alone, {forward[f'forward_b{b}_ms']} ms "
                  f"per image in batches of {b}. Batching can save at most {saving:.2f} ms of the {total:.2f} CPU "
                  f"ms a request costs without batching: at most {bound:.2f}x the requests/s when CPU-bound."]
    return lines + [""]


def _batch_table(batch: dict[str, Any] | None, infer: dict[str, Any] | None) -> list[str]:
    if not batch or not infer:
        return []
    lines = ["", "Images/s through `/v2/models/raymill/infer` (binary tensors, 8 clients) by images a request, "
             f"against `raymill infer` (InferConfig defaults) on {infer['images']} of the same JPEGs "
             f"({infer['images_per_s']} images/s end to end in {infer['seconds']} s, "
             f"{infer['marginal_images_per_s']} images/s marginal, start-up excluded):", "",
             "| images a request | images/s | request p50 ms | non-200 |", "|---:|---:|---:|---:|"]
    return lines + [f"| {n} | {m['images_per_s']} | {m['p50_ms']} | {m['errors']} |" for n, m in batch.items()]
